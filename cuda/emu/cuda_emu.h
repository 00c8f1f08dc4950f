// cuda_emu.h: run CUDA kernel source on CPU threads, for testing without a GPU.
//
// One OS thread per CUDA thread of a block; the blocks of a grid run in turn on the
// same thread team. __syncthreads is a block barrier, warp shuffles exchange values
// through a per-warp buffer between two warp barriers. Every barrier times out
// (KVB_EMU_TIMEOUT_MS, default 20000) and aborts with a message naming the barrier
// and block, and a barrier reached by threads at different call kinds (e.g. some
// threads exited while others wait in __syncthreads) aborts immediately: both are
// kernel bugs. Shared memory is poisoned with 0xFF (NaN as floats) before every block,
// so reading it before writing shows up as NaN. 16-byte vector accesses are
// alignment-checked through KVB_CHECK_ALIGNED16.
//
// Kernels are launched with emu::launch(kernel, grid, block, smem_bytes, args...) or,
// from a type-erased argument array like cuLaunchKernel, emu::launch_packed.
#pragma once

#define KVB_EMULATION 1

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

// ---- CUDA keywords ------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static __shared__ arrays: one instance, shared by the block's threads (blocks of a
// launch run one after another and launches are serialized).
#define __shared__ static

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __uint_as_float(unsigned int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// ---- half and bfloat16 (bit-exact conversions, round to nearest even) ----------------
struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};

inline float __half2float(__half h) {
  const unsigned int sign = (h.x & 0x8000u) << 16;
  const unsigned int exp = (h.x >> 10) & 0x1fu;
  const unsigned int man = h.x & 0x3ffu;
  unsigned int bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value = man * 2^-24
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  return __uint_as_float(bits);
}

