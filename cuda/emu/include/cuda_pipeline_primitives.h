#pragma once
// Emulation stand-in for CUDA's <cuda_pipeline_primitives.h> (cp.async through the
// __pipeline_* primitives): see emu::async_copy in cuda_emu_team.h for the semantics (the
// destination is poisoned at issue and filled only when a wait retires the group).
#include <cstddef>

#include "../cuda_emu.h"

// Copy `size_and_align` bytes (4, 8 or 16) from global to shared memory asynchronously;
// the last `zfill` bytes of the destination are zero-filled and not read from `src_global`.
inline void __pipeline_memcpy_async(void* dst_shared, const void* src_global,
                                    size_t size_and_align, size_t zfill = 0) {
  emu::async_copy(dst_shared, src_global, size_and_align, size_and_align - zfill);
}

// Close the thread's current batch of copies into a group.
inline void __pipeline_commit() { emu::async_commit(); }

// Wait until at most `prior` of the thread's committed groups are still in flight.
inline void __pipeline_wait_prior(size_t prior) { emu::async_wait_prior(prior); }
