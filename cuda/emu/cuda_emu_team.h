// cuda_emu_team.h (part of cuda_emu.h): the state the threads of a block share (warps,
// dynamic shared memory, cp.async pipes), the calling thread's index and warp, the
// 16-byte alignment check, and cp.async itself (emulated strictly).
#pragma once

#include "cuda_emu_fibers.h"

namespace emu {

// Bytes of one lane's operands or result in a warp collective.
constexpr size_t kCollectiveBytes = 48;
// Bytes of a result computed once for the whole warp (warp_once).
constexpr size_t kWarpOnceBytes = 32 * 32 * 4;

struct Warp {
  explicit Warp(int lanes) : lanes(lanes), barrier(lanes, "a warp") {}
  int lanes;
  Barrier barrier;
  unsigned long long exchange[32] = {};
  // Warp collectives (warp_collective): two sets of per-lane operand and result slots,
  // used alternately, so one barrier per operation keeps a lane that runs ahead from
  // overwriting slots another lane has not read yet.
  alignas(16) unsigned char coll_in[2][32 * kCollectiveBytes] = {};
  alignas(16) unsigned char coll_out[2][32 * kCollectiveBytes] = {};
  unsigned coll_seq[32] = {};  // per lane: collectives done
  // warp_once: two result buffers, used alternately (as coll_in/coll_out).
  alignas(16) unsigned char once_out[2][kWarpOnceBytes] = {};
  unsigned once_seq[32] = {};
};

// One asynchronous global->shared copy (cp.async) of a CUDA thread, queued until a wait.
struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  size_t bytes;      // destination bytes
  size_t src_bytes;  // bytes read from src; the rest of dst is zero-filled
};

// A thread's cp.async state: the open (uncommitted) copies and the committed groups,
// oldest first. Copies land only in async_wait_prior (cuda_pipeline_primitives.h).
struct AsyncPipe {
  std::vector<AsyncCopy> open;
  std::vector<std::vector<AsyncCopy>> committed;
};

// State shared by the thread team of one launch.
struct Team {
  Team(int threads, size_t smem_bytes)
      : threads(threads),
        smem_bytes(smem_bytes),
        block_barrier(threads, "the block"),
        pipes(static_cast<size_t>(threads)) {
    for (int w = 0; w * 32 < threads; ++w) {
      warps.emplace_back(new Warp(std::min(32, threads - w * 32)));
    }
    if (smem_bytes) {
      // Exact size, so that AddressSanitizer sees any access past the end.
      smem = static_cast<unsigned char*>(::operator new(smem_bytes, std::align_val_t(128)));
    }
  }
  ~Team() {
    if (smem) ::operator delete(smem, std::align_val_t(128));
  }
  int threads;
  size_t smem_bytes;
  unsigned char* smem = nullptr;
  Barrier block_barrier;
  std::vector<AsyncPipe> pipes;  // per thread; a block starts with none in flight
  std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local Team* tl_team = nullptr;

// The calling CUDA thread's index within its block.
inline int linear_tid() {
  return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

inline unsigned char* dynamic_smem() { return tl_team->smem; }

inline void check_aligned16(const void* ptr, const char* file, int line) {
  if (reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0) {
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "misaligned 16-byte access at %p (%s:%d) in block (%u,%u,%u) thread (%u,%u,%u)",
                  ptr, file, line, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y,
                  threadIdx.z);
    fail(msg);
  }
}

inline Warp& my_warp() { return *tl_team->warps[linear_tid() / 32]; }

// cp.async, emulated strictly: the destination is poisoned (0xFF) when the copy is issued
// and the data lands only when a wait retires its group, so a read of the destination
// between issue and wait (a missing wait, or a missing __syncwarp after another lane's
// wait) sees NaN, and a copy issued into a buffer still being read clobbers it at once.
inline void async_copy(void* dst, const void* src, size_t bytes, size_t src_bytes) {
  if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async copies 4, 8 or 16 bytes");
  if (src_bytes > bytes) fail("cp.async reads more bytes than it writes");
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  if (d % bytes != 0 || (src_bytes != 0 && s % bytes != 0)) {
    char msg[192];
    std::snprintf(msg, sizeof msg, "misaligned %zu-byte cp.async (dst %p, src %p) in block (%u,%u,%u)",
                  bytes, dst, src, blockIdx.x, blockIdx.y, blockIdx.z);
    fail(msg);
  }
  std::memset(dst, 0xff, bytes);
  tl_team->pipes[linear_tid()].open.push_back(
      {static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes, src_bytes});
}

inline void async_commit() {
  AsyncPipe& p = tl_team->pipes[linear_tid()];
  p.committed.push_back(std::move(p.open));
  p.open.clear();
}

// Retire every committed group but the newest `prior`: their data lands now.
inline void async_wait_prior(size_t prior) {
  AsyncPipe& p = tl_team->pipes[linear_tid()];
  while (p.committed.size() > prior) {
    for (const AsyncCopy& c : p.committed.front()) {
      if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
    }
    p.committed.erase(p.committed.begin());
  }
}

}  // namespace emu
