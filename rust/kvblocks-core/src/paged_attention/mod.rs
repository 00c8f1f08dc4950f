//! Decode attention over a paged KV cache on the CPU, fp32: the CPU engine's decode kernel.
//!
//! One query token per sequence, at position `seq_len - 1`, attends to the keys its
//! window lets it see, read in place through the block table: no gathered copy of the
//! context, no padding between sequences of different lengths. The semantics are those
//! of the torch reference (`kvblocks.ops.reference`, which the Python tests compare
//! against):
//!
//! ```text
//! s_j = scale * <q, k_j>                  for j in [max(0, len - window), len)
//! s_j = cap * tanh(s_j / cap)             with a soft-cap
//! m   = max(max_j s_j, sink)              with a sink (a logit per query head)
//! out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m))
//! ```
//!
//! The layout is the one `kvblocks.ops` allocates: caches `[num_blocks, num_kv_heads,
//! block_size, head_size]`, queries and outputs `[num_seqs, num_heads, head_size]`,
//! block tables `[num_seqs, max_blocks]` (int32), lengths `[num_seqs]` (int32); query
//! head `h` reads KV head `h / (num_heads / num_kv_heads)`. A length of 0 (batch
//! padding) yields a zero row. Work items are (sequence, KV head) pairs: the query heads
//! of one KV head share every key and value row read, and items are split over
//! `threads` scoped threads by their number of keys.
//!
//! The module's parts: `plan` checks a call and splits its work, `runs` walks an item's
//! keys through the block table (the runs of cache rows, their prefetch, the per-thread
//! scratch), `attend` is the attention of one item, and `vector_math` the dot products,
//! sums and `exp` it is made of.

mod attend;
mod plan;
mod runs;
#[cfg(test)]
mod tests;
mod vector_math;

use crate::error::Result;
use plan::{split_by_work, Plan};
use runs::Scratch;
pub use vector_math::exp_in_place;

/// The attention shape of a call (the cache length gives the number of blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_size: usize,
    /// Tokens per cache block.
    pub block_size: usize,
}

/// What a layer chooses: scale, window, soft-cap and sinks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams<'a> {
    /// Multiplies every dot product (finite).
    pub scale: f32,
    /// Keys `j > pos - window` only (at least 1).
    pub sliding_window: Option<usize>,
    /// `cap * tanh(s / cap)` after scaling (finite, positive).
    pub soft_cap: Option<f32>,
    /// One logit per query head in the softmax denominator (`num_heads` entries).
    pub sinks: Option<&'a [f32]>,
}

/// The tensors of a decode batch, row-major (see the module docs for their shapes).
#[derive(Debug, Clone, Copy)]
pub struct DecodeBatch<'a> {
    /// `[num_seqs, num_heads, head_size]`.
    pub query: &'a [f32],
    /// `[num_blocks, num_kv_heads, block_size, head_size]`.
    pub key_cache: &'a [f32],
    /// Same shape as `key_cache`.
    pub value_cache: &'a [f32],
    /// `[num_seqs, max_blocks]` block ids; only the first `ceil(len / block_size)` of a
    /// row are read.
    pub block_tables: &'a [i32],
    /// `[num_seqs]` context lengths, the query's own token included.
    pub seq_lens: &'a [i32],
}

/// Decode attention of every sequence of `batch` into `out` (`[num_seqs, num_heads,
/// head_size]`).
///
/// Every argument is checked before anything is written: slice lengths against the
/// shape, each length against the table's capacity, each block id it reads against the
/// cache, the parameters' ranges. `threads` (at least 1) scoped threads share the work.
pub fn paged_decode_attention(
    out: &mut [f32],
    batch: &DecodeBatch<'_>,
    shape: PagedShape,
    params: &AttentionParams<'_>,
    threads: usize,
) -> Result<()> {
    let plan = Plan::new(out.len(), batch, shape, params)?;
    let row = plan.group * shape.head_size;
    let items = batch.seq_lens.len() * shape.num_kv_heads;
    let ranges = split_by_work(&plan, items, threads.max(1));
    std::thread::scope(|scope| {
        let mut rest = &mut out[..];
        let mut handles = Vec::new();
        for (index, &(start, end)) in ranges.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut((end - start) * row);
            rest = tail;
            let plan = &plan;
            let mut work = move || {
                let mut scratch = Scratch::default();
                for (item, chunk) in (start..end).zip(mine.chunks_exact_mut(row)) {
                    plan.attend(item, chunk, &mut scratch);
                }
            };
            if index + 1 == ranges.len() {
                work(); // the calling thread takes the last range
            } else {
                handles.push(scope.spawn(work));
            }
        }
        for handle in handles {
            // A panic in a worker is a bug in this module; re-raise it on this thread.
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    Ok(())
}
