// cuda_emu_launch.h (part of cuda_emu.h): kernel launches: one at a time, a grid's
// blocks over worker OS threads (fibers) or one OS thread per CUDA thread (ThreadSanitizer),
// emu::launch and emu::launch_packed.
#pragma once

#include "cuda_emu_team.h"

namespace emu {

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
