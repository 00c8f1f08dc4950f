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
#pragma once

#define KVB_EMULATION 1

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

// ---- half and bfloat16 (bit-exact conversions, round to nearest even) ----------------
struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};

inline float __half2float(__half h) {
  const unsigned int sign = (h.x & 0x8000u) << 16;
  const unsigned int exp = (h.x >> 10) & 0x1fu;
  const unsigned int man = h.x & 0x3ffu;
  unsigned int bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value = man * 2^-24
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  return __uint_as_float(bits);
}

inline __half __float2half_rn(float f) {
  const unsigned int bits = __float_as_uint(f);
  const unsigned short sign = static_cast<unsigned short>((bits >> 16) & 0x8000u);
  const unsigned int abs = bits & 0x7fffffffu;
  __half h;
  if (abs >= 0x7f800000u) {  // inf or nan
    h.x = sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
    return h;
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    h.x = sign | 0x7c00u;
    return h;
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Scale to units of 2^-24 and round to nearest even in float arithmetic.
    const float scaled = std::ldexp(__uint_as_float(abs), 24);
    const float r = std::nearbyint(scaled);  // default rounding mode: to nearest even
    h.x = sign | static_cast<unsigned short>(r);
    return h;
  }
  const unsigned int exp = (abs >> 23) - 112u;
  unsigned int man = abs & 0x7fffffu;
  unsigned int out = (exp << 10) | (man >> 13);
  const unsigned int rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (out & 1u))) ++out;  // carry may bump exponent
  h.x = sign | static_cast<unsigned short>(out);
  return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 b) {
  return __uint_as_float(static_cast<unsigned int>(b.x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int bits = __float_as_uint(f);
  __nv_bfloat16 b;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // nan stays a (quiet) nan
    b.x = static_cast<unsigned short>((bits >> 16) | 0x40u);
    return b;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  b.x = static_cast<unsigned short>(bits >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

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
#else
#ifdef KVB_EMU_ASM_SWITCH
// A fiber's saved context: its stack pointer; the callee-saved registers, MXCSR and the x87
// control word sit on its stack. Switching needs no system call (swapcontext saves and
// restores the signal mask with one, twice per switch, and the emulator switches at every
// warp barrier).
struct Context {
  void* sp = nullptr;
};
extern "C" void kvb_emu_switch_context(void** save_sp, void* load_sp);
extern "C" void kvb_emu_fiber_trampoline();
// x86-64 System V. The switch pushes rbp, rbx, r12-r15 and an 8-byte slot for MXCSR and
// the x87 control word, stores rsp, loads the other stack's and pops the same. A new
// fiber's stack holds that frame with rbx = its entry, returning into the trampoline,
// which calls rbx with an ABI-aligned stack. Weak symbols: the header may be included in
// more than one translation unit.
__asm__(
    ".text\n"
    ".weak kvb_emu_switch_context\n"
    ".type kvb_emu_switch_context, @function\n"
    "kvb_emu_switch_context:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size kvb_emu_switch_context, .-kvb_emu_switch_context\n"
    ".weak kvb_emu_fiber_trampoline\n"
    ".type kvb_emu_fiber_trampoline, @function\n"
    "kvb_emu_fiber_trampoline:\n"
    "  callq *%rbx\n"
    "  ud2\n"
    ".size kvb_emu_fiber_trampoline, .-kvb_emu_fiber_trampoline\n");

// A context that starts `entry` on [stack, stack + bytes) at the first switch to it.
inline void make_context(Context& c, unsigned char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<std::uintptr_t>(stack + bytes) & ~std::uintptr_t{15};
  auto* sp = reinterpret_cast<std::uint64_t*>(top);
  *--sp = reinterpret_cast<std::uint64_t>(&kvb_emu_fiber_trampoline);  // return address
  *--sp = 0;                                                           // rbp
  *--sp = reinterpret_cast<std::uint64_t>(entry);                      // rbx
  for (int r = 0; r < 4; ++r) *--sp = 0;                               // r12 .. r15
  std::uint32_t csr = 0;
  std::uint16_t fpcw = 0;
  __asm__ volatile("stmxcsr %0" : "=m"(csr));
  __asm__ volatile("fnstcw %0" : "=m"(fpcw));
  *--sp = static_cast<std::uint64_t>(csr) | (static_cast<std::uint64_t>(fpcw) << 32);
  c.sp = sp;
}
inline void switch_context(Context& from, Context& to) {
  kvb_emu_switch_context(&from.sp, to.sp);
}
#else
struct Context {
  ucontext_t uc;
};
inline void make_context(Context& c, unsigned char* stack, size_t bytes, void (*entry)()) {
  if (getcontext(&c.uc) != 0) fail("getcontext failed");
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void switch_context(Context& from, Context& to) {
  if (swapcontext(&from.uc, &to.uc) != 0) fail("swapcontext failed");
}
#endif

// Fiber stacks of an OS thread, reused by every block it runs; unmapped at thread exit.
struct StackPool {
  unsigned char* base = nullptr;
  size_t bytes = 0;
  int threads = 0;
  ~StackPool() { release(); }
  void release() {
    if (base == nullptr) return;
#ifdef KVB_EMU_ASAN
    // The fibers' frames left redzones poisoned in the shadow, which munmap does not
    // clear: the next mapping at these addresses (Python's allocator) would trip on them.
    __asan_unpoison_memory_region(base, bytes);
#endif
    munmap(base, bytes);
    base = nullptr;
  }
};
inline thread_local StackPool tl_stacks;

// Fibers of one block and the order they run in (see the file comment).
class Scheduler {
 public:
  // Bytes of stack per fiber; the page below each stack is a guard (PROT_NONE).
  static constexpr size_t kStackBytes = 256 * 1024;

  struct Fiber {
    Context ctx;
    unsigned char* stack = nullptr;
    uint3 idx{0, 0, 0};
    bool runnable = false;
    bool done = false;
    void* fake_stack = nullptr;  // AddressSanitizer's bookkeeping while switched out
  };

  explicit Scheduler(int threads) : fibers_(threads) { reserve_stacks(threads); }

  // Runs `body` on every fiber of the current block; returns once all have finished, or
  // reports the deadlock through `on_deadlock` (which does not return).
  template <typename Deadlock>
  void run_block(void (*entry)(), dim3 block, Deadlock&& on_deadlock) {
    const int n = static_cast<int>(fibers_.size());
    for (int t = 0; t < n; ++t) {
      Fiber& f = fibers_[t];
      f.stack = stacks_ + static_cast<size_t>(t) * (kStackBytes + page()) + page();
#ifdef KVB_EMU_ASAN
      // A fiber never returns from its entry frame: clear what the last block left.
      __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
      make_context(f.ctx, f.stack, kStackBytes, entry);
      f.idx = {static_cast<unsigned>(t % block.x), static_cast<unsigned>((t / block.x) % block.y),
               static_cast<unsigned>(t / (static_cast<long>(block.x) * block.y))};
      f.runnable = true;
      f.done = false;
    }
    current_ = -1;
    dir_ = 1;
    switch_to(0);
    for (const Fiber& f : fibers_) {
      if (!f.done) on_deadlock();
    }
  }

  int current() const { return current_; }
  void wake(int fiber) { fibers_[fiber].runnable = true; }

  // The current fiber waits (or has finished): run another one, or go back to the
  // launching context when none can run.
  void block_current(bool finished) {
    Fiber& me = fibers_[current_];
    me.runnable = false;
    me.done = finished;
    const int next = pick();
    switch_to(next);
  }

  // Called first thing on a fiber's own stack.
  void fiber_started() { finish_switch(nullptr); }

 private:
  static size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

  void reserve_stacks(int threads) {
    // One mapping per OS thread, reused by every block and launch it runs.
    StackPool& pool = tl_stacks;
    if (threads > pool.threads) {
      const size_t stride = kStackBytes + page();
      pool.release();
      void* mem = mmap(nullptr, stride * threads, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (mem == MAP_FAILED) fail("cannot map fiber stacks");
      pool.base = static_cast<unsigned char*>(mem);
      pool.bytes = stride * threads;
      pool.threads = threads;
      for (int t = 0; t < threads; ++t) mprotect(pool.base + t * stride, page(), PROT_NONE);
    }
    stacks_ = pool.base;
  }

  // Next runnable fiber, sweeping up then down the thread indices; -1 if none.
  int pick() {
    const int n = static_cast<int>(fibers_.size());
    for (int i = current_ + dir_; i >= 0 && i < n; i += dir_) {
      if (fibers_[i].runnable) return i;
    }
    dir_ = -dir_;
    for (int i = dir_ > 0 ? 0 : n - 1; i >= 0 && i < n; i += dir_) {
      if (fibers_[i].runnable) return i;
    }
    return -1;
  }

  // From the current context (a fiber, or the launcher when current_ < 0) to fiber
  // `next` (the launcher when next < 0).
  void switch_to(int next) {
    const int from = current_;
    Context& from_ctx = from < 0 ? main_ : fibers_[from].ctx;
    Context& to_ctx = next < 0 ? main_ : fibers_[next].ctx;
    current_ = next;
    if (next >= 0) {
      threadIdx = fibers_[next].idx;  // the per-thread registers of the fiber to run
    }
#ifdef KVB_EMU_ASAN
    void** fake = from < 0 ? &main_fake_ : &fibers_[from].fake_stack;
    const bool dying = from >= 0 && fibers_[from].done;
    if (next < 0) {
      __sanitizer_start_switch_fiber(dying ? nullptr : fake, main_bottom_, main_size_);
    } else {
      __sanitizer_start_switch_fiber(dying ? nullptr : fake, fibers_[next].stack, kStackBytes);
    }
#endif
    switch_context(from_ctx, to_ctx);
    finish_switch(from < 0 ? main_fake_ : fibers_[from].fake_stack);
  }

  void finish_switch([[maybe_unused]] void* fake) {
#ifdef KVB_EMU_ASAN
    const void* bottom = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(fake, &bottom, &size);
    if (current_ >= 0 && main_bottom_ == nullptr) {
      main_bottom_ = bottom;  // the first switch into a fiber comes from the launcher
      main_size_ = size;
    }
#endif
  }

  std::vector<Fiber> fibers_;
  unsigned char* stacks_ = nullptr;
  Context main_;
  int current_ = -1;
  int dir_ = 1;
  void* main_fake_ = nullptr;
  const void* main_bottom_ = nullptr;
  size_t main_size_ = 0;
};

inline thread_local Scheduler* tl_sched = nullptr;

// A reusable barrier for a fixed number of fibers: the last arrival wakes the others.
// Checks that every thread of one phase arrived at the same kind of barrier.
class Barrier {
 public:
  explicit Barrier(int expected, const char* scope) : expected_(expected), scope_(scope) {
    waiters_.reserve(expected);
  }

  // `finished`: the caller's kernel has returned; it is not resumed once released.
  void wait(int kind, bool finished = false, OnComplete done = {}) {
    if (arrived_ == 0) {
      kind_ = kind;
    } else if (kind_ != kind) {
      fail_divergent(scope_, kind, arrived_, kind_);
    }
    if (++arrived_ == expected_) {
      if (done.fn) done.fn(done.ctx);
      arrived_ = 0;
      for (int f : waiters_) tl_sched->wake(f);
      waiters_.clear();
      if (finished) tl_sched->block_current(true);
      return;
    }
    if (!finished) waiters_.push_back(tl_sched->current());
    tl_sched->block_current(finished);
  }

  // Aborts with this barrier's state if threads wait in it.
  void report_if_waiting() const {
    if (arrived_ == 0) return;
    char msg[256];
    std::snprintf(msg, sizeof msg,
                  "deadlock: %s in %s of block (%u,%u,%u) can never complete: %d of %d threads "
                  "arrived and no other thread can run",
                  kind_name(kind_), scope_, blockIdx.x, blockIdx.y, blockIdx.z, arrived_,
                  expected_);
    fail(msg);
  }

 private:
  int expected_;
  const char* scope_;
  int arrived_ = 0;
  int kind_ = 0;
  std::vector<int> waiters_;
};
#endif

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
inline int my_lane() { return linear_tid() % 32; }

inline void check_mask(unsigned mask, const char* what) {
  const Warp& w = my_warp();
  const unsigned full = w.lanes == 32 ? 0xffffffffu : ((1u << w.lanes) - 1u);
  if ((mask & full) != full) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s with partial mask 0x%08x is not emulated (warp has %d lanes)",
                  what, mask, w.lanes);
    fail(msg);
  }
}

// Every lane publishes `var`, then reads lane `src` (its own value when src < 0).
template <typename T>
T exchange(T var, int src) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  Warp& w = my_warp();
  const int lane = my_lane();
  std::memcpy(&w.exchange[lane], &var, sizeof(T));
  w.barrier.wait(kShflWrite);
  T out = var;
  if (src >= 0 && src < w.lanes) std::memcpy(&out, &w.exchange[src], sizeof(T));
  w.barrier.wait(kShflRead);  // nobody overwrites the buffer before all have read
  return out;
}

// A warp-synchronous operation (ldmatrix, mma.sync): every lane passes `in`; once all 32
// have arrived, the last arrival runs fn(ins, outs) for the whole warp (lane l's operands
// at ins[l], its result to outs[l]) before any lane continues, so the operation sees
// memory and operands as of one instant, as the hardware's single instruction does; each
// lane then gets outs[its lane]. A lane that skips the call while others make it is a
// deadlock (or, at another barrier, a divergence) report.
template <typename In, typename Out>
Out warp_collective(int kind, const In& in, void (*fn)(const In* ins, Out* outs)) {
  static_assert(sizeof(In) <= kCollectiveBytes && sizeof(Out) <= kCollectiveBytes,
                "collective operands too large");
  Warp& w = my_warp();
  if (w.lanes != 32) fail("warp collectives need a full warp of 32 lanes");
  const int lane = my_lane();
  const unsigned slot = w.coll_seq[lane]++ & 1u;
  In* ins = reinterpret_cast<In*>(w.coll_in[slot]);
  Out* outs = reinterpret_cast<Out*>(w.coll_out[slot]);
  ins[lane] = in;
  struct Ctx {
    Warp* w;
    In* ins;
    Out* outs;
    void (*fn)(const In*, Out*);
  } ctx{&w, ins, outs, fn};
  OnComplete done{[](void* p) {
                    Ctx* c = static_cast<Ctx*>(p);
                    for (int l = 1; l < 32; ++l) {
                      if (c->w->coll_seq[l] != c->w->coll_seq[0]) {
                        fail("the lanes of a warp met at different warp collectives (a "
                             "divergent mma.sync/ldmatrix)");
                      }
                    }
                    c->fn(c->ins, c->outs);
                  },
                  &ctx};
#ifdef KVB_EMU_OS_THREADS
  w.barrier.wait(kind, done);
#else
  w.barrier.wait(kind, false, done);
#endif
  return outs[lane];
}

// A warp-synchronous operation whose operands every lane holds identically (an emulated
// WMMA fragment is the whole tile in every lane): once all 32 lanes have arrived, the last
// one runs fn(ctx, out) with its own ctx, once for the warp; every lane then reads the
// result at the returned pointer, valid until its next warp_once. (Computed 32 times, one
// per lane, a 32 x 8 x 16 product was most of the emulator's time in decode.)
inline const void* warp_once(int kind, void (*fn)(void* ctx, void* out), void* ctx) {
  Warp& w = my_warp();
  if (w.lanes != 32) fail("warp collectives need a full warp of 32 lanes");
  const int lane = my_lane();
  const unsigned slot = w.once_seq[lane]++ & 1u;
  struct Ctx {
    Warp* w;
    unsigned char* out;
    void (*fn)(void*, void*);
    void* ctx;
  } c{&w, w.once_out[slot], fn, ctx};
  OnComplete done{[](void* p) {
                    Ctx* x = static_cast<Ctx*>(p);
                    for (int l = 1; l < 32; ++l) {
                      if (x->w->once_seq[l] != x->w->once_seq[0]) {
                        fail("the lanes of a warp met at different warp-synchronous calls");
                      }
                    }
                    x->fn(x->ctx, x->out);
                  },
                  &c};
#ifdef KVB_EMU_OS_THREADS
  w.barrier.wait(kind, done);
#else
  w.barrier.wait(kind, false, done);
#endif
  return w.once_out[slot];
}

// Launches run one after another, as kernels on one CUDA stream do, in both back-ends.
inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// Threads per block of a launch; a block of 0 or more than 1024 threads is an error.
inline long threads_per_block(dim3 block) {
  const long threads = static_cast<long>(block.x) * block.y * block.z;
  if (threads < 1 || threads > 1024) fail("block must have 1..1024 threads");
  return threads;
}

#ifdef KVB_EMU_OS_THREADS
// Run `body` for every thread of every block of `grid`: one OS thread per CUDA thread.
inline void run_grid(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  std::lock_guard<std::mutex> guard(launch_mutex());
  const long threads = threads_per_block(block);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  Team team(static_cast<int>(threads), smem_bytes);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (long t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      tl_team = &team;
      threadIdx = {static_cast<unsigned>(t % block.x),
                   static_cast<unsigned>((t / block.x) % block.y),
                   static_cast<unsigned>(t / (static_cast<long>(block.x) * block.y))};
      blockDim = block;
      gridDim = grid;
      for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            team.pipes[t] = AsyncPipe{};  // copies left in flight by the last block die with it
            if (t == 0 && team.smem) std::memset(team.smem, 0xff, team.smem_bytes);
            team.block_barrier.wait(kBlockPoisoned);
            body();
            team.block_barrier.wait(kBlockExit);
          }
        }
      }
    });
  }
  for (auto& th : pool) th.join();
}
#else
inline thread_local const std::function<void()>* tl_body = nullptr;

