// Varlen paged prefill/extend attention on tensor cores (WMMA), FlashAttention-2 style.
//
// Semantics are those of paged_attention_kernel's prefill path (kvblocks.ops.reference):
// sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]; query i of a
// chunk of q_len sits at position seq_len - q_len + i and sees keys j with
// pos - window < j <= pos (causal offset), soft cap cap * tanh(s / cap) after scaling,
// GQA (a CTA serves query heads of one KV head), K/V paged in HND via block tables. A row
// without a visible key outputs zeros.
//
// Work split. A CTA (4 warps) owns kRows query rows of one KV head; row r is query
// q0 + r / heads_per_cta, head chunk * heads_per_cta + r % heads_per_cta (the host packs
// the heads of a GQA group into a CTA when chunks are short, so K/V are read once for
// them). Warp w owns the 16 rows of row block w / kDSplit and the head columns
// [(w % kDSplit) * kDH, +kDH): kDSplit = 2 at head 256 halves the per-warp accumulator.
// Per K/V tile of kTile tokens, staged in shared memory with 16-byte loads:
//   1. S = Q K^T on tensor cores; Q lives in registers as WMMA A-fragments (loaded once
//      per query tile); the fp32 S fragments go to shared memory (with kDSplit = 2 the two
//      warps of a row block store partial sums over their halves of the head).
//   2. Online softmax on the shared scores (a fragment's element order is unspecified, so
//      per-row work never touches fragment elements): 128 / kRows threads per row apply
//      scale, soft cap and (on tiles that cross a row's causal/window/length edge only)
//      the mask, reduce the tile max by shuffles and write P as T over the row's scores. The running max is rescaled lazily: only
//      when a row's max grows by more than kRescaleLog2 (P stays below 2^8, exact enough in
//      fp16/bf16 and far from overflow) does the CTA rescale that row block's fp32 output
//      fragments, through shared memory; with a stable max (the usual case after the first
//      tiles) the output accumulators never leave the tensor-core registers.
//   3. O += P V on tensor cores, O in fp32 WMMA accumulators.
// At the end the row sums are reduced, O is normalized through a per-warp 16x16 scratch
// and written as T with 16-byte stores.
//
// Grid: x = num_kv_heads x head_chunks, y = sequence, z = query tile in reverse order: the
// block scheduler issues z slowest, so the last (longest, causal) query tiles of every
// sequence start first and the short ones fill the tail. A CTA serves tiles qt, qt + Z,
// ... while they start below q_len (uniform over the CTA: barriers stay convergent), so the
// host's max_query_len is only a hint and a grid capped at 65535 tiles still writes every row.
//
// Bounds safety as in paged_attention.cu: block ids outside [0, num_blocks) read block 0,
// no position past max_blocks * block_size is read, query_start_loc is clamped to
// [0, num_tokens]. block_size must be a power of two (the front-ends allow 8/16/32); the
// kernel turns the token-to-block division into a shift and mask.
#include <mma.h>

#include "kv_common.cuh"

