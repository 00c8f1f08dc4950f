// Cache maintenance kernels. They move bytes, so they are not templated on the element
// type; every access is a 16-byte vector (rows are whole vectors for every supported
// dtype and head size, checked on the host).
#include "kv_common.cuh"

// Scatter K/V rows into their slots: one warp per (token, KV head), lanes stride over
// the row's 16-byte vectors. A slot of -1 (padding) or outside [0, num_slots) is skipped,
// so a bad slot can never write outside the cache.
extern "C" __global__ void __launch_bounds__(kvb::kThreads) reshape_and_cache_kernel(
    const unsigned char* __restrict__ key, const unsigned char* __restrict__ value,
    unsigned char* __restrict__ key_cache, unsigned char* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping, int num_tokens, int num_kv_heads,
    int block_size, int row_bytes, long long num_slots, long long key_token_stride,
    long long key_head_stride, long long value_token_stride, long long value_head_stride) {
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= static_cast<long long>(num_tokens) * num_kv_heads) return;
  const long long token = warp / num_kv_heads;
  const int head = static_cast<int>(warp % num_kv_heads);
  const long long slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const long long block = slot / block_size;
  const long long offset = slot % block_size;
  const long long dst = ((block * num_kv_heads + head) * block_size + offset) * row_bytes;
  const unsigned char* k_src = key + token * key_token_stride + head * key_head_stride;
  const unsigned char* v_src = value + token * value_token_stride + head * value_head_stride;
  for (int b = lane * 16; b < row_bytes; b += 32 * 16) {
    kvb::store16(key_cache + dst + b, kvb::load16(k_src + b));
    kvb::store16(value_cache + dst + b, kvb::load16(v_src + b));
  }
}

// Copy whole blocks for every (src, dst) pair in every cache of one allocation: the
// caches (layer 0 K, layer 0 V, layer 1 K, ...) sit cache_stride bytes apart from
// `base`. Grid: (num_pairs, num_caches); pairs outside [0, num_blocks) are skipped.
extern "C" __global__ void __launch_bounds__(kvb::kThreads) copy_blocks_kernel(
    unsigned char* __restrict__ base, const long long* __restrict__ block_mapping,
    long long cache_stride, long long block_bytes, long long num_blocks) {
  const long long src = block_mapping[2 * blockIdx.x];
  const long long dst = block_mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  unsigned char* cache = base + blockIdx.y * cache_stride;
  const unsigned char* from = cache + src * block_bytes;
  unsigned char* to = cache + dst * block_bytes;
  for (long long b = threadIdx.x * 16LL; b < block_bytes; b += blockDim.x * 16LL) {
    kvb::store16(to + b, kvb::load16(from + b));
  }
}
