// cuda_emu_barrier.h (part of cuda_emu.h): failure reports, the kinds of barrier a CUDA
// thread waits at, and the ThreadSanitizer build's Barrier (OS threads and condition
// variables); the fiber build's Barrier, which runs on its scheduler, is in
// cuda_emu_fibers.h.
#pragma once

#include "cuda_emu_builtins.h"

namespace emu {

[[noreturn]] inline void fail(const char* msg) {
  std::fprintf(stderr, "cuda_emu: %s\n", msg);
  std::fflush(stderr);
  std::abort();
}

inline int timeout_ms() {
  const char* env = std::getenv("KVB_EMU_TIMEOUT_MS");
  return env ? std::atoi(env) : 600000;
}

enum BarrierKind {
  kSyncThreads = 1,
  kBlockExit,
  kBlockPoisoned,
  kWarpSync,
  kShflWrite,
  kShflRead,
  kLdmatrix,  // warp collectives (ptx_emu.h): every lane's operands, then every lane's result
  kMma,
  kWmmaMma,  // wmma::mma_sync (include/mma.h): computed once for the warp
};

// A callback the last thread to arrive at a barrier runs before any is released.
struct OnComplete {
  void (*fn)(void*) = nullptr;
  void* ctx = nullptr;
};

inline const char* kind_name(int kind) {
  switch (kind) {
    case kSyncThreads: return "__syncthreads";
    case kBlockExit: return "kernel exit";
    case kBlockPoisoned: return "block start";
    case kWarpSync: return "__syncwarp";
    case kShflWrite: return "warp shuffle (write)";
    case kShflRead: return "warp shuffle (read)";
    case kLdmatrix: return "ldmatrix";
    case kMma: return "mma.sync";
    case kWmmaMma: return "wmma::mma_sync";
    default: return "?";
  }
}

[[noreturn]] inline void fail_divergent(const char* scope, int kind, int arrived, int waiting) {
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "divergent barrier in %s of block (%u,%u,%u): thread (%u,%u,%u) reached %s "
                "while %d other thread(s) wait in %s",
                scope, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z,
                kind_name(kind), arrived, kind_name(waiting));
  fail(msg);
}

#ifdef KVB_EMU_OS_THREADS
// A reusable barrier for a fixed number of OS threads, with a (backstop) deadlock timeout
// and a check that every thread of one phase arrived at the same kind of barrier.
class Barrier {
 public:
  explicit Barrier(int expected, const char* scope) : expected_(expected), scope_(scope) {}

  void wait(int kind, OnComplete done = {}) {
    std::unique_lock<std::mutex> lock(mu_);
    if (arrived_ == 0) {
      kind_ = kind;
    } else if (kind_ != kind) {
      fail_divergent(scope_, kind, arrived_, kind_);
    }
    const unsigned long gen = generation_;
    if (++arrived_ == expected_) {
      if (done.fn) done.fn(done.ctx);
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    // A block-wide barrier waits twice as long as a warp's: when a warp-level barrier
    // deadlocks, the threads of its block that already reached kernel exit (or a
    // __syncthreads) wait too, and the warp's own, more specific report must come first.
    const int ms = kind == kSyncThreads || kind == kBlockExit || kind == kBlockPoisoned
                       ? 2 * timeout_ms()
                       : timeout_ms();
    if (!cv_.wait_for(lock, std::chrono::milliseconds(ms),
                      [&] { return generation_ != gen; })) {
      char msg[256];
      std::snprintf(msg, sizeof msg,
                    "deadlock: %s in %s of block (%u,%u,%u) did not complete within %d ms: "
                    "%d of %d threads arrived",
                    kind_name(kind_), scope_, blockIdx.x, blockIdx.y, blockIdx.z, ms, arrived_,
                    expected_);
      fail(msg);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int expected_;
  const char* scope_;
  int arrived_ = 0;
  int kind_ = 0;
  unsigned long generation_ = 0;
};
#endif

}  // namespace emu