namespace kvb {

template <typename T, int D>
struct PrefillShape {
  static constexpr int kWarps = kThreads / 32;
  // Head 256 splits a row block's head columns over two warps (accumulator registers).
  static constexpr int kDSplit = D > 128 ? 2 : 1;
  static constexpr int kDH = D / kDSplit;  // head columns per warp
  static constexpr int kRowBlocks = kWarps / kDSplit;
  static constexpr int kRows = 16 * kRowBlocks;
  // Tokens per K/V tile: 64 while K, V and the scores fit the default 48 KiB.
  static constexpr int kTile = D <= 96 ? 64 : 32;
  static constexpr int kVec = VecTraits<T>::kElems;
  static constexpr int kVecsPerRow = D / kVec;
  // Shared K/V/Q rows padded by 16 bytes (bank spread); 16 rows stay 32-byte aligned.
  static constexpr int kKVStride = D + 8;                 // elements of T
  static constexpr int kSStride = kTile + 4;              // floats per score row
  static constexpr int kPStride = 2 * kSStride;           // T per P row (P overwrites S)
  static constexpr int kTileBytes = kTile * kKVStride * 2;  // one of K or V
  static constexpr int kLoads = (kTile * kVecsPerRow + kThreads - 1) / kThreads;
  // Prefetch the next tile into registers while computing this one, up to 4 K+V vectors
  // per thread (32 registers); head 80/96 at 64 tokens and head 256 load in the loop.
  static constexpr bool kPrefetch = kLoads <= 4;
  // CTAs per SM the register budget is sized for (__launch_bounds__).
  static constexpr int kMinCtas = 2;
  static constexpr int kThreadsPerRow = kThreads / kRows;
  static constexpr int kColsPerThread = kTile / kThreadsPerRow;
  // Layout (bytes): K tile | V tile (the pair also stages Q) | scores (kDSplit partials) |
  // per-warp 16x16 fp32 scratch | alpha[kRows] | inv_l[kRows] | flag[kWarps].
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kTileBytes;
  static constexpr int kSOffset = 2 * kTileBytes;
  static constexpr int kScratchOffset = kSOffset + kDSplit * kRows * kSStride * 4;
  static constexpr int kAlphaOffset = kScratchOffset + kWarps * 256 * 4;
  static constexpr int kInvLOffset = kAlphaOffset + kRows * 4;
  static constexpr int kFlagOffset = kInvLOffset + kRows * 4;
  static constexpr int kSmemBytes = kFlagOffset + kWarps * 4;

  static_assert(sizeof(T) == 2, "the tensor-core kernel takes fp16/bf16 (fp32 keeps the old one)");
  static_assert(D % 16 == 0 && kDH % 16 == 0, "head columns must be whole 16-wide fragments");
  static_assert(kRows <= 2 * kTile, "Q is staged in the K and V tiles");
  static_assert(kColsPerThread % 8 == 0, "P is written in 16-byte vectors");
  static_assert((16 * kKVStride * 2) % 32 == 0 && (16 * kSStride * 4) % 32 == 0,
                "WMMA tiles must start 32-byte aligned");
};

// Lazy rescaling threshold (log2 units): P = 2^(s - m_used) < 2^kRescaleLog2.
constexpr float kRescaleLog2 = 8.f;

// 2^x for the softmax: one MUFU.EX2 (ex2.approx.ftz: ~2 ulp, -inf -> 0, subnormal results
// flush to 0, all far below what P keeps in fp16/bf16) instead of exp2f's range handling.
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef KVB_EMULATION
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

namespace wmma = nvcuda::wmma;

// Fragment loads from shared memory. NVVM gives the fp16 WMMA loads the .shared state space
// (ldmatrix) but leaves the bf16 ones generic (per-element LD); the bf16 overloads state it
// in PTX. The emulator has the plain API.
template <typename Frag, typename T>
__device__ __forceinline__ void load_shared(Frag& f, const T* p, unsigned ldm) {
  wmma::load_matrix_sync(f, p, ldm);
}

#ifndef KVB_EMULATION
#define KVB_BF16_LOAD_SHARED(USE, LAYOUT, AB, ROWCOL)                                         \
  __device__ __forceinline__ void load_shared(                                               \
      wmma::fragment<wmma::USE, 16, 16, 16, __nv_bfloat16, wmma::LAYOUT>& f,                 \
      const __nv_bfloat16* p, unsigned ldm) {                                                \
    unsigned* r = reinterpret_cast<unsigned*>(&f.x[0]);                                      \
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));                \
    asm volatile("wmma.load." AB ".sync.aligned." ROWCOL                                      \
                 ".m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"                        \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                            \
                 : "r"(addr), "r"(ldm)                                                       \
                 : "memory");                                                                \
  }
KVB_BF16_LOAD_SHARED(matrix_a, row_major, "a", "row")
KVB_BF16_LOAD_SHARED(matrix_b, row_major, "b", "row")
KVB_BF16_LOAD_SHARED(matrix_b, col_major, "b", "col")
#undef KVB_BF16_LOAD_SHARED
#endif

}  // namespace kvb

