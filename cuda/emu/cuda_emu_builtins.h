// cuda_emu_builtins.h (part of cuda_emu.h): the system headers and configuration macros
// of the emulator (KVB_EMU_OS_THREADS under ThreadSanitizer, KVB_EMU_ASAN, the fiber
// switch), the CUDA keywords, vector types and built-in variables, and the bit casts.
#pragma once

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

#if defined(__SANITIZE_THREAD__)
#define KVB_EMU_OS_THREADS 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KVB_EMU_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#ifndef KVB_EMU_OS_THREADS
#include <atomic>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__) && !defined(KVB_EMU_UCONTEXT)
#define KVB_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif
#endif

// ---- CUDA keywords ------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static __shared__ arrays: one instance per OS thread, shared by the block's threads
// (a block's fibers run on one OS thread; blocks running at once are on different ones;
// launches are serialized). The ThreadSanitizer build runs a CUDA thread per OS thread and
// its blocks one after another: one instance.
#ifdef KVB_EMU_OS_THREADS
#define __shared__ static
#else
#define __shared__ static thread_local
#endif

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
struct alignas(16) int4 {
  int x, y, z, w;
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

// Fast approximate division (MUFU.RCP + FMUL on the GPU; within 2 ulp for |b| < 2^126).
inline float __fdividef(float a, float b) { return a / b; }

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
