// Decode attention on tensor cores: one query token per sequence, a GQA group of query
// heads per CTA, K/V streamed through shared memory with cp.async (sm_80+).
//
// ABI (the planner, python/kvblocks/ops/decode_attention.py, builds the items):
//
//   decode_attention_kernel<T, D, BLOCK, GROUP, STAGES = 2>(
//       T* out,                  // [num_seqs, num_heads, D]  items with partial_slot < 0, normalized
//       float* part_out,         // [num_slots, num_heads, D] unnormalized partials (slot >= 0)
//       float* part_ml,          // [num_slots, num_heads, 2] (running max in log2 units, sum)
//       const T* query,          // [num_seqs, num_heads, D]
//       const T* key_cache,      // [num_blocks, num_kv_heads, BLOCK, D]
//       const T* value_cache,    // same
//       const int* block_tables, // [num_seqs, max_blocks]
//       const int4* items,       // [max_items]: (seq, kv_begin, kv_end, partial_slot)
//       const int* num_items,    // device scalar: CTAs with blockIdx.x >= *num_items return
//       int num_seqs, int num_heads, int num_kv_heads, int max_blocks, int num_blocks,
//       float scale, float soft_cap,
//       const float* sinks)      // [num_heads] attention-sink logits (natural units), or null
//   grid  = (max_items, num_kv_heads * ceil(group / GROUP)), block = kvb::kDecodeThreads (128),
//   dynamic shared memory = kvb::DecodeShape<T, D, BLOCK, GROUP, STAGES>::kSmemBytes (above
//   48 KiB for head 128 and up: the launcher opts in with
//   cudaFuncAttributeMaxDynamicSharedMemorySize; python mirror:
//   kvblocks.ops.cuda_sources.decode_smem_bytes). STAGES 1 (one K/V buffer per warp) is the
//   variant the host picks when STAGES 2 exceeds the device's per-CTA opt-in limit
//   (sharedMemPerBlockOptin: head 256 on sm_86/sm_89).
//
//   merge_partials_kernel<T, D>(T* out, const float* part_out, const float* part_ml,
//       const int* merge_indptr,   // [num_seqs + 1]: seq s merges slots [indptr[s], indptr[s+1])
//       int num_seqs, int num_heads,
//       const float* sinks)        // as above, or null
//   grid = (num_seqs, num_heads), block = kvb::kDecodeThreads, no shared memory.
//
// T is __half or __nv_bfloat16 (fp32 caches keep split_k_attention_kernel); D a multiple of 16
// (64..256); BLOCK 8, 16 or 32; GROUP 1..16 (GROUP > 8 doubles the accumulators: not
// instantiated at head 256). Keys kv_begin <= j < kv_end of an item are attended to (the
// planner applies the window and the causal end). The kernel clamps every item field (seq to
// [0, num_seqs), the key range to [0, max_blocks * BLOCK)) and replaces block ids outside
// [0, num_blocks) by block 0, so a bad plan gives wrong numbers but never an out-of-bounds
// access; partial slots and merge_indptr are trusted (the planner sizes the workspace). An
// empty item writes zeros (out) or (max = -inf, sum = 0) and zero partials.
//
// Attention sinks (gpt-oss): sinks[h] joins head h's softmax denominator once, with no value
// (kvblocks.ops.reference). Partials never include it; it is added where a row is normalized:
// by the attention kernel for an item that writes out itself (slot < 0), by merge_partials_kernel
// for a split one. A runtime branch after the tile loop (null: none): no added instantiation.
//
// Design. The four warps of a CTA split the item's keys: warp w takes the 32-key tiles
// w, w + 4, w + 8, ... of the item (tiles aligned to 32 keys, so a tile covers whole cache
// blocks), each with its own online softmax; the four states are merged once at the end.
// Per tile a warp runs, with only warp-scoped barriers between the steps (no CTA barrier):
//   1. S^T[32 keys x 8 heads] = K[32 x D] . Q^T[D x 8]: wmma m32n8k16, the key tile as
//      matrix_a straight from its shared-memory rows, the GQA group as N (padded to 8, or
//      16 in two column tiles); Q^T is read from shared memory (staged once per CTA).
//   2. S^T to shared memory; lane (h, q) = (lane / 4, lane % 4) owns keys 8q..8q+7 of head h:
//      scale, soft cap, mask, row max and sum over its 4 lanes with two xor-shuffles; P as T
//      back to shared memory, and the rescale factor alpha[h] as a 32 x 8 fp32 matrix written
//      over the scores (each lane overwrites only the 8 it read).
//   3. O^T[D x 8] = alpha * O^T + V^T[D x 32] . P^T[32 x 8]: wmma m32n8k16, V^T as a
//      col_major matrix_a over the value rows. The per-head rescale of the accumulator is
//      layout independent: alpha is loaded as an accumulator fragment of the same shape
//      and multiplied element by element.
// Loads: cp.async 16-byte copies of a warp's key tile and value tile into its own
// buffers (zero-filled outside the item), two groups in flight: the next key tile is
// issued as soon as S is computed, the next value tile as soon as P.V is done, and each
// step waits (cp.async.wait_group 1) only for the tile it needs. With STAGES 1 the value
// tile goes into the key buffer once S is computed (it loads during the softmax) and the
// next key tile once P.V is done; each step waits for the one group in flight. The
// block-table slice of kTableSlots blocks is staged in shared memory once per chunk of the
// item (one CTA barrier pair per 2048-8192 keys). BLOCK and GROUP are template parameters,
// so no division happens per load.
#include "cp_async.cuh"
#include "kv_common.cuh"

