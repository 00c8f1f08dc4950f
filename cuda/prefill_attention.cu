// Varlen paged prefill/extend attention on tensor cores, FlashAttention-2 style: raw
// mma.sync m16n8k16 and ldmatrix (cuda/warp_mma.cuh, the PTX ISA's fragment layouts), S and
// P in registers, K/V tiles loaded once per CTA with cp.async and shared by all its warps.
//
// Semantics are those of split_k_attention_kernel's prefill path (kvblocks.ops.reference):
// sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]; query i of a
// chunk of q_len sits at position seq_len - q_len + i and sees keys j with
// pos - window < j <= pos (causal offset), soft cap cap * tanh(s / cap) after scaling,
// GQA (a CTA serves query heads of one KV head), K/V paged in HND via block tables. A row
// without a visible key outputs zeros. Attention sinks (SINKS, sinks[h]) join each row's
// denominator at the final normalization. They are a template parameter, not a runtime
// branch, because at the register limit any use of the running max after the tile loop
// makes ptxas lay the loop out differently (kernel_model, fp16 head 128 on H100: 2,184 ->
// 2,268 warp-instructions per tile, 36.3% -> 34.4% of the peak; a sink entered as the rows'
// initial state instead: 32.5%): the instantiation without sinks is the kernel as it was.
//
// Work split. A CTA (4 warps) owns kRows = 64 x kMTiles query rows of one KV head (128;
// 64 at heads 112 and 256, where two row blocks' registers spill); row r
// is query q0 + r / heads_per_cta, head chunk * heads_per_cta + r % heads_per_cta (the host
// packs the heads of a GQA group into a CTA when chunks are short, so K/V are read once for
// them). Warp w owns the kMTiles row blocks of 16 rows [16 kMTiles w, 16 kMTiles (w + 1)):
// every key or value fragment it loads from shared memory feeds kMTiles MMAs (2 up to head
// 128: half the shared-memory reads per FLOP of one block per warp). Per K/V tile of kTile
// keys:
//   1. S = Q K^T into fp32 registers (C fragments): Q's A fragments by ldmatrix from the Q
//      tile (or, at head 112, kept in registers for the whole query tile), K's B fragments
//      by ldmatrix from the K rows (K^T needs no transpose: a K row is a B column).
//   2. Online softmax in registers: a lane holds rows g and g + 8 of each row block (the C
//      layout), two columns per 8-key block; the row max is reduced over the 4 lanes of a
//      row by two xor shuffles. Scale, soft cap and, on tiles crossing a row's
//      causal/window/length edge only (a CTA-uniform test), the mask. The running max is
//      rescaled lazily: P = 2^(s - m) is taken against an m that may lag the row's true max
//      by up to kRescaleLog2 (P < 2^8: exact enough in fp16/bf16, far from overflow); only
//      when a row's max grows further does that thread rescale its output registers and row
//      sum (the layout is known, so rows are rescaled one by one, in registers). The row sum
//      is a per-lane partial, reduced once at the end.
//   3. O += P V: P's A fragments are S's C fragments packed to 16 bits (two 8-key blocks
//      make one 16-key k-step), V's B fragments by ldmatrix.trans from the V rows.
// Loads (cp.async, 16 bytes a piece, into K and V buffers shared by the warps: two each,
// one at head 256): the values of tile j + 1 load while tile j's S and softmax run, the keys
// of tile j + 2 while its P V runs (with one buffer each: the values of j, the keys of
// j + 1), so each step waits (cp.async.wait_group, one CTA barrier) only for the tile it
// consumes: two barriers per tile. A tile's block ids are read a tile ahead, one per key
// row, into a small shared ring. At the end the output is normalized in registers, staged as
// T over the Q tile and written with 16-byte stores.
//
// Grid: x = num_kv_heads x head_chunks, y = sequence, z = query tile in reverse order: the
// block scheduler issues z slowest, so the last (longest, causal) query tiles of every
// sequence start first and the short ones fill the tail. A CTA serves tiles qt, qt + Z,
// ... while they start below q_len (uniform over the CTA: barriers stay convergent), so the
// host's max_query_len is only a hint and a grid capped at 65535 tiles still writes every row.
// Causal: keys past the CTA's last query are never loaded (the tile loop stops there).
//
// Bounds safety as in split_k_attention.cu: block ids outside [0, num_blocks) read block 0,
// no position past max_blocks * block_size is read, query_start_loc is clamped to
// [0, num_tokens]. block_size must be a power of two (the front-ends allow 8/16/32); the
// kernel turns the token-to-block division into a shift and mask.
#include "cp_async.cuh"
#include "kv_common.cuh"
#include "warp_mma.cuh"

