// Kernels that check the emulated warp matrix functions (cuda/emu/include/mma.h) against a
// plain matrix product (tests/ops/test_ops_emu_wmma.py). The same file is compiled by NVRTC
// against CUDA's real <mma.h> in that test, so the emulated API cannot drift from CUDA's.
#pragma once

#include <mma.h>

#include "../kv_common.cuh"

// One warp: d = (a * b + c) * 0.5, through shared memory staging for a and b so that the
// loads read memory other lanes wrote (after a __syncwarp), with the layouts and shape of
// the template. a is M x K, b is K x N (each in its layout, tightly packed), c and d are
// M x N fp32 row-major; lda/ldb are K or M / N or K by layout; d_col_major stores d
// column-major instead.
template <typename T, int M, int N, int K, typename LA, typename LB>
__global__ void emu_wmma_kernel(const T* a, const T* b, const float* c, float* d, int lda, int ldb,
                                int d_col_major) {
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(32) T a_s[M * K];
  __shared__ __align__(32) T b_s[K * N];
  __shared__ __align__(32) float c_s[M * N];
  const int lane = threadIdx.x;
  for (int i = lane; i < M * K; i += 32) a_s[i] = a[i];
  for (int i = lane; i < K * N; i += 32) b_s[i] = b[i];
  for (int i = lane; i < M * N; i += 32) c_s[i] = c[i];
  __syncwarp();
  wmma::fragment<wmma::matrix_a, M, N, K, T, LA> fa;
  wmma::fragment<wmma::matrix_b, M, N, K, T, LB> fb;
  wmma::fragment<wmma::accumulator, M, N, K, float> fc;
  wmma::load_matrix_sync(fa, a_s, lda);
  wmma::load_matrix_sync(fb, b_s, ldb);
  wmma::load_matrix_sync(fc, c_s, N, wmma::mem_row_major);
  wmma::mma_sync(fc, fa, fb, fc);
  for (int i = 0; i < fc.num_elements; ++i) fc.x[i] *= 0.5f;
  if (d_col_major) {
    wmma::store_matrix_sync(d, fc, M, wmma::mem_col_major);
  } else {
    wmma::store_matrix_sync(d, fc, N, wmma::mem_row_major);
  }
}

// A missed __syncwarp: the warp stores a 16x16 accumulator of ones to shared memory and
// every lane counts the elements it reads back that are not 1 (with sync != 0 a __syncwarp
// separates the store from the reads and every count is 0). fill_fragment(T) and the
// accumulator fill are checked on the way.
__global__ void emu_wmma_sync_kernel(int sync, int* not_one) {
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(32) float tile[256];
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.0f);
  wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
  if (sync) __syncwarp();
  int bad = 0;
  for (int i = 0; i < 256; ++i) bad += tile[i] != 1.0f;
  not_one[threadIdx.x] = bad;
}
