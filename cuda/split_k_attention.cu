// The split-K kernel (CUDA cores: fp32, and fp16/bf16 decode without host-side lengths):
// paged attention over the HND block cache, decode (optional split-K) and varlen prefill.
//
// A CTA serves `rows` = queries_per_cta x heads_per_cta query rows that share one KV
// head (GQA: K/V are read once for the whole group). Grid: x = query tile x split (the
// only dimension that grows with prompt length; neighbours share K/V in L2), y =
// sequence, z = KV head x head chunk. The CTA walks the visible KV range in
// tiles of kTile tokens staged in shared memory:
//   1. every thread loads 16-byte vectors of the tile's K and V rows (coalesced: a tile
//      row is contiguous in a (block, head) tile), the next tile is prefetched into
//      registers while the current one is computed;
//   2. scores: one thread per (row, token) dot product, q pre-scaled, in base 2;
//   3. online softmax: one thread per row updates running max/sum (no logits array, no
//      length cap) and turns the tile's scores into probabilities;
//   4. P*V: every thread owns 16-byte output slices of rows (and, when rows are few, a
//      slice of the tile's tokens); fp32 accumulators live in registers.
// With num_splits > 1 a CTA covers one split_tokens chunk of positions (the last split:
// everything after it) and writes an unnormalized fp32 partial plus (max, sum);
// merge_splits_kernel combines them. Attention sinks (sinks[h], null: none) join a row's
// denominator where it is normalized: here when unsplit, in merge_splits_kernel otherwise.
// A CTA loops over query tiles when the grid has fewer
// tiles than a chunk needs, so the host's max_seq_len / max_query_len are planning hints
// that never drop a key or leave an output row unwritten.
//
// Bounds safety: block ids read from block_tables outside [0, num_blocks) are replaced
// by the null block 0, no position past max_blocks * block_size is read, and
// query_start_loc is clamped to [0, num_tokens], so a bad table or offset yields wrong
// numbers but never an out-of-bounds access.
#include "kv_common.cuh"

namespace kvb {

template <typename T, int D, int RMAX>
struct SplitKShape {
  static constexpr int kVec = VecTraits<T>::kElems;
  static constexpr int kVecsPerRow = D / kVec;
  static constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
  // About 8 KiB of K (and of V) per tile, 8..32 tokens.
  static constexpr int kTile = 8192 / kRowBytes >= 32 ? 32 : (8192 / kRowBytes >= 16 ? 16 : 8);
  // Shared K/V rows are padded by 16 bytes so that threads reading the same column of
  // consecutive rows hit different banks.
  static constexpr int kRowStride = kRowBytes + 16;
  static constexpr int kLoads = (kTile * kVecsPerRow + kThreads - 1) / kThreads;
  static constexpr int kItems = (RMAX * kVecsPerRow + kThreads - 1) / kThreads;
  static constexpr int kQStride = D + 4;  // floats, padded like the K rows
  // Shared memory layout (bytes): [K tile | V tile] (reused for the final cross-slice
  // reduction), q rows (fp32), scores, per-row max/sum/rescale.
  static constexpr int kTileBytes = 2 * kTile * kRowStride;
  static constexpr int kReduceSlots = RMAX * kVecsPerRow > kThreads ? RMAX * kVecsPerRow : kThreads;
  static constexpr int kReduceBytes = kReduceSlots * kVec * 4;
  static constexpr int kRegion0 = kTileBytes > kReduceBytes ? kTileBytes : kReduceBytes;
  static constexpr int kQOffset = kRegion0;
  static constexpr int kScoreOffset = kQOffset + RMAX * kQStride * 4;
  static constexpr int kStateOffset = kScoreOffset + RMAX * kTile * 4;
  static constexpr int kSmemBytes = kStateOffset + 3 * RMAX * 4;
  static_assert(D % kVec == 0, "head size must be a whole number of 16-byte vectors");
};

}  // namespace kvb