#include <mma.h>

namespace kvb {

// Threads per CTA of decode_attention_kernel and merge_partials_kernel (4 warps).
constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

template <int N>
struct Log2 {
  static constexpr int value = 1 + Log2<N / 2>::value;
};
template <>
struct Log2<1> {
  static constexpr int value = 0;
};

template <typename T, int D, int BLOCK, int GROUP, int STAGES = 2>
struct DecodeShape {
  static_assert(sizeof(T) == 2, "tensor-core decode takes fp16 or bf16");
  static_assert(D % 16 == 0 && D >= 32 && D <= 256, "head size: a multiple of 16 up to 256");
  static_assert(BLOCK == 8 || BLOCK == 16 || BLOCK == 32, "block size 8, 16 or 32");
  static_assert(GROUP >= 1 && GROUP <= 16, "GROUP: 1..16 query heads per CTA");
  static_assert(STAGES == 1 || STAGES == 2, "STAGES: 1 or 2 K/V buffers per warp");
  // K/V tile buffers per warp: 2 keeps a key tile and a value tile in flight (the next
  // keys load during softmax and P.V); 1 shares one buffer (keys, then the same tile's
  // values, loaded while the softmax runs), halving the largest part of shared memory for
  // GPUs whose per-CTA limit is below the 2-buffer need (head 256: 144 KiB against 99 KiB
  // on sm_86/sm_89).
  static constexpr int kKvBufs = STAGES;
  static constexpr int kWarpTokens = 32;  // M of wmma m32n8k16
  static constexpr int kCtaTokens = kWarpTokens * kDecodeWarps;
  static constexpr int kHeadTiles = (GROUP + 7) / 8;
  static constexpr int kHeads = 8 * kHeadTiles;  // N, padded
  static constexpr int kDPad = (D + 31) / 32 * 32;  // P.V covers D in 32-row tiles
  static constexpr int kMTiles = kDPad / 32;
  static constexpr int kKSteps = D / 16;
  // Shared rows are padded by 16 bytes so that the 8 rows an ldmatrix-style access reads
  // fall in different banks; ldm stays a multiple of 16 bytes and every fragment pointer
  // 32-byte aligned.
  static constexpr int kLd = kDPad + 8;                // K/V/Q rows (elements)
  static constexpr int kSLd = kWarpTokens + 4;         // scores per head (floats)
  static constexpr int kPLd = kWarpTokens + 8;         // probabilities per head (elements)
  static constexpr int kOLd = kDPad + 4;               // final O rows per head (floats)
  static constexpr int kPieces = D / 8;                // 16-byte pieces of a K/V row
  static constexpr int kCopies = kWarpTokens * kPieces / 32;  // per lane per tile
  static constexpr int kTableSlots = 256;
  static constexpr int kLogBlock = Log2<BLOCK>::value;
  static constexpr int kChunkTokens = kTableSlots * BLOCK;
  static_assert(kChunkTokens % kCtaTokens == 0, "chunks hold whole CTA tiles");
  // Per-warp region (bytes): key tile, value tile (STAGES 2), scores (then the rescale
  // matrix), probabilities.
  static constexpr int kKvBytes = kWarpTokens * kLd * 2;
  static constexpr int kSBytes = kHeads * kSLd * 4;
  static constexpr int kPBytes = kHeads * kPLd * 2;
  static constexpr int kWarpBytes = kKvBufs * kKvBytes + kSBytes + kPBytes;
  static_assert(kHeads * kOLd * 4 <= kKvBufs * kKvBytes, "final O fits in the K/V buffers");
  // CTA region: per-warp regions, Q (T), table slice, per-warp (max, sum) per head.
  static constexpr int kQOffset = kDecodeWarps * kWarpBytes;
  static constexpr int kTableOffset = kQOffset + kHeads * kLd * 2;
  static constexpr int kMlOffset = kTableOffset + kTableSlots * 4;
  static constexpr int kSmemBytes = kMlOffset + kDecodeWarps * kHeads * 2 * 4;
  static_assert(kKvBytes % 32 == 0 && kSBytes % 32 == 0 && kPBytes % 32 == 0 &&
                    kQOffset % 32 == 0,
                "fragment pointers are 32-byte aligned");
};

namespace wmma = nvcuda::wmma;

// WMMA fragment loads from shared memory. NVVM gives the fp16 loads the .shared state space
// (ldmatrix) but leaves the bf16 ones generic (an LD per element pair plus MOVM transposes,
// about 30% more instructions per tile); the bf16 overloads state .shared in PTX. The
// emulator has the plain API.
template <typename Frag, typename T>
__device__ __forceinline__ void load_shared(Frag& f, const T* p, unsigned ldm) {
  wmma::load_matrix_sync(f, p, ldm);
}

#ifndef KVB_EMULATION
__device__ __forceinline__ void load_shared(
    wmma::fragment<wmma::matrix_a, 32, 8, 16, __nv_bfloat16, wmma::row_major>& f,
    const __nv_bfloat16* p, unsigned ldm) {
  unsigned* r = reinterpret_cast<unsigned*>(&f.x[0]);
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile(
      "wmma.load.a.sync.aligned.row.m32n8k16.shared.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, [%8], %9;\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]),
        "=r"(r[7])
      : "r"(addr), "r"(ldm)
      : "memory");
}
__device__ __forceinline__ void load_shared(
    wmma::fragment<wmma::matrix_a, 32, 8, 16, __nv_bfloat16, wmma::col_major>& f,
    const __nv_bfloat16* p, unsigned ldm) {
  unsigned* r = reinterpret_cast<unsigned*>(&f.x[0]);
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile(
      "wmma.load.a.sync.aligned.col.m32n8k16.shared.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, [%8], %9;\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]),
        "=r"(r[7])
      : "r"(addr), "r"(ldm)
      : "memory");
}
__device__ __forceinline__ void load_shared(
    wmma::fragment<wmma::matrix_b, 32, 8, 16, __nv_bfloat16, wmma::col_major>& f,
    const __nv_bfloat16* p, unsigned ldm) {
  unsigned* r = reinterpret_cast<unsigned*>(&f.x[0]);
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("wmma.load.b.sync.aligned.col.m32n8k16.shared.bf16 {%0, %1}, [%2], %3;\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr), "r"(ldm)
               : "memory");
}
#endif

// Barrier and memory fence among the 32 threads of warp `warp`: a named barrier (ids 1..4;
// 0 is __syncthreads) rather than __syncwarp, which compiles to a divergence check and a
// slow path calling an ABI function inside the tile loop.
__device__ __forceinline__ void warp_barrier(int warp) {
#ifdef KVB_EMULATION
  (void)warp;
  __syncwarp();
#else
  asm volatile("bar.sync %0, 32;\n" ::"r"(warp + 1) : "memory");
#endif
}

}  // namespace kvb