namespace kvb {

template <typename T, int D>
struct PrefillShape {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // Row blocks of 16 per warp: 2 up to head 128 (O: 2 x D / 2 fp32 registers per lane),
  // 1 at head 256 (its O alone is 128 registers) and at head 112 (where 2 spill).
  static constexpr int kMTiles = D > 128 || D == 112 ? 1 : 2;
  static constexpr int kRows = 16 * kMTiles * kWarps;
  // Keys per K/V tile: 64 at head 64 (S: 2 x 32 registers per lane), 32 above, where O's
  // registers leave no room for 64 (ptxas spills).
  static constexpr int kTile = D > 64 ? 32 : 64;
  static constexpr int kNTiles = kTile / 8;  // 8-key column blocks of S
  static constexpr int kKSteps = D / 16;     // 16-column steps of Q K^T
  static constexpr int kDTiles = D / 8;      // 8-column blocks of O
  // Q's A fragments stay in registers for the whole query tile where one row block's fit
  // in 32 (head 112); elsewhere they are read from the Q tile again for every K/V tile (at
  // head 64 the 32 registers of two row blocks made ptxas spill).
  static constexpr bool kQInRegs = kMTiles == 1 && kKSteps * 4 <= 32;
  static constexpr int kPieces = D / 8;  // 16-byte pieces of a row
  // Shared rows are padded by 16 bytes: the 8 rows one ldmatrix reads (and the 8 row
  // starts of a cp.async batch) fall in 8 different bank groups.
  static constexpr int kLd = D + 8;
  // cp.async per thread per tile (the last one guarded where the pieces do not divide
  // evenly: head 112).
  static constexpr int kKvCopies = (kTile * kPieces + kThreads - 1) / kThreads;
  static constexpr bool kEvenCopies = kTile * kPieces % kThreads == 0;
  static constexpr int kTileBytes = kTile * kLd * 2;
  // K and V buffers each: 2 (a tile's keys load two tiles ahead, its values one) where the
  // layout keeps 2 CTAs on an A100's 164 KiB (<= 80 KiB), else 1 (keys one tile ahead,
  // values while the tile's scores are computed: head 256).
  static constexpr int kStages =
      (kRows * kLd * 2 + 4 * kTileBytes + 3 * kTile * 4 <= 80 * 1024) ? 2 : 1;
  // Layout (bytes): Q tile (then the output tile) | K tiles | V tiles | block id of every
  // key row of the kStages + 1 tiles in flight.
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kRows * kLd * 2;
  static constexpr int kVOffset = kKOffset + kStages * kTileBytes;
  static constexpr int kIdsOffset = kVOffset + kStages * kTileBytes;
  static constexpr int kIdSlots = kStages + 1;
  static constexpr int kSmemBytes = kIdsOffset + kIdSlots * kTile * 4;
  static_assert(kTile <= kThreads, "one block-id lookup per thread and tile");
  // CTAs per SM the register budget is sized for (__launch_bounds__).
  static constexpr int kMinCtas = 2;

