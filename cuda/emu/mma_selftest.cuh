// Kernels that check the warp-level PTX helpers of cuda/warp_mma.cuh (ldmatrix, mma.sync
// m16n8k16) lane by lane against the PTX ISA's fragment layouts and a plain matrix product
// (tests/ops/test_ops_emu_mma.py). NVRTC compiles the same file in that test, so the
// helpers the emulator runs are valid PTX.
#pragma once

#include "../warp_mma.cuh"

// One warp, raw registers: lane l passes a[4l..4l+3], b[2l..2l+1], c[4l..4l+3] and writes
// its d to d[4l..4l+3].
template <typename T>
__global__ void emu_mma_raw_kernel(const unsigned* a, const unsigned* b, const float* c,
                                   float* d) {
  const int l = threadIdx.x;
  unsigned ra[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
  unsigned rb[2] = {b[2 * l], b[2 * l + 1]};
  float rc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
  float rd[4];
  kvb::mma_16816<T>(rd, ra, rb, rc);
  for (int i = 0; i < 4; ++i) d[4 * l + i] = rd[i];
}

// One warp: N 8x8 matrices of 16-bit elements, tile rows 8m..8m+7 = matrix m (tile is
// 8N x 8, packed), staged in shared memory with a 16-element row stride; lane l passes the
// address of tile row l (row l % 8 of matrix l / 8) and writes its N registers to
// out[N l..N l + N - 1].
template <int N, bool kTrans>
__global__ void emu_ldmatrix_kernel(const unsigned short* tile, unsigned* out) {
  __shared__ __align__(16) unsigned short smem[32 * 16];
  const int l = threadIdx.x;
  for (int i = l; i < 8 * N * 8; i += 32) smem[(i / 8) * 16 + i % 8] = tile[i];
  __syncwarp();
  const unsigned short* row = smem + (l % (8 * N)) * 16;
  unsigned r[4] = {0u, 0u, 0u, 0u};
  if constexpr (N == 4) {
    kvb::ldmatrix_x4<kTrans>(r, row);
  } else {
    unsigned r2[2];
    kvb::ldmatrix_x2<kTrans>(r2, row);
    r[0] = r2[0];
    r[1] = r2[1];
  }
  for (int i = 0; i < N; ++i) out[N * l + i] = r[i];
}

// One warp, the way the attention kernels feed the tensor cores: a (16x16, row-major) by
// ldmatrix.x4, B from bt (8x16: row n holds column n of B, as K rows hold K^T) by
// ldmatrix.x2 and from bk (16x8, row-major, as V rows) by ldmatrix.x2.trans; c (16x8 fp32,
// row-major) through the C layout. Writes d1 = a bt^T + c and d2 = a bk + c, row-major.
template <typename T>
__global__ void emu_mma_tile_kernel(const T* a, const T* bt, const T* bk, const float* c,
                                    float* d1, float* d2) {
  __shared__ __align__(16) T a_s[16 * 24];
  __shared__ __align__(16) T bt_s[8 * 24];
  __shared__ __align__(16) T bk_s[16 * 8];
  const int l = threadIdx.x;
  for (int i = l; i < 256; i += 32) a_s[(i / 16) * 24 + i % 16] = a[i];
  for (int i = l; i < 128; i += 32) {
    bt_s[(i / 16) * 24 + i % 16] = bt[i];
    bk_s[i] = bk[i];
  }
  __syncwarp();
  const int g = l / 4, t = l % 4;
  unsigned fa[4], fb[2], fk[2];
  // Matrices of a: rows 0-7 / 8-15 (lanes 0-7 / 8-15, then again for columns 8-15).
  kvb::ldmatrix_x4<false>(fa, a_s + (l % 16) * 24 + (l / 16) * 8);
  // B = bt^T: matrix 0 = columns k 0-7 of the 8 rows n, matrix 1 = k 8-15.
  kvb::ldmatrix_x2<false>(fb, bt_s + (l % 8) * 24 + ((l / 8) % 2) * 8);
  // B = bk: matrix 0 = rows k 0-7, matrix 1 = rows k 8-15, transposed.
  kvb::ldmatrix_x2<true>(fk, bk_s + (l % 16) * 8);
  float fc[4], o1[4], o2[4];
  for (int i = 0; i < 4; ++i) fc[i] = c[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
  kvb::mma_16816<T>(o1, fa, fb, fc);
  kvb::mma_16816<T>(o2, fa, fk, fc);
  for (int i = 0; i < 4; ++i) {
    d1[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = o1[i];
    d2[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = o2[i];
  }
}
