// Emulation harness: the kernel sources compiled by g++ against cuda_emu.h, exported
// to Python (ctypes) as one entry point that launches a kernel by its name expression,
// with arguments packed like cuLaunchKernel's. Python plans the launch exactly as for
// CuPy (python/kvblocks/ops/launch_plan.py), so the planner is tested too.
//
// KVB_EMU_SHARD (the opt build, tests/ops/emu_runtime.py): the harness as three translation
// units that g++ compiles in parallel and links into one library. Shards 1 and 2 hold the
// tensor-core decode instantiations (most of the compile time), listed in the header
// KVB_EMU_DECODE_ENTRIES names (tests/ops/emu_decode_shards.py): shard 1 those the tests
// launch, compiled at -O2, shard 2 the rest, at -O0; shard 0 holds every other kernel and
// the entry points (linked first: the inline runtime functions every unit has are shard 0's
// optimized copies), and looks names up in all three. Without KVB_EMU_SHARD one unit holds
// everything (the sanitizer builds).
#include "cuda_emu.h"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#if defined(KVB_EMU_SHARD) && KVB_EMU_SHARD != 0
#define KVB_DECODE_SHARD 1
#else
#include "../cache_ops.cu"
#include "../split_k_attention.cu"
#include "../prefill_attention.cu"
#include "mma_selftest.cuh"
#include "selftest_kernels.cuh"
#include "selftest_pipeline.h"
#include "wmma_selftest.cuh"
#endif
#include "../decode_attention.cu"

// Shared by the shards (one type across the library's units).
namespace kvb_harness {

using Launcher = void (*)(dim3, dim3, size_t, void**);

struct Entry {
  const char* name;
  Launcher launch;
  int smem_bytes;  // the kernel's own shared-memory requirement (0: none / not static)
};

}  // namespace kvb_harness

namespace {

using kvb_harness::Entry;

#define KVB_ENTRY(SMEM, ...)                                                        \
  Entry {                                                                           \
    #__VA_ARGS__, [](dim3 g, dim3 b, size_t s, void** a) {                          \
      emu::launch_packed(__VA_ARGS__, g, b, s, a);                                  \
    },                                                                              \
        SMEM                                                                        \
  }

// A templated kernel's own shared-memory need, from its template arguments.
#define KVB_SMEM_decode_attention_kernel(...) (kvb::DecodeShape<__VA_ARGS__>::kSmemBytes)
#define KVB_SMEM_merge_partials_kernel(...) 0
#define KVB_SMEM_split_k_attention_kernel(...) (kvb::SplitKShape<__VA_ARGS__>::kSmemBytes)
#define KVB_SMEM_merge_splits_kernel(...) 0
#define KVB_SMEM_prefill_attention_kernel(T, D, ...) (kvb::PrefillShape<T, D>::kSmemBytes)
// The entry of NAME<args...> (NAME one of the KVB_SMEM_ families above).
#define KVB_KERNEL(NAME, ...) KVB_ENTRY(KVB_SMEM_##NAME(__VA_ARGS__), NAME<__VA_ARGS__>)

#define KVB_ATTN(T, D)                                                            \
  KVB_KERNEL(split_k_attention_kernel, T, D, 8),                                  \
      KVB_KERNEL(split_k_attention_kernel, T, D, 16), KVB_KERNEL(merge_splits_kernel, T, D)

#define KVB_ATTN_ALL_D(T) \
  KVB_ATTN(T, 64), KVB_ATTN(T, 80), KVB_ATTN(T, 96), KVB_ATTN(T, 112), KVB_ATTN(T, 128), \
      KVB_ATTN(T, 256)

#define KVB_PREFILL(T, D) \
  KVB_KERNEL(prefill_attention_kernel, T, D), KVB_KERNEL(prefill_attention_kernel, T, D, true)

#define KVB_PREFILL_ALL_D(T)                                                               \
  KVB_PREFILL(T, 64), KVB_PREFILL(T, 80), KVB_PREFILL(T, 96), KVB_PREFILL(T, 112),         \
      KVB_PREFILL(T, 128), KVB_PREFILL(T, 256)

// Tensor-core decode (fp16/bf16): every block size and GROUP the planner picks.
#define KVB_DECODE(T, D, B, G) KVB_KERNEL(decode_attention_kernel, T, D, B, G)
#define KVB_DECODE_G(T, D, B) \
  KVB_DECODE(T, D, B, 1), KVB_DECODE(T, D, B, 2), KVB_DECODE(T, D, B, 4), KVB_DECODE(T, D, B, 8)