  static_assert(sizeof(T) == 2, "the tensor-core kernel takes fp16/bf16 (fp32 keeps the old one)");
  static_assert(D % 16 == 0, "head size: whole 16-column MMA steps");
  static_assert(kNTiles % 2 == 0, "P's k-steps pair 8-key blocks");
  static_assert((kLd * 2) % 16 == 0, "ldmatrix rows must be 16-byte aligned");
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

}  // namespace kvb

template <typename T, int D, bool SINKS = false>
// 4 warps, 2 CTAs per SM: up to 255 registers for the output and score fragments (no
// spills, checked by the NVRTC tests).
__global__ void __launch_bounds__((kvb::PrefillShape<T, D>::kThreads),
                                  (kvb::PrefillShape<T, D>::kMinCtas))
    prefill_attention_kernel(
    T* __restrict__ out,                      // [tokens, num_heads, D]
    const T* __restrict__ query,              // [tokens, num_heads, D]
    const T* __restrict__ key_cache,          // [num_blocks, num_kv_heads, block_size, D]
    const T* __restrict__ value_cache,        // same
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    int num_tokens, int num_heads, int num_kv_heads, int block_size, int max_blocks,
    int num_blocks, int heads_per_cta, float scale, float soft_cap, int sliding_window,
    const float* __restrict__ sinks) {  // [num_heads] attention-sink logits (SINKS only)
  using S = kvb::PrefillShape<T, D>;
  constexpr int NT = S::kThreads;
  constexpr int ROWS = S::kRows;
  constexpr int TILE = S::kTile;
  constexpr int MT = S::kMTiles;
  constexpr int NTL = S::kNTiles;
  constexpr int LD = S::kLd;
  constexpr int PIECES = S::kPieces;
  constexpr int COPIES = S::kKvCopies;

  KVB_DYNAMIC_SMEM(smem);
  T* q_s = reinterpret_cast<T*>(smem + S::kQOffset);
  T* k_s = reinterpret_cast<T*>(smem + S::kKOffset);
  T* v_s = reinterpret_cast<T*>(smem + S::kVOffset);
  int* ids_s = reinterpret_cast<int*>(smem + S::kIdsOffset);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // the C/A fragment row of this lane (and g + 8)
  const int tq = lane % 4;  // its column pair: 2 tq, 2 tq + 1
  const int row0 = warp * 16 * MT;  // first row of this warp's row blocks

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
  // Elements per cache block (all KV heads): far below 2^31, so a block's offset is one
  // 32 x 32 -> 64-bit multiply.
  const int block_stride = num_kv_heads * block_size * D;
  const T* k_head = key_cache + static_cast<long long>(kv_head) * block_size * D;
  const T* v_head = value_cache + static_cast<long long>(kv_head) * block_size * D;

  // Base-2 logits: s * scale * log2(e), or cap * log2(e) * tanh(s * scale / cap). The
  // plain scale is folded into the exponent's FFMA: positive, so the max commutes with it.
  const bool capped = soft_cap > 0.f;
  float mul = capped ? 1.f : scale * kvb::kLog2e;
  // A soft cap, or a zero or negative scale, transforms the scores before the max; a
  // positive scale is applied in the exponent only.
  const bool transform = capped || !(mul > 0.f);
  const float pre = capped ? 1.f : mul;
  if (transform) mul = 1.f;
  const float cap_inner = capped ? scale / soft_cap : 0.f;
  const float cap_outer = soft_cap * kvb::kLog2e;

  for (int qt = gridDim.z - 1 - blockIdx.z; qt * queries_per_cta < q_len; qt += gridDim.z) {
    const int q0 = qt * queries_per_cta;
    const int q_rows = min(queries_per_cta, q_len - q0);
    // Keys the CTA needs: up to its last query, from the first query's window start.
    const int kv_hi = min(min(seq_len, first_pos + q0 + q_rows), kv_cap);
    const int kv_lo = sliding_window > 0 ? max(0, first_pos + q0 - sliding_window + 1) : 0;
    // Tiles inside [full_lo, full_hi) are visible to every row: no per-score mask.
    const int full_hi = min(first_pos + q0 + 1, kv_hi);
    const int full_lo = sliding_window > 0 ? first_pos + q0 + q_rows - sliding_window : kv_lo;

    // Position of this lane's rows (g and g + 8 of each row block): they see keys
    // (pos - window, pos]; -1 (no key) for padding rows and heads past the group.
    int row_pos[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + mt * 16 + g + 8 * h;
        const int qi = q0 + r / heads_per_cta;
        const int hg = chunk * heads_per_cta + r % heads_per_cta;
        const bool valid = r < used_rows && qi < q_len && hg < group;
        row_pos[mt][h] = valid ? first_pos + qi : -1;
      }
    }

    // Stage the Q rows (zeros for padding rows).
    for (int i = tid; i < ROWS * PIECES; i += NT) {
      const int r = i / PIECES;
      const int c = i % PIECES;
      const int qi = q0 + r / heads_per_cta;
      const int hg = chunk * heads_per_cta + r % heads_per_cta;
      kvb::Vec16 val = kvb::zero16();
      if (r < used_rows && qi < q_len && hg < group) {
        const long long tok = q_begin + qi;
        val = kvb::load16(query + (tok * num_heads + kv_head * group + hg) * D + c * 8);
      }
      kvb::store16(q_s + r * LD + c * 8, val);
    }

    float o[MT][S::kDTiles][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < S::kDTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
      }
    }
    float m_run[MT][2], l_part[MT][2];  // per row: the max P is taken against, sum share
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      m_run[mt][0] = m_run[mt][1] = KVB_NEG_INF;
      l_part[mt][0] = l_part[mt][1] = 0.f;
    }
    __syncthreads();  // Q staged (and the last query tile's output read)
    // Q's A fragments for the whole query tile, where they fit in registers.
    unsigned qf[S::kQInRegs ? MT : 1][S::kQInRegs ? S::kKSteps : 1][4];
    if constexpr (S::kQInRegs) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int kk = 0; kk < S::kKSteps; ++kk) {
          kvb::ldmatrix_x4<false>(qf[mt][kk], q_s + (row0 + mt * 16 + lane % 16) * LD +
                                                  kk * 16 + (lane / 16) * 8);
        }
      }
    }

    // Key row tid of a tile: its block id (rows past kv_hi read the last key's block:
    // finite cache data, masked like every key past a row's end). Thread t < TILE reads it
    // a tile ahead into ids_s, from where the copies of both K and V take it.
    auto lookup = [&](int t0) {
      const int j = min(t0 + tid, kv_hi - 1);
      const int b = table[j >> shift];
      return b < 0 || b >= num_blocks ? 0 : b;  // never read outside the cache
    };
    // cp.async of a tile's K (or V) rows. Where a row's 16-byte pieces divide evenly among
    // NT / TILE threads, thread tid copies pieces tid % TPR + TPR i of row tid / TPR (one
    // block id and base address per thread; the TPR threads of a row read 16 TPR contiguous
    // bytes per copy); else piece tid + NT i = (row, column) of the tile.
    constexpr int TPR = NT / TILE;
    auto issue = [&](T* buf, int t0, const int* ids, const T* head) {
      if constexpr (NT % TILE == 0 && PIECES % TPR == 0) {
        const int row = tid / TPR;
        const int j = min(t0 + row, kv_hi - 1);
        const T* src = head + static_cast<long long>(ids[row]) * block_stride + (j & in_block) * D;
        T* dst = buf + row * LD;
#pragma unroll
        for (int i = 0; i < PIECES / TPR; ++i) {
          const int col = (tid % TPR + TPR * i) * 8;
          kvb::cp_async16(dst + col, src + col, 16);
        }
        return;
      }
#pragma unroll
      for (int i = 0; i < COPIES; ++i) {
        const int p = tid + NT * i;
        if (S::kEvenCopies || p < TILE * PIECES) {
          const int row = p / PIECES;
          const int col = (p % PIECES) * 8;
          const int j = min(t0 + row, kv_hi - 1);
          const T* src = head + static_cast<long long>(ids[row]) * block_stride +
                         ((j & in_block) * D + col);
          kvb::cp_async16(buf + row * LD + col, src, 16);
        }
      }
    };

    // Tile j (keys kv_lo + j TILE ..) lives in K/V buffers j % STAGES and its block ids in
    // slot j % (STAGES + 1). Per tile j: at the first barrier its keys have landed and the
    // values of tile j + STAGES - 1 are issued; at the second its values have landed and
    // the keys of tile j + STAGES are issued. Commit order: keys of 0, (values of 0, keys
    // of 1), then one group per issue, so each wait leaves the 2 (STAGES - 1) newest groups
    // in flight.
    constexpr int STAGES = S::kStages;
    constexpr int kPending = 2 * (STAGES - 1);
    const int tiles = kv_lo < kv_hi ? (kv_hi - kv_lo + TILE - 1) / TILE : 0;
    auto kbuf = [&](int j) { return k_s + (j % STAGES) * (TILE * LD); };
    auto vbuf = [&](int j) { return v_s + (j % STAGES) * (TILE * LD); };
    auto ids_of = [&](int j) { return ids_s + (j % S::kIdSlots) * TILE; };
    if (tiles > 0) {
#pragma unroll
      for (int j = 0; j < STAGES; ++j) {
        if (tid < TILE) ids_of(j)[tid] = lookup(kv_lo + j * TILE);
      }
      __syncthreads();
      issue(kbuf(0), kv_lo, ids_of(0), k_head);
      kvb::cp_async_commit();
      if constexpr (STAGES == 2) {
        issue(vbuf(0), kv_lo, ids_of(0), v_head);
        kvb::cp_async_commit();
        if (tiles > 1) issue(kbuf(1), kv_lo + TILE, ids_of(1), k_head);
        kvb::cp_async_commit();
      }
    }
    for (int jt = 0; jt < tiles; ++jt) {
      const int t0 = kv_lo + jt * TILE;
      const T* k_tile = kbuf(jt);
      const T* v_tile = vbuf(jt);
      kvb::cp_async_wait<kPending>();  // this tile's keys
      __syncthreads();  // every thread's keys landed; the tile before is done (buffers free)
      {
        const int jv = jt + STAGES - 1;  // values: this tile's, or the next one's
        if (jv < tiles) issue(vbuf(jv), kv_lo + jv * TILE, ids_of(jv), v_head);
        kvb::cp_async_commit();
      }
      // Block ids of the tile whose keys load at the second barrier: read now, stored
      // after S (the load's latency hides behind it).
      const int jk = jt + STAGES;
      const int next_id = jk < tiles && tid < TILE ? lookup(kv_lo + jk * TILE) : 0;

      // 1. S = Q K^T, fp32, in registers.
      float s[MT][NTL][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < NTL; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
        }
      }