template <typename T, int D, int RMAX>
// At most 128 registers: 4 CTAs per SM (launch_plan.CTAS_PER_SM) and no spills.
__global__ void __launch_bounds__(kvb::kThreads, 4) split_k_attention_kernel(
    T* __restrict__ out,                    // [tokens, num_heads, D] when num_splits == 1
    float* __restrict__ part_out,           // [tokens, num_heads, num_splits, D]
    float* __restrict__ part_ml,            // [tokens, num_heads, num_splits, 2]
    const T* __restrict__ query,            // [tokens, num_heads, D]
    const T* __restrict__ key_cache,        // [num_blocks, num_kv_heads, block_size, D]
    const T* __restrict__ value_cache,      // same
    const int* __restrict__ block_tables,   // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,       // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1], or null: decode
    int num_tokens, int num_heads, int num_kv_heads, int block_size, int max_blocks, int num_blocks,
    int heads_per_cta, int queries_per_cta, int num_splits, int split_tokens, float scale,
    float soft_cap, int sliding_window,
    const float* __restrict__ sinks) {  // [num_heads] attention-sink logits, or null: none
  using S = kvb::SplitKShape<T, D, RMAX>;
  constexpr int NT = kvb::kThreads;
  constexpr int VPR = S::kVecsPerRow;
  constexpr int VEC = S::kVec;
  constexpr int TILE = S::kTile;
  KVB_DYNAMIC_SMEM(smem);
  unsigned char* k_s = smem;
  unsigned char* v_s = smem + TILE * S::kRowStride;
  float* red_s = reinterpret_cast<float*>(smem);
  float* q_s = reinterpret_cast<float*>(smem + S::kQOffset);
  float* s_s = reinterpret_cast<float*>(smem + S::kScoreOffset);
  float* m_s = reinterpret_cast<float*>(smem + S::kStateOffset);
  float* l_s = m_s + RMAX;
  float* alpha_s = l_s + RMAX;

  const int tid = threadIdx.x;
  const int group = num_heads / num_kv_heads;
  const int head_chunks = (group + heads_per_cta - 1) / heads_per_cta;
  const int kv_head = blockIdx.z / head_chunks;
  const int chunk = blockIdx.z % head_chunks;
  const int seq = blockIdx.y;
  const int split = blockIdx.x % num_splits;
  const int q_tile = blockIdx.x / num_splits;

  const int seq_len = seq_lens[seq];
  int q_begin = seq;
  int q_len = 1;
  if (query_start_loc != nullptr) {
    // Clamped to the query's rows: the offsets live on the device and are not validated
    // when the host passes max_query_len, and a bad one must not read or write out of bounds.
    q_begin = min(max(query_start_loc[seq], 0), num_tokens);
    q_len = min(max(query_start_loc[seq + 1], q_begin), num_tokens) - q_begin;
  }
  const int rows = queries_per_cta * heads_per_cta;
  const int first_pos = seq_len - q_len;  // position of the chunk's first query
  // The grid's query tiles may be fewer than the chunk needs (the host's max_query_len is
  // a planning hint, e.g. stale in a CUDA graph): a CTA serves every q_tiles-th tile. The
  // loop condition is uniform over the CTA, so the barriers inside stay convergent, and a
  // CTA past a sequence's q_len does nothing (q_len = 0 is fine).
  const int q_step = (gridDim.x / num_splits) * queries_per_cta;
  for (int q0 = q_tile * queries_per_cta; q0 < q_len; q0 += q_step) {
    // Visible key range of the CTA (exclusive end), clipped to the table's capacity.
    int kv_hi = min(seq_len, first_pos + min(q0 + queries_per_cta, q_len));
    kv_hi = min(kv_hi, max_blocks * block_size);
    int kv_lo = 0;
    if (sliding_window > 0) kv_lo = max(0, first_pos + q0 - sliding_window + 1);
    if (num_splits > 1) {
      // The last split takes the rest of the sequence: the host plans the splits from
      // max_seq_len, which may be below the real length (CUDA-graph replay); no key is dropped.
      kv_lo = max(kv_lo, split * split_tokens);
      if (split + 1 < num_splits) kv_hi = min(kv_hi, (split + 1) * split_tokens);
    }

    // Row r: query q0 + r / heads_per_cta of the chunk, head chunk*heads_per_cta + r % hpc.
    for (int i = tid; i < RMAX * VPR; i += NT) {
      const int r = i / VPR;
      const int v = i % VPR;
      const int qi = q0 + r / heads_per_cta;
      const int hg = chunk * heads_per_cta + r % heads_per_cta;
      float vals[VEC];
      if (r < rows && qi < q_len && hg < group) {
        const long long tok = q_begin + qi;
        const int head = kv_head * group + hg;
        kvb::unpack<T>(kvb::load16(query + (tok * num_heads + head) * D + v * VEC), vals);
  #pragma unroll
        for (int e = 0; e < VEC; ++e) vals[e] *= scale;
      } else {
  #pragma unroll
        for (int e = 0; e < VEC; ++e) vals[e] = 0.f;
      }
  #pragma unroll
      for (int e = 0; e < VEC; ++e) q_s[r * S::kQStride + v * VEC + e] = vals[e];
    }
    if (tid < RMAX) {
      m_s[tid] = KVB_NEG_INF;
      l_s[tid] = 0.f;
    }

    // Output items: (slice, row, vector); slices split a tile's tokens when rows are few.
    const int nslice = max(1, NT / (rows * VPR));
    const int items = rows * VPR * nslice;
    float acc[S::kItems][VEC];
  #pragma unroll
    for (int k = 0; k < S::kItems; ++k) {
  #pragma unroll
      for (int e = 0; e < VEC; ++e) acc[k][e] = 0.f;
    }

    kvb::Vec16 k_reg[S::kLoads];
    kvb::Vec16 v_reg[S::kLoads];
    const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
    const long long head_stride = static_cast<long long>(block_size) * D;

    auto load_tile = [&](int t0) {
  #pragma unroll
      for (int l = 0; l < S::kLoads; ++l) {
        const int idx = tid + l * NT;
        const int t = idx / VPR;
        const int j = t0 + t;
        if (idx < TILE * VPR && j < kv_hi) {
          int blk = table[j / block_size];
          if (blk < 0 || blk >= num_blocks) blk = 0;  // never read outside the cache
          const long long off =
              (static_cast<long long>(blk) * num_kv_heads + kv_head) * head_stride +
              static_cast<long long>(j % block_size) * D + (idx % VPR) * VEC;
          k_reg[l] = kvb::load16(key_cache + off);
          v_reg[l] = kvb::load16(value_cache + off);
        } else {
          k_reg[l] = kvb::zero16();
          v_reg[l] = kvb::zero16();
        }
      }
    };

    if (kv_lo < kv_hi) load_tile(kv_lo);
    for (int t0 = kv_lo; t0 < kv_hi; t0 += TILE) {
      __syncthreads();  // the previous tile is fully consumed (and q_s/m_s are visible)
  #pragma unroll
      for (int l = 0; l < S::kLoads; ++l) {
        const int idx = tid + l * NT;
        if (idx < TILE * VPR) {
          const int off = (idx / VPR) * S::kRowStride + (idx % VPR) * 16;
          kvb::store16(k_s + off, k_reg[l]);
          kvb::store16(v_s + off, v_reg[l]);
        }
      }
      __syncthreads();
      if (t0 + TILE < kv_hi) load_tile(t0 + TILE);  // in flight during the compute below

      // Scores, base 2, -inf where masked.
      for (int i = tid; i < rows * TILE; i += NT) {
        const int r = i / TILE;
        const int t = i % TILE;
        const int j = t0 + t;
        const int qi = q0 + r / heads_per_cta;
        const int pos = first_pos + qi;
        const int hg = chunk * heads_per_cta + r % heads_per_cta;
        float s = KVB_NEG_INF;
        if (qi < q_len && hg < group && j < kv_hi && j <= pos &&
            (sliding_window <= 0 || j > pos - sliding_window)) {
          float dot = 0.f;
          const float* q = q_s + r * S::kQStride;
  #pragma unroll 4
          for (int v = 0; v < VPR; ++v) {
            float kf[VEC];
            kvb::unpack<T>(kvb::load16(k_s + t * S::kRowStride + v * 16), kf);
  #pragma unroll
            for (int e = 0; e < VEC; ++e) dot += q[v * VEC + e] * kf[e];
          }
          if (soft_cap > 0.f) dot = soft_cap * tanhf(dot / soft_cap);
          s = dot * kvb::kLog2e;
        }
        s_s[r * TILE + t] = s;
      }
      __syncthreads();

      // Online softmax, one thread per row.
      if (tid < rows) {
        float* srow = s_s + tid * TILE;
        const float m_old = m_s[tid];
        float m_new = m_old;
        for (int t = 0; t < TILE; ++t) m_new = fmaxf(m_new, srow[t]);
        float alpha = 1.f;
        float sum = 0.f;
        if (m_new == KVB_NEG_INF) {
          for (int t = 0; t < TILE; ++t) srow[t] = 0.f;
        } else {
          alpha = exp2f(m_old - m_new);  // 0 on the first visible tile (m_old = -inf)
          for (int t = 0; t < TILE; ++t) {
            const float p = exp2f(srow[t] - m_new);  // exp2f(-inf) = 0 for masked keys
            srow[t] = p;
            sum += p;
          }
        }
        m_s[tid] = m_new;
        l_s[tid] = l_s[tid] * alpha + sum;
        alpha_s[tid] = alpha;
      }
      __syncthreads();

      // P * V into the register accumulators.
  #pragma unroll
      for (int k = 0; k < S::kItems; ++k) {
        const int i = tid + k * NT;
        if (i < items) {
          const int slice = i / (rows * VPR);
          const int rem = i % (rows * VPR);
          const int r = rem / VPR;
          const int v = rem % VPR;
          const float alpha = alpha_s[r];
  #pragma unroll
          for (int e = 0; e < VEC; ++e) acc[k][e] *= alpha;
          const float* prow = s_s + r * TILE;
          for (int t = slice; t < TILE; t += nslice) {
            const float p = prow[t];
            float vf[VEC];
            kvb::unpack<T>(kvb::load16(v_s + t * S::kRowStride + v * 16), vf);
  #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[k][e] += p * vf[e];
          }
        }
      }
    }

    // Sum the token slices through shared memory, then normalize and store.
    __syncthreads();  // the tiles are no longer read: reuse their space
  #pragma unroll
    for (int k = 0; k < S::kItems; ++k) {
      const int i = tid + k * NT;
      if (i < items) {
  #pragma unroll
        for (int e = 0; e < VEC; ++e) red_s[i * VEC + e] = acc[k][e];
      }
    }
    // An unsplit row's sink joins its sum here, one thread per row (the accumulators are
    // dead, so the per-slice loop below keeps its registers): l + 2^(sink - m), an
    // overflow giving 1 / l = 0, the dominant sink's limit. Split rows: in the merge.
    if (sinks != nullptr && num_splits == 1 && tid < rows && l_s[tid] > 0.f) {
      const int hg = chunk * heads_per_cta + tid % heads_per_cta;
      if (hg < group) l_s[tid] += exp2f(sinks[kv_head * group + hg] * kvb::kLog2e - m_s[tid]);
    }
    __syncthreads();
    for (int i = tid; i < rows * VPR; i += NT) {
      const int r = i / VPR;
      const int v = i % VPR;
      const int qi = q0 + r / heads_per_cta;
      const int hg = chunk * heads_per_cta + r % heads_per_cta;
      if (qi >= q_len || hg >= group) continue;
      float sum[VEC];
  #pragma unroll
      for (int e = 0; e < VEC; ++e) sum[e] = 0.f;
      for (int slice = 0; slice < nslice; ++slice) {
        const float* src = red_s + (slice * rows * VPR + i) * VEC;
  #pragma unroll
        for (int e = 0; e < VEC; ++e) sum[e] += src[e];
      }
      const long long row =
          (static_cast<long long>(q_begin) + qi) * num_heads + kv_head * group + hg;
      if (num_splits == 1) {
        const float l = l_s[r];
        const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros, not NaN
  #pragma unroll
        for (int e = 0; e < VEC; ++e) sum[e] *= inv;
        kvb::store16(out + row * D + v * VEC, kvb::pack<T>(sum));
      } else {
        float* dst = part_out + (row * num_splits + split) * D + v * VEC;
  #pragma unroll
        for (int e = 0; e < VEC; e += 4) {
          kvb::Vec16 w;
          for (int c = 0; c < 4; ++c) w.w[c] = __float_as_uint(sum[e + c]);
          kvb::store16(dst + e, w);
        }
        if (v == 0) {
          part_ml[(row * num_splits + split) * 2] = m_s[r];
          part_ml[(row * num_splits + split) * 2 + 1] = l_s[r];
        }
      }
    }
    __syncthreads();  // the next query tile rewrites q_s, m_s, l_s and the tiles
  }
}