#define KVB_DECODE_D(T, D)                                                                 \
  KVB_DECODE_G(T, D, 8), KVB_DECODE_G(T, D, 16), KVB_DECODE_G(T, D, 32),                   \
      KVB_DECODE(T, D, 8, 16), KVB_DECODE(T, D, 16, 16), KVB_DECODE(T, D, 32, 16),         \
      KVB_KERNEL(merge_partials_kernel, T, D)
// One K/V buffer per warp (STAGES 1): where two exceed the smallest per-CTA opt-in limit
// (kvblocks.ops.cuda_sources.decode_stages_instantiated: head 256).
#define KVB_DECODE1(T, D, B, G) KVB_KERNEL(decode_attention_kernel, T, D, B, G, 1)
#define KVB_DECODE1_G(T, D, B)                                                     \
  KVB_DECODE1(T, D, B, 1), KVB_DECODE1(T, D, B, 2), KVB_DECODE1(T, D, B, 4), \
      KVB_DECODE1(T, D, B, 8)
#define KVB_DECODE_ALL(T)                                                                   \
  KVB_DECODE_D(T, 64), KVB_DECODE_D(T, 80), KVB_DECODE_D(T, 96), KVB_DECODE_D(T, 112),      \
      KVB_DECODE_D(T, 128), KVB_DECODE_G(T, 256, 8), KVB_DECODE_G(T, 256, 16),              \
      KVB_DECODE_G(T, 256, 32), KVB_DECODE1_G(T, 256, 8), KVB_DECODE1_G(T, 256, 16),        \
      KVB_DECODE1_G(T, 256, 32), KVB_KERNEL(merge_partials_kernel, T, 256)

#if defined(KVB_DECODE_SHARD)
#if KVB_EMU_SHARD == 1
#define KVB_EMU_SHARD_TABLE kvb_emu_decode_hot_table
#else
#define KVB_EMU_SHARD_TABLE kvb_emu_decode_cold_table
#endif
const Entry kEntries[] = {
#include KVB_EMU_DECODE_ENTRIES
};

}  // namespace

// This shard's table, for shard 0's lookup.
extern "C" const Entry* KVB_EMU_SHARD_TABLE(size_t* count) {
  *count = sizeof(kEntries) / sizeof(kEntries[0]);
  return kEntries;
}

#else  // everything else: the unsharded harness or shard 0

#define KVB_NON_DECODE_ENTRIES                                                           \
  KVB_ATTN_ALL_D(float), KVB_ATTN_ALL_D(__half), KVB_ATTN_ALL_D(__nv_bfloat16),          \
      KVB_PREFILL_ALL_D(__half), KVB_PREFILL_ALL_D(__nv_bfloat16),
#ifdef KVB_EMU_ENTRIES
// A sanitizer build (tests/ops/emu_runtime.py): only the attention instantiations its tests
// launch, listed in tests/ops/sanitized_kernels.py and written as KVB_KERNEL(...) lines to
// the header this names. Compiling all of them under ASan or TSan took minutes of CPU for
// a handful of launches. The header goes into kEntries below.
#define KVB_ATTENTION_ENTRIES
#elif defined(KVB_EMU_SHARD)
#define KVB_ATTENTION_ENTRIES KVB_NON_DECODE_ENTRIES
#else
#define KVB_ATTENTION_ENTRIES \
  KVB_DECODE_ALL(__half), KVB_DECODE_ALL(__nv_bfloat16), KVB_NON_DECODE_ENTRIES
#endif

const Entry kEntries[] = {
    KVB_ENTRY(0, reshape_and_cache_kernel),
    KVB_ENTRY(0, copy_blocks_kernel),
    KVB_ENTRY(0, emu_shuffle_kernel),
    KVB_ENTRY(0, emu_block_kernel),
    KVB_ENTRY(0, emu_bug_kernel),
    KVB_ENTRY(0, emu_slow_thread_kernel),
    KVB_ENTRY(0, emu_wmma_kernel<__half, 16, 16, 16, nvcuda::wmma::row_major, nvcuda::wmma::col_major>),
    KVB_ENTRY(0, emu_wmma_kernel<__half, 16, 16, 16, nvcuda::wmma::col_major, nvcuda::wmma::row_major>),
    KVB_ENTRY(0, emu_wmma_kernel<__nv_bfloat16, 16, 16, 16, nvcuda::wmma::row_major, nvcuda::wmma::col_major>),
    KVB_ENTRY(0, emu_wmma_kernel<__half, 32, 8, 16, nvcuda::wmma::row_major, nvcuda::wmma::row_major>),
    KVB_ENTRY(0, emu_wmma_kernel<__nv_bfloat16, 8, 32, 16, nvcuda::wmma::col_major, nvcuda::wmma::col_major>),
    KVB_ENTRY(0, emu_wmma_sync_kernel),
    KVB_ENTRY(0, emu_pipeline_kernel),
    KVB_ENTRY(0, emu_mma_raw_kernel<__half>),
    KVB_ENTRY(0, emu_mma_raw_kernel<__nv_bfloat16>),
    KVB_ENTRY(0, emu_ldmatrix_kernel<4, false>),
    KVB_ENTRY(0, emu_ldmatrix_kernel<4, true>),
    KVB_ENTRY(0, emu_ldmatrix_kernel<2, false>),
    KVB_ENTRY(0, emu_ldmatrix_kernel<2, true>),
    KVB_ENTRY(0, emu_mma_tile_kernel<__half>),
    KVB_ENTRY(0, emu_mma_tile_kernel<__nv_bfloat16>),
    KVB_ATTENTION_ENTRIES
#ifdef KVB_EMU_ENTRIES
#include KVB_EMU_ENTRIES
#endif
};

