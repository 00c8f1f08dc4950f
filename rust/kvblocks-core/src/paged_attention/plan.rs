//! A validated call ([`Plan`]) and the split of its work over threads.

use super::{AttentionParams, DecodeBatch, PagedShape};
use crate::error::{KvError, Result};

/// A validated call: the batch, its derived sizes and the layer's parameters.
pub(super) struct Plan<'a> {
    pub(super) batch: DecodeBatch<'a>,
    pub(super) shape: PagedShape,
    pub(super) params: AttentionParams<'a>,
    pub(super) group: usize,
    pub(super) max_blocks: usize,
    /// The running CPU has AVX2: [`Plan::attend`] runs its 256-bit build.
    pub(super) avx2: bool,
}

fn invalid(message: String) -> KvError {
    KvError::InvalidArgument(message)
}

impl<'a> Plan<'a> {
    pub(super) fn new(
        out_len: usize,
        batch: &DecodeBatch<'a>,
        shape: PagedShape,
        params: &AttentionParams<'a>,
    ) -> Result<Self> {
        let PagedShape {
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
        } = shape;
        if num_heads == 0 || num_kv_heads == 0 || head_size == 0 || block_size == 0 {
            return Err(invalid(format!(
                "every size must be positive, got {shape:?}"
            )));
        }
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(format!(
                "num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )));
        }
        let block_len = num_kv_heads * block_size * head_size;
        let cache_len = batch.key_cache.len();
        if cache_len % block_len != 0 || batch.value_cache.len() != cache_len {
            return Err(invalid(format!(
                "caches of {cache_len} and {} elements are not whole blocks of {block_len}",
                batch.value_cache.len()
            )));
        }
        let num_blocks = cache_len / block_len;
        let num_seqs = batch.seq_lens.len();
        let rows = num_seqs * num_heads * head_size;
        if batch.query.len() != rows || out_len != rows {
            return Err(invalid(format!(
                "query ({}) and out ({out_len}) must hold {num_seqs} x {num_heads} x \
                 {head_size} elements",
                batch.query.len()
            )));
        }
        let max_blocks = match batch.block_tables.len().checked_div(num_seqs) {
            Some(cols) if cols * num_seqs == batch.block_tables.len() => cols,
            None => 0,
            _ => {
                return Err(invalid(format!(
                    "block_tables of {} entries is not {num_seqs} rows",
                    batch.block_tables.len()
                )))
            }
        };
        for (s, &len) in batch.seq_lens.iter().enumerate() {
            let capacity = max_blocks * block_size;
            let len = usize::try_from(len)
                .map_err(|_| invalid(format!("seq_lens[{s}] = {len} is negative")))?;
            if len > capacity {
                return Err(invalid(format!(
                    "seq_lens[{s}] = {len} exceeds the block table capacity {capacity}"
                )));
            }
            let row = &batch.block_tables[s * max_blocks..][..len.div_ceil(block_size)];
            if let Some(&bad) = row.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
                return Err(invalid(format!(
                    "block_tables[{s}] holds block id {bad}, outside [0, {num_blocks})"
                )));
            }
        }
        if !params.scale.is_finite() {
            return Err(invalid(format!(
                "scale must be finite, got {}",
                params.scale
            )));
        }
        if params.sliding_window == Some(0) {
            return Err(invalid("sliding_window must be at least 1".to_owned()));
        }
        if let Some(cap) = params.soft_cap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(invalid(format!(
                    "soft_cap must be finite and positive, got {cap}"
                )));
            }
        }
        if let Some(sinks) = params.sinks {
            if sinks.len() != num_heads {
                return Err(invalid(format!(
                    "sinks has {} entries, expected one per query head ({num_heads})",
                    sinks.len()
                )));
            }
        }
        Ok(Self {
            batch: *batch,
            shape,
            params: *params,
            group: num_heads / num_kv_heads,
            max_blocks,
            avx2: has_avx2(),
        })
    }

    /// The keys item `item` = (sequence, KV head) reads: `[first, len)`.
    pub(super) fn key_range(&self, item: usize) -> (usize, usize) {
        let len = self.batch.seq_lens[item / self.shape.num_kv_heads] as usize;
        let first = self
            .params
            .sliding_window
            .map_or(0, |w| len.saturating_sub(w));
        (first, len)
    }
}

/// Whether the running CPU has AVX2 (checked once per call).
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Contiguous item ranges, one per thread, of about equal key counts.
pub(super) fn split_by_work(plan: &Plan<'_>, items: usize, threads: usize) -> Vec<(usize, usize)> {
    let weight = |item: usize| {
        let (first, len) = plan.key_range(item);
        len - first + 1 // +1: an item costs something even with no keys
    };
    let total: usize = (0..items).map(weight).sum();
    let mut ranges = Vec::with_capacity(threads);
    let (mut start, mut done) = (0, 0);
    for t in 1..=threads {
        let target = total * t / threads;
        let mut end = start;
        while end < items && (done < target || t == threads) {
            done += weight(end);
            end += 1;
        }
        if end > start {
            ranges.push((start, end));
        }
        start = end;
    }
    if ranges.is_empty() {
        ranges.push((0, 0));
    }
    ranges
}