// Occupancy is set by shared memory (2 CTAs per SM at head 128); the explicit minimum of 1
// keeps ptxas from capping registers at its own occupancy target, where it spilled a few
// words on sm_80.
template <typename T, int D, int BLOCK, int GROUP, int STAGES = 2>
__global__ void __launch_bounds__(kvb::kDecodeThreads, 1) decode_attention_kernel(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
    const T* __restrict__ query, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int4* __restrict__ items, const int* __restrict__ num_items, int num_seqs,
    int num_heads, int num_kv_heads, int max_blocks, int num_blocks, float scale,
    float soft_cap, const float* __restrict__ sinks) {
  namespace wmma = nvcuda::wmma;
  using S = kvb::DecodeShape<T, D, BLOCK, GROUP, STAGES>;
  constexpr int NT = kvb::kDecodeThreads;
  constexpr int kHeads = S::kHeads;
  constexpr int kHT = S::kHeadTiles;
  constexpr int kLd = S::kLd;

  if (static_cast<int>(blockIdx.x) >= *num_items) return;  // uniform over the CTA
  if (num_seqs <= 0 || num_kv_heads <= 0 || num_heads < num_kv_heads) return;
  const int group = num_heads / num_kv_heads;
  const int chunks = (group + GROUP - 1) / GROUP;
  const int kv_head = blockIdx.y / chunks;
  const int chunk = blockIdx.y - kv_head * chunks;
  if (kv_head >= num_kv_heads) return;
  const int rows = min(GROUP, group - chunk * GROUP);  // real heads of the CTA
  const int head0 = kv_head * group + chunk * GROUP;
  const int4 item = items[blockIdx.x];
  const int seq = min(max(item.x, 0), num_seqs - 1);
  const int kv_begin = max(item.y, 0);
  const int kv_end = min(item.z, max_blocks * BLOCK);
  const int slot = item.w;

  KVB_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  unsigned char* wbase = smem + warp * S::kWarpBytes;
  T* k_s = reinterpret_cast<T*>(wbase);
  T* v_s = reinterpret_cast<T*>(wbase + (S::kKvBufs - 1) * S::kKvBytes);  // k_s at STAGES 1
  float* s_s = reinterpret_cast<float*>(wbase + S::kKvBufs * S::kKvBytes);
  T* p_s = reinterpret_cast<T*>(wbase + S::kKvBufs * S::kKvBytes + S::kSBytes);
  T* q_s = reinterpret_cast<T*>(smem + S::kQOffset);
  int* tbl_s = reinterpret_cast<int*>(smem + S::kTableOffset);
  float* ml_s = reinterpret_cast<float*>(smem + S::kMlOffset);

  // Q rows of the CTA's heads (padded heads are zero), unscaled: the scale is applied to
  // the fp32 scores, so Q keeps its input precision.
  for (int i = tid; i < kHeads * S::kPieces; i += NT) {
    const int r = i / S::kPieces;
    const int c = i - r * S::kPieces;
    kvb::Vec16 v = kvb::zero16();
    if (r < rows) {
      v = kvb::load16(query + (static_cast<long long>(seq) * num_heads + head0 + r) * D + c * 8);
    }
    kvb::store16(q_s + r * kLd + c * 8, v);
  }

  // Softmax lane roles: head h (of each 8-head tile), keys 8q..8q+7 of the warp's tile.
  const int h = lane / 4;
  const int q = lane % 4;
  float m_run[kHT];
  float l_run[kHT];
#pragma unroll
  for (int n = 0; n < kHT; ++n) {
    m_run[n] = KVB_NEG_INF;
    l_run[n] = 0.f;
  }
  wmma::fragment<wmma::accumulator, 32, 8, 16, float> o[S::kMTiles][kHT];
#pragma unroll
  for (int m = 0; m < S::kMTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kHT; ++n) wmma::fill_fragment(o[m][n], 0.f);
  }

  const bool capped = soft_cap > 0.f;
  const float qk_scale = capped ? scale : scale * kvb::kLog2e;
  const float cap_log2e = soft_cap * kvb::kLog2e;
  // __fdividef: no IEEE slow-path call (whose ABI made ptxas spill around it).
  const float inv_cap = capped ? __fdividef(1.f, soft_cap) : 0.f;
  const long long head_stride = static_cast<long long>(BLOCK) * D;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks;

  // The 32 key rows of tile t0 into buf (keys outside the item: zeros, nothing read).
  // When a row's 16-byte pieces divide among the lanes evenly (D = 64, 128, 256), a lane's
  // pieces share one column and lie kStep rows apart, and the rows of one cache block are
  // known at compile time: one table read and one 64-bit base per block, then one
  // LDGSTS per piece with an immediate offset.
  constexpr bool kEven = 32 % S::kPieces == 0;
  constexpr int kStep = kEven ? 32 / S::kPieces : 1;
  constexpr int kTileBlocks = S::kWarpTokens / BLOCK;
  const int lane_row = kEven ? lane / S::kPieces : 0;
  const int lane_col = lane % S::kPieces;
  const int lane_dst = lane_row * kLd + lane_col * 8;
  const int lane_src = lane_row * D + lane_col * 8;
  auto issue_tile = [&](T* buf, const T* cache, int t0, int first_block) {
    if constexpr (kEven) {
      const T* bases[kTileBlocks];
#pragma unroll
      for (int b = 0; b < kTileBlocks; ++b) {
        const int blk = tbl_s[(t0 >> S::kLogBlock) - first_block + b];
        bases[b] = cache + (static_cast<long long>(blk) * num_kv_heads + kv_head) * head_stride +
                   lane_src;
      }
      if (t0 >= kv_begin && t0 + S::kWarpTokens <= kv_end) {  // every key of the tile
#pragma unroll
        for (int i = 0; i < S::kCopies; ++i) {
          const int row = i * kStep;  // + lane_row
          kvb::cp_async16(buf + lane_dst + row * kLd,
                          bases[row >> S::kLogBlock] + (row & (BLOCK - 1)) * D, 16);
        }
      } else {
#pragma unroll
        for (int i = 0; i < S::kCopies; ++i) {
          const int row = i * kStep;
          const int j = t0 + lane_row + row;
          const bool ok = j >= kv_begin && j < kv_end;
          const T* src = bases[row >> S::kLogBlock] + (row & (BLOCK - 1)) * D;
          kvb::cp_async16(buf + lane_dst + row * kLd, ok ? src : cache, ok ? 16 : 0);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < S::kCopies; ++i) {
        const int piece = lane + 32 * i;
        const int row = piece / S::kPieces;
        const int col = piece - row * S::kPieces;
        const int j = t0 + row;
        const bool ok = j >= kv_begin && j < kv_end;
        const int blk = tbl_s[(j >> S::kLogBlock) - first_block];
        const T* src =
            cache + (static_cast<long long>(blk) * num_kv_heads + kv_head) * head_stride +
            (j & (BLOCK - 1)) * D + col * 8;
        kvb::cp_async16(buf + row * kLd + col * 8, ok ? src : cache, ok ? 16 : 0);
      }
    }
  };

  const int base = kv_begin & ~(S::kWarpTokens - 1);
  for (int c0 = base; c0 < kv_end; c0 += S::kChunkTokens) {
    __syncthreads();  // the previous slice is consumed (and q_s is written)
    const int first_block = c0 >> S::kLogBlock;
    for (int i = tid; i < S::kTableSlots; i += NT) {
      const int b = first_block + i;
      int id = 0;
      if (b < max_blocks) {
        id = table[b];
        if (id < 0 || id >= num_blocks) id = 0;  // never read outside the cache
      }
      tbl_s[i] = id;
    }
    __syncthreads();
    const int c1 = min(kv_end, c0 + S::kChunkTokens);
    int t0 = c0 + warp * S::kWarpTokens;
    // Groups in flight per lane: STAGES 2 keeps two (keys and values of a tile, or the
    // values of this one and the keys of the next), STAGES 1 one (its only buffer).
    constexpr int kInFlight = S::kKvBufs - 1;
    if (t0 < c1) {
      issue_tile(k_s, key_cache, t0, first_block);
      kvb::cp_async_commit();
      if constexpr (S::kKvBufs == 2) {
        issue_tile(v_s, value_cache, t0, first_block);
        kvb::cp_async_commit();
      }
    }
    for (; t0 < c1; t0 += S::kCtaTokens) {
      const int next = t0 + S::kCtaTokens;
      const bool has_next = next < c1;
      kvb::cp_async_wait<kInFlight>();  // this tile's keys (its values may still be in flight)
      kvb::warp_barrier(warp);          // every lane's key copies landed

      // 1. S^T = K . Q^T
      wmma::fragment<wmma::accumulator, 32, 8, 16, float> sacc[kHT];
#pragma unroll
      for (int n = 0; n < kHT; ++n) wmma::fill_fragment(sacc[n], 0.f);
#pragma unroll
      for (int kk = 0; kk < S::kKSteps; ++kk) {
        wmma::fragment<wmma::matrix_a, 32, 8, 16, T, wmma::row_major> ka;
        kvb::load_shared(ka, k_s + kk * 16, kLd);
#pragma unroll
        for (int n = 0; n < kHT; ++n) {
          wmma::fragment<wmma::matrix_b, 32, 8, 16, T, wmma::col_major> qb;
          kvb::load_shared(qb, q_s + n * 8 * kLd + kk * 16, kLd);
          wmma::mma_sync(sacc[n], ka, qb, sacc[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < kHT; ++n) {
        wmma::store_matrix_sync(s_s + n * 8 * S::kSLd, sacc[n], S::kSLd, wmma::mem_col_major);
      }
      kvb::warp_barrier(warp);  // scores visible; every lane is done reading the key tile
      if constexpr (S::kKvBufs == 2) {
        if (has_next) issue_tile(k_s, key_cache, next, first_block);
      } else {
        issue_tile(v_s, value_cache, t0, first_block);  // over the keys just consumed
      }
      kvb::cp_async_commit();

      // 2. Online softmax: 4 lanes per head, 8 keys each.
#pragma unroll
      for (int n = 0; n < kHT; ++n) {
        const int r = n * 8 + h;
        const float* srow = s_s + r * S::kSLd + q * 8;
        const kvb::Vec16 lo = kvb::load16(srow);
        const kvb::Vec16 hi = kvb::load16(srow + 4);
        float x[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[e] = __uint_as_float(lo.w[e]);
          x[e + 4] = __uint_as_float(hi.w[e]);
        }
        float mx = KVB_NEG_INF;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int j = t0 + q * 8 + e;
          float v = x[e] * qk_scale;
          if (capped) v = cap_log2e * tanhf(v * inv_cap);
          x[e] = (r < rows && j >= kv_begin && j < kv_end) ? v : KVB_NEG_INF;
          mx = fmaxf(mx, x[e]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[n], mx);
        // No visible key yet: p = 0 and alpha = 1 (never exp2(-inf - -inf)).
        const float m_use = m_new == KVB_NEG_INF ? 0.f : m_new;
        const float alpha = exp2f(m_run[n] - m_use);
        float sum = 0.f;
        float pv[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          pv[e] = exp2f(x[e] - m_use);
          sum += pv[e];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l_run[n] = l_run[n] * (m_new == KVB_NEG_INF ? 1.f : alpha) + sum;
        m_run[n] = m_new;
        kvb::store16(p_s + r * S::kPLd + q * 8, kvb::pack<T>(pv));
        // alpha over the 8 scores this lane read (no other lane reads them): the 32 x 8
        // matrix (d, head) -> alpha[head] that rescales the O^T accumulators.
        const unsigned a = __float_as_uint(m_new == KVB_NEG_INF ? 1.f : alpha);
        const kvb::Vec16 a4 = {{a, a, a, a}};
        float* adst = s_s + r * S::kSLd + q * 8;
        kvb::store16(adst, a4);
        kvb::store16(adst + 4, a4);
      }
      kvb::cp_async_wait<kInFlight>();  // this tile's values
      kvb::warp_barrier(warp);          // and every lane's P and alpha

      // 3. O^T = alpha * O^T + V^T . P^T
#pragma unroll
      for (int n = 0; n < kHT; ++n) {
        wmma::fragment<wmma::accumulator, 32, 8, 16, float> af;
        wmma::load_matrix_sync(af, s_s + n * 8 * S::kSLd, S::kSLd, wmma::mem_col_major);
#pragma unroll
        for (int m = 0; m < S::kMTiles; ++m) {
#pragma unroll
          for (int e = 0; e < af.num_elements; ++e) o[m][n].x[e] *= af.x[e];
        }
      }
#pragma unroll
      for (int kk = 0; kk < S::kWarpTokens / 16; ++kk) {
        wmma::fragment<wmma::matrix_b, 32, 8, 16, T, wmma::col_major> pb[kHT];
#pragma unroll
        for (int n = 0; n < kHT; ++n) {
          kvb::load_shared(pb[n], p_s + n * 8 * S::kPLd + kk * 16, S::kPLd);
        }
#pragma unroll
        for (int m = 0; m < S::kMTiles; ++m) {
          wmma::fragment<wmma::matrix_a, 32, 8, 16, T, wmma::col_major> va;
          kvb::load_shared(va, v_s + kk * 16 * kLd + m * 32, kLd);
#pragma unroll
          for (int n = 0; n < kHT; ++n) wmma::mma_sync(o[m][n], va, pb[n], o[m][n]);
        }
      }
      kvb::warp_barrier(warp);  // every lane is done reading the value tile, P and alpha
      if (has_next) {
        if constexpr (S::kKvBufs == 2) {
          issue_tile(v_s, value_cache, next, first_block);
        } else {
          issue_tile(k_s, key_cache, next, first_block);
        }
      }
      kvb::cp_async_commit();
    }
    kvb::cp_async_wait<0>();  // nothing in flight across a table slice (or into O below)
  }

  // Merge the four warps' states: O^T to the warp's own K/V buffers, (max, sum) per head.
  kvb::warp_barrier(warp);
  float* o_s = reinterpret_cast<float*>(k_s);
#pragma unroll
  for (int m = 0; m < S::kMTiles; ++m) {
#pragma unroll
    for (int n = 0; n < kHT; ++n) {
      wmma::store_matrix_sync(o_s + n * 8 * S::kOLd + m * 32, o[m][n], S::kOLd,
                              wmma::mem_col_major);
    }
  }
  if (q == 0) {
#pragma unroll
    for (int n = 0; n < kHT; ++n) {
      ml_s[(warp * kHeads + n * 8 + h) * 2] = m_run[n];
      ml_s[(warp * kHeads + n * 8 + h) * 2 + 1] = l_run[n];
    }
  }
  __syncthreads();
  for (int i = tid; i < rows * S::kPieces; i += NT) {
    const int r = i / S::kPieces;
    const int c = i - r * S::kPieces;
    float mw[kvb::kDecodeWarps];
    float big = KVB_NEG_INF;
#pragma unroll
    for (int w = 0; w < kvb::kDecodeWarps; ++w) {
      mw[w] = ml_s[(w * kHeads + r) * 2];
      big = fmaxf(big, mw[w]);
    }
    float total = 0.f;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kvb::kDecodeWarps; ++w) {
      const float wt = mw[w] == KVB_NEG_INF ? 0.f : exp2f(mw[w] - big);
      total += wt * ml_s[(w * kHeads + r) * 2 + 1];
      const float* src = reinterpret_cast<const float*>(smem + w * S::kWarpBytes) +
                         r * S::kOLd + c * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += wt * src[e];
    }
    const long long row = static_cast<long long>(head0 + r);
    if (slot < 0) {
      float inv = total > 0.f ? __fdividef(1.f, total) : 0.f;  // no visible key: zeros
      if (sinks != nullptr && big != KVB_NEG_INF) inv = kvb::sink_inv(big, total, sinks[row]);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= inv;
      kvb::store16(out + (seq * static_cast<long long>(num_heads) + row) * D + c * 8,
                   kvb::pack<T>(acc));
    } else {
      float* dst = part_out + (slot * static_cast<long long>(num_heads) + row) * D + c * 8;
      kvb::Vec16 w0, w1;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w0.w[e] = __float_as_uint(acc[e]);
        w1.w[e] = __float_as_uint(acc[e + 4]);
      }
      kvb::store16(dst, w0);
      kvb::store16(dst + 4, w1);
      if (c == 0) {
        part_ml[(slot * static_cast<long long>(num_heads) + row) * 2] = big;
        part_ml[(slot * static_cast<long long>(num_heads) + row) * 2 + 1] = total;
      }
    }
  }
}

// Combine a sequence's partials: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p,
// with the sequence's one sink term in the denominator when sinks are given (kvb::sink_inv).
// One CTA per (sequence, head); threads stride over the head dimension.
template <typename T, int D>
__global__ void __launch_bounds__(kvb::kDecodeThreads) merge_partials_kernel(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_ml,
    const int* __restrict__ merge_indptr, int num_seqs, int num_heads,
    const float* __restrict__ sinks) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  if (seq >= num_seqs || head >= num_heads) return;
  const int lo = merge_indptr[seq];
  const int hi = merge_indptr[seq + 1];
  if (hi <= lo) return;  // the sequence's single item wrote out itself
  float big = KVB_NEG_INF;
  for (int p = lo; p < hi; ++p) {
    big = fmaxf(big, part_ml[(static_cast<long long>(p) * num_heads + head) * 2]);
  }
  float total = 0.f;
  if (big != KVB_NEG_INF) {
    for (int p = lo; p < hi; ++p) {
      const float* ml = part_ml + (static_cast<long long>(p) * num_heads + head) * 2;
      if (ml[0] != KVB_NEG_INF) total += exp2f(ml[0] - big) * ml[1];
    }
  }
  float inv = total > 0.f ? 1.f / total : 0.f;
  if (sinks != nullptr && big != KVB_NEG_INF) inv = kvb::sink_inv(big, total, sinks[head]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    if (total > 0.f) {
      for (int p = lo; p < hi; ++p) {
        const long long row = static_cast<long long>(p) * num_heads + head;
        const float m = part_ml[row * 2];
        if (m != KVB_NEG_INF) acc += exp2f(m - big) * part_out[row * D + d];
      }
    }
    out[(static_cast<long long>(seq) * num_heads + head) * D + d] =
        kvb::Elem<T>::from_float(acc * inv);
  }
}