std::string squeeze(const char* s) {
  std::string out;
  for (; *s; ++s) {
    if (*s != ' ') out.push_back(*s);
  }
  return out;
}

// With KVB_EMU_USED_LOG set, each kernel found is appended (once, squeezed) to that file:
// tests/ops/sanitized_pytest.py checks a sanitizer build's list against what its tests use.
void log_use(const std::string& name) {
  static const char* const path = std::getenv("KVB_EMU_USED_LOG");
  static std::set<std::string> logged;
  if (path == nullptr || !logged.insert(name).second) return;
  if (std::FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s\n", name.c_str());
    std::fclose(f);
  }
}

#ifdef KVB_EMU_SHARD
}  // namespace
extern "C" const Entry* kvb_emu_decode_hot_table(size_t* count);
extern "C" const Entry* kvb_emu_decode_cold_table(size_t* count);
namespace {
#endif

const Entry* find_in(const Entry* entries, size_t count, const std::string& want) {
  for (size_t i = 0; i < count; ++i) {
    if (squeeze(entries[i].name) == want) {
      log_use(want);
      return &entries[i];
    }
  }
  return nullptr;
}

const Entry* find(const char* name) {
  const std::string want = squeeze(name);
  if (const Entry* e = find_in(kEntries, sizeof(kEntries) / sizeof(kEntries[0]), want)) {
    return e;
  }
#ifdef KVB_EMU_SHARD
  for (auto table : {kvb_emu_decode_hot_table, kvb_emu_decode_cold_table}) {
    size_t count = 0;
    const Entry* entries = table(&count);
    if (const Entry* e = find_in(entries, count, want)) return e;
  }
#endif
#ifdef KVB_EMU_ENTRIES
  // Not a -1 the caller may read as "no such kernel" (or a skip): this build left it out.
  std::fprintf(stderr,
               "kvb_emu: the " KVB_EMU_SELECTION " build of the emulation harness does not "
               "instantiate %s; add it to the " KVB_EMU_SELECTION
               " list in tests/ops/sanitized_kernels.py\n",
               name);
  std::abort();
#endif
  return nullptr;
}

}  // namespace

// The API the tests load by name (the opt build hides every other symbol).
#pragma GCC visibility push(default)
extern "C" {

// Launch `name` (a name expression such as "split_k_attention_kernel<__half, 128, 8>").
// Returns 0, -1 if the kernel is unknown, or -2 if smem_bytes is below the kernel's own
// shared-memory need (the GPU would refuse that launch; here it would overrun the buffer).
int kvb_emu_launch(const char* name, const unsigned int* grid, const unsigned int* block,
                   unsigned long long smem_bytes, void** args) {
  const Entry* e = find(name);
  if (e == nullptr) return -1;
  if (smem_bytes < static_cast<unsigned long long>(e->smem_bytes)) return -2;
  e->launch(dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), smem_bytes,
            args);
  return 0;
}

// The kernel's compile-time shared-memory need, to check the host planner's formula.
int kvb_emu_smem_bytes(const char* name) {
  const Entry* e = find(name);
  return e == nullptr ? -1 : e->smem_bytes;
}

// Round trips through the emulated half/bfloat16 conversions (for their own tests).
void kvb_emu_to_half(const float* in, unsigned short* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = __float2half_rn(in[i]).x;
}
void kvb_emu_from_half(const unsigned short* in, float* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}
void kvb_emu_to_bf16(const float* in, unsigned short* out, long long n) {
  for (long long i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(in[i]).x;
}

}  // extern "C"
#pragma GCC visibility pop

#endif  // KVB_DECODE_SHARD