#pragma unroll
      for (int kk = 0; kk < S::kKSteps; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (S::kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
          } else {
            kvb::ldmatrix_x4<false>(
                a[mt], q_s + (row0 + mt * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
          }
        }
#pragma unroll
        for (int np = 0; np < NTL / 2; ++np) {
          // Keys 16 np .. +15, columns 16 kk .. +15: B fragments of two 8-key blocks.
          unsigned b[4];
          kvb::ldmatrix_x4<false>(b, k_tile + (np * 16 + (lane / 16) * 8 + lane % 8) * LD +
                                         kk * 16 + ((lane / 8) % 2) * 8);
          const unsigned b0[2] = {b[0], b[1]};
          const unsigned b1[2] = {b[2], b[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            kvb::mma_16816<T>(s[mt][2 * np], a[mt], b0, s[mt][2 * np]);
            kvb::mma_16816<T>(s[mt][2 * np + 1], a[mt], b1, s[mt][2 * np + 1]);
          }
        }
      }

      // 2. Online softmax on this lane's rows.
      if (transform) {  // uniform over the CTA; not taken in the plain case
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int n = 0; n < NTL; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float v = s[mt][n][e] * pre;
              s[mt][n][e] = capped ? cap_outer * tanhf(v * cap_inner) : v;
            }
          }
        }
      }
      const bool mask_tile = t0 + TILE > full_hi || t0 < full_lo;  // uniform over the CTA
      if (mask_tile) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int hi = min(row_pos[mt][h] + 1, kv_cap);  // 0 for an invalid row: no key
            const int lo = sliding_window > 0 ? row_pos[mt][h] + 1 - sliding_window : 0;
