// cuda_emu.h: run CUDA kernel source on CPU, for testing without a GPU.
//
// Each CUDA thread of a block is a fiber (its own stack; a register-saving switch in
// assembly on x86-64, ucontext elsewhere) on one OS thread; the blocks of a grid run on
// several OS threads at once (KVB_EMU_THREADS, default one per core), a block at a time
// each. A fiber runs until it waits at a
// barrier (__syncthreads, a warp shuffle, __syncwarp, kernel exit) or finishes; the last
// arrival releases the others. Fibers are resumed alternately in ascending and descending
// order, so a read that misses a barrier sees stale or poisoned data either way round.
// There is no wall-clock timeout: when no fiber can run while some have not finished, the
// kernel has deadlocked, and that is reported at once (the warp barrier first, it is the
// more specific), however loaded the machine. A barrier reached by threads at different
// call kinds (e.g. some threads exited while others wait in __syncthreads) aborts
// immediately. Shared memory is poisoned with 0xFF (NaN as floats) before every block, so
// reading it before writing shows up as NaN. 16-byte vector accesses are alignment-checked
// through KVB_CHECK_ALIGNED16.
//
// Under ThreadSanitizer (which must see real threads to report data races) every CUDA
// thread is an OS thread instead and barriers are condition variables; there a barrier
// that does not complete within KVB_EMU_TIMEOUT_MS (default 600000) aborts. That timeout
// is only a backstop against a hang: deadlocks are found exactly by the fiber build.
//
// Kernels are launched with emu::launch(kernel, grid, block, smem_bytes, args...) or,
// from a type-erased argument array like cuLaunchKernel, emu::launch_packed.
//
// The parts, in the order they build on each other: cuda_emu_builtins.h (system headers,
// configuration, CUDA keywords, types and built-in variables), cuda_emu_half.h (half and
// bfloat16), cuda_emu_barrier.h (failure reports, barrier kinds, the ThreadSanitizer
// build's barrier), cuda_emu_fibers.h (fibers, their scheduler and barrier),
// cuda_emu_team.h (a block's shared state, cp.async), cuda_emu_warp.h (shuffles, warp
// collectives), cuda_emu_launch.h (launches), cuda_emu_intrinsics.h (__syncthreads,
// shuffles, atomics). Kernels include this file, never a part.
#pragma once

#define KVB_EMULATION 1

#include "cuda_emu_builtins.h"
#include "cuda_emu_half.h"
#include "cuda_emu_barrier.h"
#include "cuda_emu_fibers.h"
#include "cuda_emu_team.h"
#include "cuda_emu_warp.h"
#include "cuda_emu_launch.h"
#include "cuda_emu_intrinsics.h"
