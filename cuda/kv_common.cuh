// Shared device helpers for the kvblocks kernels: element conversions, 16-byte vector
// access and the launch constants the host planner (python/kvblocks/ops/launch_plan.py)
// mirrors. Compiles under NVRTC and, unchanged, under g++ with cuda/emu/cuda_emu.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifdef KVB_EMULATION
// Emulation: dynamic shared memory comes from the emulator, vector accesses are
// alignment-checked (a misaligned 16-byte access is a fault on the GPU).
#define KVB_DYNAMIC_SMEM(name) unsigned char* name = emu::dynamic_smem()
#define KVB_CHECK_ALIGNED16(ptr) emu::check_aligned16((ptr), __FILE__, __LINE__)
#else
#define KVB_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define KVB_CHECK_ALIGNED16(ptr) ((void)0)
#endif

#define KVB_NEG_INF (-__int_as_float(0x7f800000))

namespace kvb {

// Threads per CTA of every attention kernel (4 warps).
constexpr int kThreads = 128;
// log2(e): scores are kept in base 2 so the softmax uses exp2f.
constexpr float kLog2e = 1.4426950408889634f;

// Attention sinks (gpt-oss): the factor that normalizes a row whose unnormalized output
// and sum `l` are taken against the finite max `m` (log2 units) when the learned logit
// `sink` (natural units, not scaled or capped) joins the denominator with no value:
// out = acc * 2^(m - M) / (l 2^(m - M) + 2^(sink' - M)), M = max(m, sink'). One of the two
// exponentials is 1, so the denominator is never 0. Called once per output row, after
// every tile loop; a row without a visible key (m = -inf) stays zeros and never calls it.
__device__ __forceinline__ float sink_inv(float m, float l, float sink) {
  const float s = sink * kLog2e;
  const float top = fmaxf(m, s);
  const float w = exp2f(m - top);
  return w / (l * w + exp2f(s - top));
}

// A 16-byte vector: the unit of every global and shared K/V access.
struct alignas(16) Vec16 {
  unsigned int w[4];
};

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr bool kIsBf16 = false;
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Elem<__half> {
  static constexpr bool kIsBf16 = false;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ unsigned short bits(__half x) {
#ifdef KVB_EMULATION
    return x.x;
#else
    return __half_as_ushort(x);
#endif
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr bool kIsBf16 = true;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ unsigned short bits(__nv_bfloat16 x) {
#ifdef KVB_EMULATION
    return x.x;
#else
    return __bfloat16_as_ushort(x);
#endif
  }
};

// Elements of T in one 16-byte vector.
template <typename T>
struct VecTraits {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

__device__ __forceinline__ Vec16 load16(const void* ptr) {
  KVB_CHECK_ALIGNED16(ptr);
  return *reinterpret_cast<const Vec16*>(ptr);
}

__device__ __forceinline__ void store16(void* ptr, const Vec16& v) {
  KVB_CHECK_ALIGNED16(ptr);
  *reinterpret_cast<Vec16*>(ptr) = v;
}

// Unpack a vector of T into floats.
template <typename T>
__device__ __forceinline__ void unpack(const Vec16& v, float* out) {
  const T* elems = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < VecTraits<T>::kElems; ++i) out[i] = Elem<T>::to_float(elems[i]);
}

// Pack floats into a vector of T (round to nearest even).
template <typename T>
__device__ __forceinline__ Vec16 pack(const float* in) {
  Vec16 v;
  T* elems = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < VecTraits<T>::kElems; ++i) elems[i] = Elem<T>::from_float(in[i]);
  return v;
}

__device__ __forceinline__ Vec16 zero16() {
  Vec16 v;
  v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
  return v;
}

}  // namespace kvb