// Combine split partials: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p, plus the
// row's sink term in the denominator when sinks are given (the splits' partials omit it).
// Grid: one CTA per (token, head) row; threads stride over the head dimension.
template <typename T, int D>
__global__ void __launch_bounds__(kvb::kThreads) merge_splits_kernel(
    T* __restrict__ out, const float* __restrict__ part_out,
    const float* __restrict__ part_ml, int num_splits, int num_heads,
    const float* __restrict__ sinks) {
  const long long row = blockIdx.x;
  const float* ml = part_ml + row * num_splits * 2;
  float m_max = KVB_NEG_INF;
  for (int p = 0; p < num_splits; ++p) m_max = fmaxf(m_max, ml[2 * p]);
  float denom = 0.f;
  if (m_max != KVB_NEG_INF) {
    for (int p = 0; p < num_splits; ++p) {
      if (ml[2 * p] != KVB_NEG_INF) denom += exp2f(ml[2 * p] - m_max) * ml[2 * p + 1];
    }
  }
  float inv = denom > 0.f ? 1.f / denom : 0.f;
  if (sinks != nullptr && denom > 0.f) {
    inv = kvb::sink_inv(m_max, denom, sinks[blockIdx.x % static_cast<unsigned>(num_heads)]);
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    if (denom > 0.f) {
      for (int p = 0; p < num_splits; ++p) {
        const float m = ml[2 * p];
        if (m != KVB_NEG_INF) acc += exp2f(m - m_max) * part_out[(row * num_splits + p) * D + d];
      }
    }
    out[row * D + d] = kvb::Elem<T>::from_float(acc * inv);
  }
}
