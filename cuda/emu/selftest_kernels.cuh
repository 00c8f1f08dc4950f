// Kernels that exercise the emulator itself (tests/ops/test_ops_emu_runtime.py).
#pragma once

#include "../kv_common.cuh"

// Warp intrinsics: per thread, six results of lane arithmetic (see the test).
extern "C" __global__ void emu_shuffle_kernel(int* out) {
  const int t = threadIdx.x;
  const int lane = t % 32;
  int sum = lane;
  for (int m = 16; m >= 1; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  out[6 * t + 0] = sum;                                               // 496 in every lane
  out[6 * t + 1] = __shfl_sync(0xffffffffu, lane * 10, 3);            // broadcast lane 3
  out[6 * t + 2] = __shfl_down_sync(0xffffffffu, lane, 1);            // lane + 1, last keeps
  out[6 * t + 3] = __shfl_up_sync(0xffffffffu, lane, 2);              // lane - 2, first keep
  out[6 * t + 4] = __shfl_xor_sync(0xffffffffu, lane, 4, 8);          // within groups of 8
  out[6 * t + 5] = static_cast<int>(__shfl_sync(0xffffffffu, 0.5f + lane, 31 - lane));
}

// Shared memory, barriers and atomics across blocks.
extern "C" __global__ void emu_block_kernel(int* counter, float* fsum, int* maxv, int* out) {
  __shared__ int tile[128];
  tile[threadIdx.x] = static_cast<int>(blockIdx.x * 1000 + threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
  atomicAdd(counter, 1);
  atomicAdd(fsum, 0.5f);
  atomicMax(maxv, static_cast<int>(blockIdx.x * 1000 + threadIdx.x));
}

// Bugs the emulator must report: mode 0 thread 0 exits early while the others wait in
// __syncthreads; mode 1 half a warp shuffles (never completes: deadlock); mode 2 a
// misaligned 16-byte load.
extern "C" __global__ void emu_bug_kernel(int mode, unsigned char* buf) {
  if (mode == 0) {
    if (threadIdx.x == 0) return;
    __syncthreads();
  } else if (mode == 1) {
    if (threadIdx.x % 32 < 16) buf[0] = static_cast<unsigned char>(__shfl_xor_sync(0xffffffffu, 1, 1));
  } else {
    kvb::Vec16 v = kvb::load16(buf + 4);
    buf[0] = static_cast<unsigned char>(v.w[0]);
  }
}

// A slow thread is not a deadlock: thread 0 sleeps `sleep_ms` before the barrier that every
// other thread already waits in (a loaded machine looks like this), then all write.
extern "C" __global__ void emu_slow_thread_kernel(int sleep_ms, int* out) {
  if (threadIdx.x == 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}
