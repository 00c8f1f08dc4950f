#pragma once
// Emulation of CUDA's warp matrix functions (nvcuda::wmma) for the CPU emulator.
//
// On a GPU a fragment is spread over the 32 lanes of a warp in an unspecified layout. Here
// every lane holds the whole tile, in logical row-major order, so any code that treats the
// fragment elements uniformly (fill, scale, convert every x[i]) gives the same answer on
// both; code that depends on which element sits where is outside the WMMA contract and
// is not supported. What the emulation does keep from the hardware:
//   * loads read memory when they are called; nothing synchronizes the warp, so a lane
//     that reads a tile another lane wrote without __syncwarp/__syncthreads in between
//     reads stale or poisoned data under the fiber scheduler, as it would on the GPU;
//   * a store writes each element from exactly one lane (element i from lane i % 32), so
//     reading it back needs a barrier and the ThreadSanitizer build sees no benign races;
//   * pointers must be 32-byte aligned and ldm a multiple of 16 bytes (PTX's rules);
//   * products are formed in fp32 from the fp16/bf16 inputs and summed in fp32, once per
//     warp: mma_sync is warp-synchronous (a barrier), the last lane to arrive computes the
//     product of its operands (every lane holds the same) and every lane takes the result.
#include <type_traits>

#include "../cuda_emu.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};

enum layout_t { mem_row_major, mem_col_major };

namespace detail {

template <typename Use, int M, int N, int K>
struct Dims;
template <int M, int N, int K>
struct Dims<matrix_a, M, N, K> {
  static constexpr int kRows = M, kCols = K;
};
template <int M, int N, int K>
struct Dims<matrix_b, M, N, K> {
  static constexpr int kRows = K, kCols = N;
};
template <int M, int N, int K>
struct Dims<accumulator, M, N, K> {
  static constexpr int kRows = M, kCols = N;
};

template <int M, int N, int K>
constexpr bool supported_shape() {
  return (M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) ||
         (M == 8 && N == 32 && K == 16);
}

inline float to_float(float v) { return v; }
inline float to_float(__half v) { return __half2float(v); }
inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float to_float(double v) { return static_cast<float>(v); }
inline float to_float(int v) { return static_cast<float>(v); }

template <typename T>
T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

inline void check_pointer(const void* ptr, unsigned ldm, size_t elem_bytes, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(ptr) % 32 != 0) {
    char msg[192];
    std::snprintf(msg, sizeof msg, "%s: pointer %p is not 32-byte aligned (block (%u,%u,%u))",
                  what, ptr, blockIdx.x, blockIdx.y, blockIdx.z);
    emu::fail(msg);
  }
  if ((ldm * elem_bytes) % 16 != 0) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s: ldm %u is not a multiple of 16 bytes", what, ldm);
    emu::fail(msg);
  }
}

}  // namespace detail

// The whole tile in every lane, row-major over the logical (rows x cols) matrix.
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(detail::supported_shape<M, N, K>(), "emulated WMMA shapes: 16x16x16, 32x8x16, 8x32x16");

 public:
  using element_type = T;
  static constexpr int kRows = detail::Dims<Use, M, N, K>::kRows;
  static constexpr int kCols = detail::Dims<Use, M, N, K>::kCols;
  enum { num_elements = kRows * kCols };
  T x[num_elements];
};

// Any scalar convertible to the element type, as CUDA's overloads accept (0.0f for a half
// accumulator, a __half for a half matrix).
template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  const T v = detail::from_float<T>(detail::to_float(value));
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

// Element (r, c) of a matrix_a/matrix_b tile sits at ptr[r * ldm + c] (row_major) or
// ptr[c * ldm + r] (col_major).
template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* ptr, unsigned ldm) {
  static_assert(!std::is_same<Layout, void>::value, "matrix_a/matrix_b fragments need a layout");
  detail::check_pointer(ptr, ldm, sizeof(T), "load_matrix_sync");
  using F = fragment<Use, M, N, K, T, Layout>;
  constexpr bool kRowMajor = std::is_same<Layout, row_major>::value;
  // Each lane copies the whole tile: a row at a time (row_major), or a stored column at a
  // time (col_major: contiguous reads), so the copies are wide moves.
  if (kRowMajor) {
    for (int r = 0; r < F::kRows; ++r) {
      std::memcpy(&f.x[r * F::kCols], ptr + static_cast<size_t>(r) * ldm, sizeof(T) * F::kCols);
    }
  } else {
    for (int c = 0; c < F::kCols; ++c) {
      const T* col = ptr + static_cast<size_t>(c) * ldm;
      for (int r = 0; r < F::kRows; ++r) f.x[r * F::kCols + c] = col[r];
    }
  }
}

template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* ptr, unsigned ldm,
                             layout_t layout) {
  detail::check_pointer(ptr, ldm, sizeof(T), "load_matrix_sync");
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      f.x[r * N + c] = layout == mem_row_major ? ptr[r * ldm + c] : ptr[c * ldm + r];
    }
  }
}

template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* ptr, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout) {
  detail::check_pointer(ptr, ldm, sizeof(T), "store_matrix_sync");
  const int lane = emu::my_lane();
  for (int i = lane; i < M * N; i += warpSize) {
    const int r = i / N;
    const int c = i % N;
    if (layout == mem_row_major) {
      ptr[r * ldm + c] = f.x[i];
    } else {
      ptr[c * ldm + r] = f.x[i];
    }
  }
}

// d = a * b + c, fp32 products and sums (the order of the sum is not the hardware's).
// Warp-synchronous, as on the GPU: every lane holds the same operands, so the product is
// computed once for the warp (emu::warp_once) and every lane takes the whole result.
template <int M, int N, int K, typename TA, typename LA, typename LB, typename TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC>& d,
                     const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TA, LB>& b,
                     const fragment<accumulator, M, N, K, TC>& c, bool satf = false) {
  (void)satf;
  static_assert(M * N * sizeof(float) <= emu::kWarpOnceBytes, "result too large");
  struct Operands {
    const fragment<matrix_a, M, N, K, TA, LA>* a;
    const fragment<matrix_b, M, N, K, TA, LB>* b;
    const fragment<accumulator, M, N, K, TC>* c;
  } ops{&a, &b, &c};
  const float* out = static_cast<const float*>(emu::warp_once(
      emu::kWmmaMma,
      [](void* ctx, void* dst) {
        const Operands& o = *static_cast<const Operands*>(ctx);
        float* res = static_cast<float*>(dst);
        for (int i = 0; i < M; ++i) {
          for (int j = 0; j < N; ++j) {
            float acc = detail::to_float(o.c->x[i * N + j]);
            for (int k = 0; k < K; ++k) {
              acc += detail::to_float(o.a->x[i * K + k]) * detail::to_float(o.b->x[k * N + j]);
            }
            res[i * N + j] = acc;
          }
        }
      },
      &ops));
  for (int i = 0; i < M * N; ++i) d.x[i] = detail::from_float<TC>(out[i]);
}

}  // namespace wmma
}  // namespace nvcuda
