// cuda_emu_intrinsics.h (part of cuda_emu.h): the device functions kernels call:
// __syncthreads, __syncwarp, the __shfl_*_sync shuffles, and the atomics.
#pragma once

#include "cuda_emu_warp.h"

// ---- device intrinsics ----------------------------------------------------------------
inline void __syncthreads() { emu::tl_team->block_barrier.wait(emu::kSyncThreads); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check_mask(mask, "__syncwarp");
  emu::my_warp().barrier.wait(emu::kWarpSync);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  emu::check_mask(mask, "__shfl_sync");
  const int lane = emu::my_lane();
  return emu::exchange(var, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  emu::check_mask(mask, "__shfl_xor_sync");
  const int lane = emu::my_lane();
  const int src = lane ^ lane_mask;
  // Reading from a later segment of `width` lanes returns the caller's own value.
  return emu::exchange(var, (src & ~(width - 1)) > (lane & ~(width - 1)) ? -1 : src);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  emu::check_mask(mask, "__shfl_down_sync");
  const int lane = emu::my_lane();
  const int src = lane + static_cast<int>(delta);
  return emu::exchange(var, (src & ~(width - 1)) != (lane & ~(width - 1)) ? -1 : src);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  emu::check_mask(mask, "__shfl_up_sync");
  const int lane = emu::my_lane();
  const int src = lane - static_cast<int>(delta);
  return emu::exchange(var, (src < (lane & ~(width - 1))) ? -1 : src);
}

inline int atomicAdd(int* addr, int v) { return __atomic_fetch_add(addr, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* addr, unsigned v) {
  return __atomic_fetch_add(addr, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* addr, unsigned long long v) {
  return __atomic_fetch_add(addr, v, __ATOMIC_SEQ_CST);
}
inline int atomicCAS(int* addr, int expected, int desired) {
  __atomic_compare_exchange_n(addr, &expected, desired, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return expected;
}
inline unsigned atomicCAS(unsigned* addr, unsigned expected, unsigned desired) {
  __atomic_compare_exchange_n(addr, &expected, desired, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return expected;
}
inline float atomicAdd(float* addr, float v) {
  unsigned* bits = reinterpret_cast<unsigned*>(addr);
  unsigned old = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  while (true) {
    const unsigned desired = __float_as_uint(__uint_as_float(old) + v);
    if (__atomic_compare_exchange_n(bits, &old, desired, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST)) {
      return __uint_as_float(old);
    }
  }
}
inline int atomicMax(int* addr, int v) {
  int old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(addr, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicMin(int* addr, int v) {
  int old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
  while (old > v && !__atomic_compare_exchange_n(addr, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicExch(int* addr, int v) { return __atomic_exchange_n(addr, v, __ATOMIC_SEQ_CST); }
