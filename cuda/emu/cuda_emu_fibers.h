// cuda_emu_fibers.h (part of cuda_emu.h): the fiber build's CUDA threads: the context
// switch (x86-64 assembly, else ucontext), the fiber stacks, the scheduler that runs a
// block's fibers in alternating order and reports deadlocks, and the fibers' Barrier.
// Empty under ThreadSanitizer (KVB_EMU_OS_THREADS), where CUDA threads are OS threads.
#pragma once

#include "cuda_emu_barrier.h"

#ifndef KVB_EMU_OS_THREADS
namespace emu {

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

// Fibers of one block and the order they run in (see cuda_emu.h's file comment).
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

}  // namespace emu
#endif