// Entry of every fiber: the kernel, then kernel exit (a block-wide barrier).
inline void fiber_entry() {
  tl_sched->fiber_started();
  (*tl_body)();
  tl_team->block_barrier.wait(kBlockExit, /*finished=*/true);
  fail("a finished fiber was resumed");  // unreachable
}

// OS threads that run the blocks of a launch: $KVB_EMU_THREADS, else one per core, at most
// one per block.
inline long worker_count(long blocks) {
  const char* env = std::getenv("KVB_EMU_THREADS");
  long n = env ? std::atol(env) : static_cast<long>(std::thread::hardware_concurrency());
  return std::max(1L, std::min(n, blocks));
}

// Run `body` for every thread of every block of `grid`. A block's threads are fibers on one
// OS thread (its own team: shared memory, warps, cp.async state, fiber stacks); the blocks
// are spread over worker_count() OS threads, each taking the next block (x fastest, then y,
// z) as it finishes one, so CTAs run on every core as on the GPU's SMs. Blocks of one
// launch must not depend on each other's order (they do not on a GPU either); atomics are
// real atomics.
inline void run_grid(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  std::lock_guard<std::mutex> guard(launch_mutex());
  const long threads = threads_per_block(block);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  const long blocks = static_cast<long>(grid.x) * grid.y * grid.z;
  std::atomic<long> next{0};
  auto worker = [&] {
    Team team(static_cast<int>(threads), smem_bytes);
    Scheduler sched(static_cast<int>(threads));
    tl_team = &team;
    tl_sched = &sched;
    tl_body = &body;
    blockDim = block;
    gridDim = grid;
    auto deadlock = [&] {
      for (const auto& w : team.warps) w->barrier.report_if_waiting();
      team.block_barrier.report_if_waiting();
      fail("deadlock: threads neither finished nor wait at a barrier");
    };
    for (long b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
      blockIdx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                  static_cast<unsigned>(b / (static_cast<long>(grid.x) * grid.y))};
      for (AsyncPipe& p : team.pipes) p = AsyncPipe{};  // nothing in flight across blocks
      if (team.smem) std::memset(team.smem, 0xff, team.smem_bytes);
      sched.run_block(fiber_entry, block, deadlock);
    }
    tl_team = nullptr;
    tl_sched = nullptr;
    tl_body = nullptr;
  };
  const long workers = worker_count(blocks);
  if (workers == 1) {
    worker();
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (long i = 0; i < workers; ++i) pool.emplace_back(worker);
  for (auto& th : pool) th.join();
}
#endif

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
            Args... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  std::tuple<Params...> values(static_cast<Params>(args)...);
  run_grid(grid, block, smem_bytes, [&] { std::apply(kernel, values); });
}

