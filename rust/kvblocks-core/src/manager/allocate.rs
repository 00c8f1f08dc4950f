//! Admission checks and slot reservation (prefix claim, copy-on-write, growth).

use super::KVCacheManager;
use crate::alloc_status::AllocStatus;
use crate::batch_arg::BatchArg;
use crate::error::Result;

impl KVCacheManager {
    /// Can the whole known sequence (plus lookahead) get blocks, keeping the watermark free?
    ///
    /// Only for sequences not yet allocated and not swapped (else `SequenceState`).
    pub fn can_allocate(&self, seq_id: u64, num_lookahead_tokens: usize) -> Result<AllocStatus> {
        let _ = (seq_id, num_lookahead_tokens);
        todo!()
    }

    /// Reserve KV slots for `computed + num_new_tokens + num_lookahead_tokens` tokens.
    ///
    /// Returns the block ids taken from the free pool (CoW replacements first, then
    /// appended blocks), possibly empty; `Ok(None)` with no state change when the pool is
    /// short. Errors: `UnknownSequence`, `SequenceState` (swapped), `InvalidArgument`
    /// (`computed + num_new_tokens > num_tokens`).
    pub fn allocate_slots(
        &mut self,
        seq_id: u64,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<Option<Vec<i32>>> {
        let _ = (seq_id, num_new_tokens, num_lookahead_tokens);
        todo!()
    }

    /// `allocate_slots` for many sequences; returns how many (a prefix) were served.
    ///
    /// Every entry is validated before anything changes; then sequences are served in
    /// order until the first one the pool cannot serve.
    pub fn allocate_slots_batch(
        &mut self,
        seq_ids: &[u64],
        num_new_tokens: BatchArg<'_>,
        num_lookahead_tokens: usize,
    ) -> Result<usize> {
        let _ = (seq_ids, num_new_tokens, num_lookahead_tokens);
        todo!()
    }

    /// Drain the queued copy-on-write `(src, dst)` block pairs.
    pub fn take_copy_on_writes(&mut self) -> Vec<[i64; 2]> {
        std::mem::take(&mut self.cow_queue)
    }
}
