// Warp-level tensor-core operations as raw PTX (sm_80+): ldmatrix and mma.sync m16n8k16,
// with the register ("fragment") layouts the PTX ISA documents, so a kernel may work on
// fragment elements by position (unlike WMMA, whose layout is opaque). Under the emulator
// (KVB_EMULATION) the same helpers are warp collectives that move every lane's data
// exactly as the ISA says (cuda/emu/ptx_emu.h).
//
// Layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type" and
// "ldmatrix"); lane = 4 * g + t (g = groupID = lane / 4, t = lane % 4); a .b32 register
// holds two 16-bit elements, the one with the smaller column (or row) index in its low half:
//   A 16x16 (row):  a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]
//                   a[2] = A[g][2t+8, +9]    a[3] = A[g+8][2t+8, +9]
//   B 16x8  (col):  b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]
//   C/D 16x8 fp32:  c[0], c[1] = C[g][2t, 2t+1]     c[2], c[3] = C[g+8][2t, 2t+1]
//   ldmatrix .x4:   lane l gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte
//                   aligned); r[i] = M_i[g][2t, 2t+1], with .trans r[i] = M_i[2t, 2t+1][g].
// So a row-major tile in shared memory gives A fragments by ldmatrix (matrices: rows 0-7 /
// 8-15 x columns 0-7 / 8-15), K rows give B = K^T fragments by ldmatrix, V rows give B = V
// fragments by ldmatrix.trans, and an fp32 C fragment pair (columns 0-7, 8-15) packed to
// 16-bit is an A fragment (FlashAttention-2 keeps P in registers this way).
//
// ldmatrix carries no "memory" clobber (as CUTLASS's): its reads are ordered after the
// writes they need by the barriers in between (__syncthreads, cp.async waits), which are
// compiler memory barriers, and a clobber would make the compiler reload everything it
// keeps from memory after every fragment load.
#pragma once

#include "kv_common.cuh"

#ifdef KVB_EMULATION
#include "emu/ptx_emu.h"
#endif

namespace kvb {

// Four 8x8 16-bit matrices from shared memory (see the layout above).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef KVB_EMULATION
  emu::ptx::ldmatrix<4, kTrans>(r, row);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#endif
}

// Two 8x8 16-bit matrices (lanes 0-15 give the row addresses).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
#ifdef KVB_EMULATION
  emu::ptx::ldmatrix<2, kTrans>(r, row);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
  }
#endif
}

// d = a * b + c on tensor cores, fp32 accumulators; T (__half or __nv_bfloat16) is the
// element type of a and b.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2], const float (&c)[4]) {
#ifdef KVB_EMULATION
  emu::ptx::mma_16816<T>(d, a, b, c);
#else
  if constexpr (Elem<T>::kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
#endif
}

// Two floats as one .b32 of T (round to nearest even; `lo` in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  const unsigned short l = Elem<T>::bits(Elem<T>::from_float(lo));
  const unsigned short h = Elem<T>::bits(Elem<T>::from_float(hi));
  return static_cast<unsigned>(l) | (static_cast<unsigned>(h) << 16);
}

#ifndef KVB_EMULATION
// One cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 instead of two conversions and a PRMT.
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
#endif

}  // namespace kvb