template <typename... Params, std::size_t... I>
void launch_packed_impl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                        void** args, std::index_sequence<I...>) {
  launch(kernel, grid, block, smem, *static_cast<Params*>(args[I])...);
}

// Launch from an array of pointers to the arguments, as cuLaunchKernel takes them.
template <typename... Params>
void launch_packed(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, void** args) {
  launch_packed_impl(kernel, grid, block, smem, args, std::index_sequence_for<Params...>{});
}

}  // namespace emu

// ---- device intrinsics ----------------------------------------------------------------
inline void __syncthreads() { emu::tl_team->block_barrier.wait(emu::kSyncThreads); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check_mask(mask, "__syncwarp");
  emu::my_warp().barrier.wait(emu::kWarpSync);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  emu::check_mask(mask, "__shfl_sync");
  const int lane = emu::my_lane();
  return emu::exchange(var, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  emu::check_mask(mask, "__shfl_xor_sync");
  const int lane = emu::my_lane();
  const int src = lane ^ lane_mask;
  // Reading from a later segment of `width` lanes returns the caller's own value.
  return emu::exchange(var, (src & ~(width - 1)) > (lane & ~(width - 1)) ? -1 : src);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  emu::check_mask(mask, "__shfl_down_sync");
  const int lane = emu::my_lane();
  const int src = lane + static_cast<int>(delta);
  return emu::exchange(var, (src & ~(width - 1)) != (lane & ~(width - 1)) ? -1 : src);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  emu::check_mask(mask, "__shfl_up_sync");
  const int lane = emu::my_lane();
  const int src = lane - static_cast<int>(delta);
  return emu::exchange(var, (src < (lane & ~(width - 1))) ? -1 : src);
}

inline int atomicAdd(int* addr, int v) { return __atomic_fetch_add(addr, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* addr, unsigned v) {
  return __atomic_fetch_add(addr, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* addr, unsigned long long v) {
  return __atomic_fetch_add(addr, v, __ATOMIC_SEQ_CST);
}
inline int atomicCAS(int* addr, int expected, int desired) {
  __atomic_compare_exchange_n(addr, &expected, desired, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return expected;
}
inline unsigned atomicCAS(unsigned* addr, unsigned expected, unsigned desired) {
  __atomic_compare_exchange_n(addr, &expected, desired, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return expected;
}
inline float atomicAdd(float* addr, float v) {
  unsigned* bits = reinterpret_cast<unsigned*>(addr);
  unsigned old = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  while (true) {
    const unsigned desired = __float_as_uint(__uint_as_float(old) + v);
    if (__atomic_compare_exchange_n(bits, &old, desired, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST)) {
      return __uint_as_float(old);
    }
  }
}
inline int atomicMax(int* addr, int v) {
  int old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(addr, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicMin(int* addr, int v) {
  int old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
  while (old > v && !__atomic_compare_exchange_n(addr, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicExch(int* addr, int v) { return __atomic_exchange_n(addr, v, __ATOMIC_SEQ_CST); }
