// Emulation of the warp-level PTX that cuda/warp_mma.cuh issues (ldmatrix, mma.sync
// m16n8k16), per lane, with the fragment layouts of the PTX ISA:
//   * "Matrix fragments for mma.m16n8k16 with floating point type" (A, B, C/D below);
//   * "Warp-level matrix load instruction: ldmatrix".
// Each operation is a warp collective (emu::warp_collective): every lane hands in its own
// registers (or its row address); when all 32 lanes have arrived, the whole warp's
// operation is computed at once from the operands as the ISA distributes them, and each
// lane takes back exactly the registers the ISA gives it. So a kernel that assumes a wrong
// layout (a transposed fragment, a lane's rows mixed up) gets wrong numbers here, as on the
// GPU, and a lane that skips the instruction deadlocks the warp.
#pragma once

#include "cuda_emu.h"

namespace emu {
namespace ptx {

// lane = 4 * g + t: g = groupID, t = threadID_in_group.
inline int group_of(int lane) { return lane >> 2; }
inline int thread_in_group(int lane) { return lane & 3; }

// Element i (0..7, two per .b32 register, low half first) of a lane's A fragment (16x16).
inline void a_position(int lane, int i, int& row, int& col) {
  row = group_of(lane) + 8 * ((i >> 1) & 1);
  col = 2 * thread_in_group(lane) + (i & 1) + 8 * (i >> 2);
}

// Element i (0..3) of a lane's B fragment (16x8, K x N).
inline void b_position(int lane, int i, int& row, int& col) {
  row = 2 * thread_in_group(lane) + (i & 1) + 8 * (i >> 1);
  col = group_of(lane);
}

// Element i (0..3) of a lane's C/D fragment (16x8 fp32).
inline void c_position(int lane, int i, int& row, int& col) {
  row = group_of(lane) + 8 * (i >> 1);
  col = 2 * thread_in_group(lane) + (i & 1);
}

template <typename T>
inline float half_to_float(unsigned short bits);
template <>
inline float half_to_float<__half>(unsigned short bits) {
  return __half2float(__half{bits});
}
template <>
inline float half_to_float<__nv_bfloat16>(unsigned short bits) {
  return __bfloat162float(__nv_bfloat16{bits});
}

// 16-bit element e (0: low half, 1: high half) of a register.
inline unsigned short half_of(unsigned reg, int e) {
  return static_cast<unsigned short>(e ? reg >> 16 : reg & 0xffffu);
}

struct MmaIn {
  unsigned a[4];
  unsigned b[2];
  float c[4];
};
struct MmaOut {
  float d[4];
};

// D = A B + C for the warp: products of the 16-bit inputs are exact in fp32 and summed in
// fp32 (the order of the sum is not the hardware's). Each element's sum runs over k in
// order from C; the loops keep N innermost so the compiler vectorizes a row's 8 columns.
template <typename T>
inline void mma_16816_warp(const MmaIn* in, MmaOut* out) {
  float a[16][16], b[16][8], d[16][8];
  int row, col;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      a_position(lane, i, row, col);
      a[row][col] = half_to_float<T>(half_of(in[lane].a[i >> 1], i & 1));
    }
    for (int i = 0; i < 4; ++i) {
      b_position(lane, i, row, col);
      b[row][col] = half_to_float<T>(half_of(in[lane].b[i >> 1], i & 1));
      c_position(lane, i, row, col);
      d[row][col] = in[lane].c[i];
    }
  }
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 16; ++k) {
      const float x = a[r][k];
      for (int n = 0; n < 8; ++n) d[r][n] += x * b[k][n];
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      c_position(lane, i, row, col);
      out[lane].d[i] = d[row][col];
    }
  }
}

template <typename T>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                      const float (&c)[4]) {
  MmaIn in;
  for (int i = 0; i < 4; ++i) in.a[i] = a[i];
  for (int i = 0; i < 2; ++i) in.b[i] = b[i];
  for (int i = 0; i < 4; ++i) in.c[i] = c[i];
  const MmaOut out = warp_collective<MmaIn, MmaOut>(kMma, in, &mma_16816_warp<T>);
  for (int i = 0; i < 4; ++i) d[i] = out.d[i];
}

struct LdmatrixIn {
  const unsigned char* row;
};
struct LdmatrixOut {
  unsigned r[4];
};

// Matrix m's row j is the 16 bytes at lane (8 m + j)'s address; a lane receives, per matrix,
// the elements (g, 2t) and (g, 2t + 1), or with kTrans (2t, g) and (2t + 1, g).
template <int N, bool kTrans>
inline void ldmatrix_warp(const LdmatrixIn* in, LdmatrixOut* out) {
  for (int m = 0; m < N; ++m) {
    unsigned short tile[8][8];
    for (int j = 0; j < 8; ++j) {
      const unsigned char* row = in[8 * m + j].row;
      if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) {
        char msg[160];
        std::snprintf(msg, sizeof msg,
                      "ldmatrix: row address %p (lane %d) is not 16-byte aligned in block "
                      "(%u,%u,%u)",
                      static_cast<const void*>(row), 8 * m + j, blockIdx.x, blockIdx.y,
                      blockIdx.z);
        fail(msg);
      }
      std::memcpy(tile[j], row, 16);
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = group_of(lane);
      const int t = thread_in_group(lane);
      const unsigned short lo = kTrans ? tile[2 * t][g] : tile[g][2 * t];
      const unsigned short hi = kTrans ? tile[2 * t + 1][g] : tile[g][2 * t + 1];
      out[lane].r[m] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
    }
  }
}

template <int N, bool kTrans>
inline void ldmatrix(unsigned (&r)[N], const void* row) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const LdmatrixIn in{static_cast<const unsigned char*>(row)};
  const LdmatrixOut out =
      warp_collective<LdmatrixIn, LdmatrixOut>(kLdmatrix, in, &ldmatrix_warp<N, kTrans>);
  for (int m = 0; m < N; ++m) r[m] = out.r[m];
}

}  // namespace ptx
}  // namespace emu