#pragma unroll
            for (int n = 0; n < NTL; ++n) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int j = t0 + n * 8 + 2 * tq + e;
                const bool ok = j >= lo && j < hi;
                s[mt][n][2 * h + e] = ok ? s[mt][n][2 * h + e] : KVB_NEG_INF;
              }
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = KVB_NEG_INF;
#pragma unroll
          for (int n = 0; n < NTL; ++n) {
            mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          mx *= mul;
          if (m_run[mt][h] == KVB_NEG_INF) {
            m_run[mt][h] = mx;  // first visible tile (or still none): O and l are zero
          } else if (mx > m_run[mt][h] + kvb::kRescaleLog2) {
            // Rare: the row's max jumped. Rescale its output registers and sum share.
            const float alpha = kvb::exp2_approx(m_run[mt][h] - mx);
            l_part[mt][h] *= alpha;
#pragma unroll
            for (int n = 0; n < S::kDTiles; ++n) {
              o[mt][n][2 * h] *= alpha;
              o[mt][n][2 * h + 1] *= alpha;
            }
            m_run[mt][h] = mx;
          }
          const float base = m_run[mt][h] == KVB_NEG_INF ? 0.f : m_run[mt][h];  // no NaN
#pragma unroll
          for (int n = 0; n < NTL; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = kvb::exp2_approx(fmaf(s[mt][n][2 * h + e], mul, -base));
              s[mt][n][2 * h + e] = p;
              l_part[mt][h] += p;
            }
          }
        }
      }

      if (tid < TILE) ids_of(jk)[tid] = next_id;
      kvb::cp_async_wait<kPending>();  // this tile's values
      __syncthreads();  // every thread's values landed; every warp is done with the keys
      if (jk < tiles) issue(kbuf(jk), kv_lo + jk * TILE, ids_of(jk), k_head);
      kvb::cp_async_commit();

      // 3. O += P V: P's A fragments straight from S's registers.