template <typename T, int D>
// 4 warps, 2 CTAs per SM: up to 255 registers for the Q and output fragments and the
// prefetched tile (no spills, checked by the NVRTC tests).
__global__ void __launch_bounds__(kvb::kThreads, (kvb::PrefillShape<T, D>::kMinCtas))
    prefill_attention_kernel(
    T* __restrict__ out,                      // [tokens, num_heads, D]
    const T* __restrict__ query,              // [tokens, num_heads, D]
    const T* __restrict__ key_cache,          // [num_blocks, num_kv_heads, block_size, D]
    const T* __restrict__ value_cache,        // same
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    int num_tokens, int num_heads, int num_kv_heads, int block_size, int max_blocks,
    int num_blocks, int heads_per_cta, float scale, float soft_cap, int sliding_window) {
  namespace wmma = nvcuda::wmma;
  using S = kvb::PrefillShape<T, D>;
  constexpr int NT = kvb::kThreads;
  constexpr int ROWS = S::kRows;
  constexpr int TILE = S::kTile;
  constexpr int DH = S::kDH;
  constexpr int VPR = S::kVecsPerRow;
  constexpr int VEC = S::kVec;
  constexpr int KVS = S::kKVStride;
  constexpr int SS = S::kSStride;
  constexpr int TPR = S::kThreadsPerRow;
  constexpr int CPT = S::kColsPerThread;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using FragKt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
  using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

  KVB_DYNAMIC_SMEM(smem);
  T* k_s = reinterpret_cast<T*>(smem + S::kKOffset);
  T* v_s = reinterpret_cast<T*>(smem + S::kVOffset);
  T* q_stage = k_s;  // ROWS x KVS, spans the K and V tiles before the K/V loop
  float* s_s = reinterpret_cast<float*>(smem + S::kSOffset);
  T* p_s = reinterpret_cast<T*>(s_s);  // P row r over the first half of score row r
  float* alpha_s = reinterpret_cast<float*>(smem + S::kAlphaOffset);
  float* inv_l_s = reinterpret_cast<float*>(smem + S::kInvLOffset);
  int* flag_s = reinterpret_cast<int*>(smem + S::kFlagOffset);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int rb = warp / S::kDSplit;             // row block of this warp
  const int col0 = (warp % S::kDSplit) * DH;   // first head column of this warp
  float* scratch = reinterpret_cast<float*>(smem + S::kScratchOffset) + warp * 256;

  const int group = num_heads / num_kv_heads;
  const int head_chunks = (group + heads_per_cta - 1) / heads_per_cta;
  const int kv_head = blockIdx.x / head_chunks;
  const int chunk = blockIdx.x % head_chunks;
  const int seq = blockIdx.y;
  const int queries_per_cta = max(1, ROWS / heads_per_cta);
  const int used_rows = min(ROWS, queries_per_cta * heads_per_cta);

  const int seq_len = seq_lens[seq];
  const int q_begin = min(max(query_start_loc[seq], 0), num_tokens);
  const int q_len = min(max(query_start_loc[seq + 1], q_begin), num_tokens) - q_begin;
  const int first_pos = seq_len - q_len;
  const int kv_cap = max_blocks * block_size;
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;  // block_size is a power of two
  const int in_block = block_size - 1;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
  const long long head_stride = static_cast<long long>(block_size) * D;
  // Elements per cache block (all KV heads): far below 2^31, so a block's offset is one
  // 32 x 32 -> 64-bit multiply.
  const int block_stride = num_kv_heads * block_size * D;
  const T* k_head = key_cache + kv_head * head_stride;
  const T* v_head = value_cache + kv_head * head_stride;

  // The softmax row of this thread and its visible key range [lo, hi).
  const int srow = tid / TPR;
  const int spart = tid % TPR;

  for (int qt = gridDim.z - 1 - blockIdx.z; qt * queries_per_cta < q_len; qt += gridDim.z) {
    const int q0 = qt * queries_per_cta;
    const int q_rows = min(queries_per_cta, q_len - q0);
    // Keys the CTA needs: up to its last query, from the first query's window start.
    const int kv_hi = min(min(seq_len, first_pos + q0 + q_rows), kv_cap);
    const int kv_lo = sliding_window > 0 ? max(0, first_pos + q0 - sliding_window + 1) : 0;
    // Tiles inside [full_lo, full_hi) are visible to every row: no per-score mask.
    const int full_hi = min(first_pos + q0 + 1, kv_hi);
    const int full_lo = sliding_window > 0 ? first_pos + q0 + q_rows - sliding_window : kv_lo;

    int row_lo = 0, row_hi = 0;  // empty for padding rows and heads past the group
    {
      const int qi = q0 + srow / heads_per_cta;
      const int hg = chunk * heads_per_cta + srow % heads_per_cta;
      if (srow < used_rows && qi < q_len && hg < group) {
        const int pos = first_pos + qi;
        row_hi = min(pos + 1, kv_cap);
        row_lo = sliding_window > 0 ? pos - sliding_window + 1 : 0;
      }
    }

    // Stage the Q rows (zeros for padding rows) and pull this warp's A-fragments.
    for (int i = tid; i < ROWS * VPR; i += NT) {
      const int r = i / VPR;
      const int v = i % VPR;
      const int qi = q0 + r / heads_per_cta;
      const int hg = chunk * heads_per_cta + r % heads_per_cta;
      kvb::Vec16 val = kvb::zero16();
      if (r < used_rows && qi < q_len && hg < group) {
        const long long tok = q_begin + qi;
        val = kvb::load16(query + (tok * num_heads + kv_head * group + hg) * D + v * VEC);
      }
      kvb::store16(q_stage + r * KVS + v * VEC, val);
    }
    __syncthreads();
    FragA q_frag[DH / 16];
#pragma unroll
    for (int k = 0; k < DH / 16; ++k) {
      kvb::load_shared(q_frag[k], q_stage + rb * 16 * KVS + col0 + k * 16, KVS);
    }
    FragC o_frag[DH / 16];
#pragma unroll
    for (int n = 0; n < DH / 16; ++n) wmma::fill_fragment(o_frag[n], 0.f);
    float m_run = KVB_NEG_INF;  // running max (base 2) of this thread's row, as used by P
    float l_part = 0.f;         // this thread's share of the row's sum of P

    // K and V rows of a tile into registers.
    kvb::Vec16 k_reg[S::kLoads], v_reg[S::kLoads];
    int blk[S::kLoads];
    // Block ids of a tile's tokens, all read before any K/V address needs one (issued in
    // order behind each other, their latencies would add up), a tile before the K/V loads
    // that use them: the loop never waits for a block-table read.
    auto lookup = [&](int t0) {
#pragma unroll
      for (int l = 0; l < S::kLoads; ++l) {
        const int idx = tid + l * NT;
        const int j = min(t0 + idx / VPR, kv_hi - 1);
        if (S::kLoads * NT == TILE * VPR || idx < TILE * VPR) blk[l] = table[j >> shift];
      }
    };
    // Tokens past kv_hi load the last key's row again instead of branching to zeros: it is
    // finite cache data and every row masks it (P = 0), as the tail tile always masks.
    auto fetch = [&](int t0) {
#pragma unroll
      for (int l = 0; l < S::kLoads; ++l) {
        const int idx = tid + l * NT;
        const int j = min(t0 + idx / VPR, kv_hi - 1);
        if (S::kLoads * NT == TILE * VPR || idx < TILE * VPR) {
          const int b = blk[l] < 0 || blk[l] >= num_blocks ? 0 : blk[l];  // stay in the cache
          const long long off = static_cast<long long>(b) * block_stride +
                                ((j & in_block) * D + (idx % VPR) * VEC);
          k_reg[l] = kvb::load16(k_head + off);
          v_reg[l] = kvb::load16(v_head + off);
        }
      }
    };
    auto stage = [&]() {
#pragma unroll
      for (int l = 0; l < S::kLoads; ++l) {
        const int idx = tid + l * NT;
        if (S::kLoads * NT == TILE * VPR || idx < TILE * VPR) {
          const int off = (idx / VPR) * KVS + (idx % VPR) * VEC;
          kvb::store16(k_s + off, k_reg[l]);
          kvb::store16(v_s + off, v_reg[l]);
        }
      }
    };
    if (kv_lo < kv_hi) {
      lookup(kv_lo);
      if (S::kPrefetch) {
        fetch(kv_lo);
        lookup(kv_lo + TILE);
      }
    }

    for (int t0 = kv_lo; t0 < kv_hi; t0 += TILE) {
      if (!S::kPrefetch) fetch(t0);
      __syncthreads();  // the previous tile's V and P (or the staged Q) are consumed
      stage();
      __syncthreads();
      // The next tile's loads fly while this one is computed (when registers allow).
      if (t0 + TILE < kv_hi) {
        if (S::kPrefetch) {
          fetch(t0 + TILE);  // its block ids were read a tile ago
          lookup(t0 + 2 * TILE);
        } else {
          lookup(t0 + TILE);
        }
      }

      // 1. S (partial over this warp's head columns) = Q K^T.
      {
        FragC s_frag[TILE / 16];
#pragma unroll
        for (int n = 0; n < TILE / 16; ++n) wmma::fill_fragment(s_frag[n], 0.f);
#pragma unroll
        for (int k = 0; k < DH / 16; ++k) {
#pragma unroll
          for (int n = 0; n < TILE / 16; ++n) {
            FragKt k_frag;
            kvb::load_shared(k_frag, k_s + n * 16 * KVS + col0 + k * 16, KVS);
            wmma::mma_sync(s_frag[n], q_frag[k], k_frag, s_frag[n]);
          }
        }
        float* s_part = s_s + (warp % S::kDSplit) * ROWS * SS + rb * 16 * SS;
#pragma unroll
        for (int n = 0; n < TILE / 16; ++n) {
          wmma::store_matrix_sync(s_part + n * 16, s_frag[n], SS, wmma::mem_row_major);
        }
      }
      __syncthreads();

      // 2. Online softmax: TPR threads per row, CPT columns each.
      {
        float s[CPT];
        const float* src = s_s + srow * SS + spart * CPT;
#pragma unroll
        for (int c = 0; c < CPT; c += 4) {
          const float4 v = *reinterpret_cast<const float4*>(src + c);
          s[c] = v.x;
          s[c + 1] = v.y;
          s[c + 2] = v.z;
          s[c + 3] = v.w;
        }
        if (S::kDSplit == 2) {
#pragma unroll
          for (int c = 0; c < CPT; c += 4) {
            const float4 v = *reinterpret_cast<const float4*>(src + ROWS * SS + c);
            s[c] += v.x;
            s[c + 1] += v.y;
            s[c + 2] += v.z;
            s[c + 3] += v.w;
          }
        }
        // Base-2 logits: s * scale * log2(e), or cap * log2(e) * tanh(s * scale / cap).
        // The plain scale is folded into the exponent's FFMA below: positive, so the max
        // commutes with it.
        float mul = scale * kvb::kLog2e;
        if (soft_cap > 0.f) {
          const float inner = scale / soft_cap;
          const float outer = soft_cap * kvb::kLog2e;
#pragma unroll
          for (int c = 0; c < CPT; ++c) s[c] = outer * tanhf(s[c] * inner);
          mul = 1.f;
        }
        if (!(mul > 0.f)) {  // a zero or negative scale: apply it first
#pragma unroll
          for (int c = 0; c < CPT; ++c) s[c] *= mul;
          mul = 1.f;
        }
        const bool mask_tile = t0 + TILE > full_hi || t0 < full_lo;  // uniform over the CTA
        if (mask_tile) {
          const int j0 = t0 + spart * CPT;
#pragma unroll
          for (int c = 0; c < CPT; ++c) {
            const int j = j0 + c;
            s[c] = (j >= row_lo && j < row_hi) ? s[c] : KVB_NEG_INF;
          }
        }
        float mx = KVB_NEG_INF;
#pragma unroll
        for (int c = 0; c < CPT; ++c) mx = fmaxf(mx, s[c]);
#pragma unroll
        for (int o = 1; o < TPR; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        mx *= mul;
        // The max P is taken against: fixed until it falls kRescaleLog2 behind.
        float alpha = 1.f;
        int rescale = 0;
        if (m_run == KVB_NEG_INF) {
          m_run = mx;  // first visible tile (or still none): O and l are zero
        } else if (mx > m_run + kvb::kRescaleLog2) {
          alpha = kvb::exp2_approx(m_run - mx);
          l_part *= alpha;
          m_run = mx;
          rescale = 1;
        }
        const float base = m_run == KVB_NEG_INF ? 0.f : m_run;  // all -inf: P = 0, not NaN
#pragma unroll
        for (int c = 0; c < CPT; ++c) {
          s[c] = kvb::exp2_approx(fmaf(s[c], mul, -base));
          l_part += s[c];
        }
#pragma unroll
        for (int o = 1; o < 32; o *= 2) rescale |= __shfl_xor_sync(0xffffffffu, rescale, o);
        __syncwarp();  // the row's scores are all read before P overwrites them
        T* dst = p_s + srow * S::kPStride + spart * CPT;
#pragma unroll
        for (int c = 0; c < CPT; c += 8) kvb::store16(dst + c, kvb::pack<T>(s + c));
        if (spart == 0) alpha_s[srow] = alpha;
        if (lane == 0) flag_s[warp] = rescale;
      }
      __syncthreads();

      // 3. O = alpha O + P V. The softmax warps of row block rb are this warp's pair.
      int rescale = 0;
#pragma unroll
      for (int w = 0; w < S::kDSplit; ++w) rescale |= flag_s[rb * S::kDSplit + w];
      if (rescale) {
        // Rare: a row's max jumped. Scale the accumulator rows through the scratch tile.
#pragma unroll
        for (int n = 0; n < DH / 16; ++n) {
          wmma::store_matrix_sync(scratch, o_frag[n], 16, wmma::mem_row_major);
          __syncwarp();
          for (int e = lane; e < 256; e += 32) scratch[e] *= alpha_s[rb * 16 + e / 16];
          __syncwarp();
          wmma::load_matrix_sync(o_frag[n], scratch, 16, wmma::mem_row_major);
          __syncwarp();
        }
      }
      FragA p_frag[TILE / 16];
#pragma unroll
      for (int k = 0; k < TILE / 16; ++k) {
        kvb::load_shared(p_frag[k], p_s + rb * 16 * S::kPStride + k * 16, S::kPStride);
      }
#pragma unroll
      for (int n = 0; n < DH / 16; ++n) {
#pragma unroll
        for (int k = 0; k < TILE / 16; ++k) {
          FragV v_frag;
          kvb::load_shared(v_frag, v_s + k * 16 * KVS + col0 + n * 16, KVS);
          wmma::mma_sync(o_frag[n], p_frag[k], v_frag, o_frag[n]);
        }
      }
    }

    // Row sums, then normalize and store this warp's 16 x DH output block.
#pragma unroll
    for (int o = 1; o < TPR; o *= 2) l_part += __shfl_xor_sync(0xffffffffu, l_part, o);
    if (spart == 0) inv_l_s[srow] = l_part > 0.f ? 1.f / l_part : 0.f;  // no key: zeros
    __syncthreads();
    {
      const int r = rb * 16 + lane / 2;
      const int half = lane % 2;
      const int qi = q0 + r / heads_per_cta;
      const int hg = chunk * heads_per_cta + r % heads_per_cta;
      const bool valid = r < used_rows && qi < q_len && hg < group;
      T* dst = out + ((static_cast<long long>(q_begin) + qi) * num_heads + kv_head * group + hg) *
                         D + col0 + half * 8;
      const float inv = inv_l_s[r];
#pragma unroll
      for (int n = 0; n < DH / 16; ++n) {
        wmma::store_matrix_sync(scratch, o_frag[n], 16, wmma::mem_row_major);
        __syncwarp();
        if (valid) {
          float vals[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) vals[e] = scratch[(lane / 2) * 16 + half * 8 + e] * inv;
          kvb::store16(dst + n * 16, kvb::pack<T>(vals));
        }
        __syncwarp();
      }
    }
    __syncthreads();  // the next query tile restages Q and rewrites inv_l
  }
}
