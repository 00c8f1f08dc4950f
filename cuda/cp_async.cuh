// Asynchronous global -> shared copies (cp.async, sm_80+) as inline PTX, and their
// emulation (cuda/emu/include/cuda_pipeline_primitives.h: the destination is poisoned at
// issue and the data lands only when a wait retires its group).
//
// Every statement carries a "memory" clobber, as NVIDIA's own pipeline helpers do: the
// copy writes shared memory behind the compiler's back, and the wait is the point where
// that data becomes visible, so without the clobber the compiler may keep a value of the
// destination in a register across the wait, or move an ordinary shared-memory access of
// the buffer across the copy or the wait.
#pragma once

#include "kv_common.cuh"

#ifdef KVB_EMULATION
#include <cuda_pipeline_primitives.h>
#endif

namespace kvb {

// 16-byte asynchronous global->shared copy; src_bytes 0 zero-fills without reading.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
#ifdef KVB_EMULATION
  __pipeline_memcpy_async(dst, src, 16, static_cast<size_t>(16 - src_bytes));
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
               "r"(src_bytes)
               : "memory");
#endif
}

// Close this thread's copies issued since the last commit into a group.
__device__ __forceinline__ void cp_async_commit() {
#ifdef KVB_EMULATION
  __pipeline_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight (the data of
// the others has landed; other threads' copies need a barrier after their own waits).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef KVB_EMULATION
  __pipeline_wait_prior(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace kvb