inline __half __float2half_rn(float f) {
  const unsigned int bits = __float_as_uint(f);
  const unsigned short sign = static_cast<unsigned short>((bits >> 16) & 0x8000u);
  const unsigned int abs = bits & 0x7fffffffu;
  __half h;
  if (abs >= 0x7f800000u) {  // inf or nan
    h.x = sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
    return h;
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    h.x = sign | 0x7c00u;
    return h;
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Scale to units of 2^-24 and round to nearest even in float arithmetic.
    const float scaled = std::ldexp(__uint_as_float(abs), 24);
    const float r = std::nearbyint(scaled);  // default rounding mode: to nearest even
    h.x = sign | static_cast<unsigned short>(r);
    return h;
  }
  const unsigned int exp = (abs >> 23) - 112u;
  unsigned int man = abs & 0x7fffffu;
  unsigned int out = (exp << 10) | (man >> 13);
  const unsigned int rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (out & 1u))) ++out;  // carry may bump exponent
  h.x = sign | static_cast<unsigned short>(out);
  return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 b) {
  return __uint_as_float(static_cast<unsigned int>(b.x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int bits = __float_as_uint(f);
  __nv_bfloat16 b;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // nan stays a (quiet) nan
    b.x = static_cast<unsigned short>((bits >> 16) | 0x40u);
    return b;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  b.x = static_cast<unsigned short>(bits >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

namespace emu {

[[noreturn]] inline void fail(const char* msg) {
  std::fprintf(stderr, "cuda_emu: %s\n", msg);
  std::fflush(stderr);
  std::abort();
}

inline int timeout_ms() {
  const char* env = std::getenv("KVB_EMU_TIMEOUT_MS");
  return env ? std::atoi(env) : 20000;
}

enum BarrierKind { kSyncThreads = 1, kBlockExit, kBlockPoisoned, kWarpSync, kShflWrite, kShflRead };

inline const char* kind_name(int kind) {
  switch (kind) {
    case kSyncThreads: return "__syncthreads";
    case kBlockExit: return "kernel exit";
    case kBlockPoisoned: return "block start";
    case kWarpSync: return "__syncwarp";
    case kShflWrite: return "warp shuffle (write)";
    case kShflRead: return "warp shuffle (read)";
    default: return "?";
  }
}

// A reusable barrier for a fixed number of threads, with deadlock timeout and a check
// that every thread of one phase arrived at the same kind of barrier.
class Barrier {
 public:
  explicit Barrier(int expected, const char* scope) : expected_(expected), scope_(scope) {}

  void wait(int kind) {
    std::unique_lock<std::mutex> lock(mu_);
    if (arrived_ == 0) {
      kind_ = kind;
    } else if (kind_ != kind) {
      char msg[256];
      std::snprintf(msg, sizeof msg,
                    "divergent barrier in %s of block (%u,%u,%u): thread (%u,%u,%u) reached %s "
                    "while %d other thread(s) wait in %s",
                    scope_, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y,
                    threadIdx.z, kind_name(kind), arrived_, kind_name(kind_));
      fail(msg);
    }
    const unsigned long gen = generation_;
    if (++arrived_ == expected_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    // A block-wide barrier waits twice as long as a warp's: when a warp-level barrier
    // deadlocks, the threads of its block that already reached kernel exit (or a
    // __syncthreads) wait too, and the warp's own, more specific report must come first.
    const int ms = kind == kWarpSync || kind == kShflWrite || kind == kShflRead
                       ? timeout_ms()
                       : 2 * timeout_ms();
    if (!cv_.wait_for(lock, std::chrono::milliseconds(ms),
                      [&] { return generation_ != gen; })) {
      char msg[256];
      std::snprintf(msg, sizeof msg,
                    "deadlock: %s in %s of block (%u,%u,%u) did not complete within %d ms: "
                    "%d of %d threads arrived",
                    kind_name(kind_), scope_, blockIdx.x, blockIdx.y, blockIdx.z, ms, arrived_,
                    expected_);
      fail(msg);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int expected_;
  const char* scope_;
  int arrived_ = 0;
  int kind_ = 0;
  unsigned long generation_ = 0;
};

struct Warp {
  explicit Warp(int lanes) : lanes(lanes), barrier(lanes, "a warp") {}
  int lanes;
  Barrier barrier;
  unsigned long long exchange[32] = {};
};

// State shared by the thread team of one launch.
struct Team {
  Team(int threads, size_t smem_bytes)
      : threads(threads), smem_bytes(smem_bytes), block_barrier(threads, "the block") {
    for (int w = 0; w * 32 < threads; ++w) {
      warps.emplace_back(new Warp(std::min(32, threads - w * 32)));
    }
    if (smem_bytes) {
      // Exact size, so that AddressSanitizer sees any access past the end.
      smem = static_cast<unsigned char*>(::operator new(smem_bytes, std::align_val_t(16)));
    }
  }
  ~Team() {
    if (smem) ::operator delete(smem, std::align_val_t(16));
  }
  int threads;
  size_t smem_bytes;
  unsigned char* smem = nullptr;
  Barrier block_barrier;
  std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local Team* tl_team = nullptr;
inline thread_local int tl_linear = 0;

inline unsigned char* dynamic_smem() { return tl_team->smem; }

inline void check_aligned16(const void* ptr, const char* file, int line) {
  if (reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0) {
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "misaligned 16-byte access at %p (%s:%d) in block (%u,%u,%u) thread (%u,%u,%u)",
                  ptr, file, line, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y,
                  threadIdx.z);
    fail(msg);
  }
}

inline Warp& my_warp() { return *tl_team->warps[tl_linear / 32]; }
inline int my_lane() { return tl_linear % 32; }

inline void check_mask(unsigned mask, const char* what) {
  const Warp& w = my_warp();
  const unsigned full = w.lanes == 32 ? 0xffffffffu : ((1u << w.lanes) - 1u);
  if ((mask & full) != full) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s with partial mask 0x%08x is not emulated (warp has %d lanes)",
                  what, mask, w.lanes);
    fail(msg);
  }
}

// Every lane publishes `var`, then reads lane `src` (its own value when src < 0).
template <typename T>
T exchange(T var, int src) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  Warp& w = my_warp();
  const int lane = my_lane();
  std::memcpy(&w.exchange[lane], &var, sizeof(T));
  w.barrier.wait(kShflWrite);
  T out = var;
  if (src >= 0 && src < w.lanes) std::memcpy(&out, &w.exchange[src], sizeof(T));
  w.barrier.wait(kShflRead);  // nobody overwrites the buffer before all have read
  return out;
}

// Run `body` for every thread of every block of `grid`.
inline void run_grid(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  static std::mutex launch_mutex;
  std::lock_guard<std::mutex> guard(launch_mutex);
  const long threads = static_cast<long>(block.x) * block.y * block.z;
  if (threads < 1 || threads > 1024) fail("block must have 1..1024 threads");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  Team team(static_cast<int>(threads), smem_bytes);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (long t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      tl_team = &team;
      tl_linear = static_cast<int>(t);
      threadIdx = {static_cast<unsigned>(t % block.x),
                   static_cast<unsigned>((t / block.x) % block.y),
                   static_cast<unsigned>(t / (static_cast<long>(block.x) * block.y))};
      blockDim = block;
      gridDim = grid;
      for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            if (t == 0 && team.smem) std::memset(team.smem, 0xff, team.smem_bytes);
            team.block_barrier.wait(kBlockPoisoned);
            body();
            team.block_barrier.wait(kBlockExit);
          }
        }
      }
    });
  }
  for (auto& th : pool) th.join();
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
            Args... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  std::tuple<Params...> values(static_cast<Params>(args)...);
  run_grid(grid, block, smem_bytes, [&] { std::apply(kernel, values); });
}

template <typename... Params, std::size_t... I>
void launch_packed_impl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                        void** args, std::index_sequence<I...>) {
  launch(kernel, grid, block, smem, *static_cast<Params*>(args[I])...);
}

// Launch from an array of pointers to the arguments, as cuLaunchKernel takes them.
template <typename... Params>
void launch_packed(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, void** args) {
  launch_packed_impl(kernel, grid, block, smem, args, std::index_sequence_for<Params...>{});
}

}  // namespace emu

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