#pragma unroll
      for (int ks = 0; ks < NTL / 2; ++ks) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = kvb::pack2<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
          pa[mt][1] = kvb::pack2<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
          pa[mt][2] = kvb::pack2<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
          pa[mt][3] = kvb::pack2<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < S::kDTiles / 2; ++dp) {
          // Keys 16 ks .. +15 (rows of V), columns 16 dp .. +15: transposed B fragments.
          unsigned b[4];
          kvb::ldmatrix_x4<true>(b, v_tile + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD +
                                        dp * 16 + (lane / 16) * 8);
          const unsigned b0[2] = {b[0], b[1]};
          const unsigned b1[2] = {b[2], b[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            kvb::mma_16816<T>(o[mt][2 * dp], pa[mt], b0, o[mt][2 * dp]);
            kvb::mma_16816<T>(o[mt][2 * dp + 1], pa[mt], b1, o[mt][2 * dp + 1]);
          }
        }
        if constexpr (S::kDTiles % 2) {  // head 80 / 112: a last 8-column block
          unsigned b[2];
          kvb::ldmatrix_x2<true>(b, v_tile + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD +
                                        (S::kDTiles - 1) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            kvb::mma_16816<T>(o[mt][S::kDTiles - 1], pa[mt], b, o[mt][S::kDTiles - 1]);
          }
        }
      }
    }

    // Row sums over the 4 lanes of a row, then O / l as T over the Q tile (every warp is
    // done with Q: the barrier below), then 16-byte stores of the valid rows.
    kvb::cp_async_wait<0>();  // (only empty groups are left)
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = l_part[mt][h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros
        if constexpr (SINKS) {
          if (sinks != nullptr && row_pos[mt][h] >= 0 && l > 0.f) {
            // The sink joins the denominator: l + 2^(sink - m), against the row's m (an
            // overflow gives inv = 0, the limit of a dominant sink).
            const int r = row0 + mt * 16 + g + 8 * h;
            const float sink =
                sinks[kv_head * group + chunk * heads_per_cta + r % heads_per_cta];
            inv = 1.f / (l + exp2f(sink * kvb::kLog2e - m_run[mt][h]));
          }
        }
        T* dst = q_s + (row0 + mt * 16 + g + 8 * h) * LD + 2 * tq;
#pragma unroll
        for (int n = 0; n < S::kDTiles; ++n) {
          const unsigned packed = kvb::pack2<T>(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
          *reinterpret_cast<unsigned*>(dst + n * 8) = packed;
        }
      }
    }
    __syncthreads();
    for (int i = tid; i < ROWS * PIECES; i += NT) {
      const int r = i / PIECES;
      const int c = i % PIECES;
      const int qi = q0 + r / heads_per_cta;
      const int hg = chunk * heads_per_cta + r % heads_per_cta;
      if (r < used_rows && qi < q_len && hg < group) {
        const long long tok = q_begin + qi;
        kvb::store16(out + (tok * num_heads + kv_head * group + hg) * D + c * 8,
                     kvb::load16(q_s + r * LD + c * 8));
      }
    }
    __syncthreads();  // the next query tile restages Q over the output
  }
}
