// A kernel that exercises the emulated cp.async pipeline (tests/ops/test_decode_kernel_emu.py).
// A .h (not .cuh) so that emu_runtime's source hash sees it.
#pragma once

#include <cuda_pipeline_primitives.h>

#include "../kv_common.cuh"

// One warp copies src[0..256) (floats) to shared memory with 16-byte cp.async in two
// groups (lane l: floats 4l..4l+3 in group 0, 128 + 4l.. in group 1), then lane l reads
// the first float another lane copied in each group into out[l] and out[32 + l].
// mode 0: wait for both groups, then __syncwarp (correct); 1: no wait; 2: wait_prior(1)
// only (group 1 still in flight); 3: both waits but no __syncwarp; 4: like 0 with group 1
// zero-filled (nothing read from src).
extern "C" __global__ void emu_pipeline_kernel(const float* src, float* out, int mode) {
  __shared__ __align__(16) float buf[256];
  const int lane = threadIdx.x;
  __pipeline_memcpy_async(buf + 4 * lane, src + 4 * lane, 16);
  __pipeline_commit();
  __pipeline_memcpy_async(buf + 128 + 4 * lane, src + 128 + 4 * lane, 16, mode == 4 ? 16 : 0);
  __pipeline_commit();
  if (mode == 0 || mode == 3 || mode == 4) {
    __pipeline_wait_prior(0);
  } else if (mode == 2) {
    __pipeline_wait_prior(1);
  }
  if (mode != 3) __syncwarp();
  const int from = (lane * 7 + 3) % 32;  // another lane's copy
  out[lane] = buf[4 * from];
  out[32 + lane] = buf[128 + 4 * from];
  __syncwarp();
}
