//! Committing computed tokens: prefix-cache registration and sliding-window release.

use super::KVCacheManager;
use crate::batch_arg::BatchArg;
use crate::error::Result;

impl KVCacheManager {
    /// The model wrote KV for `num_new_computed_tokens` more tokens; append sampled tokens.
    ///
    /// The computed count may not exceed the reserved slots nor the tokens known before
    /// the call (`InvalidArgument`). Full blocks enter the prefix cache; with a sliding
    /// window, blocks wholly outside it are released. Clears the pending reservation.
    pub fn commit(
        &mut self,
        seq_id: u64,
        num_new_computed_tokens: usize,
        new_token_ids: &[u32],
    ) -> Result<()> {
        let _ = (seq_id, num_new_computed_tokens, new_token_ids);
        todo!()
    }

    /// `commit` for many sequences, at most one new token each (`< 0` means none).
    ///
    /// All-or-nothing: every entry is validated before any sequence changes.
    pub fn commit_batch(
        &mut self,
        seq_ids: &[u64],
        num_new_computed_tokens: BatchArg<'_>,
        new_token_ids: Option<BatchArg<'_>>,
    ) -> Result<()> {
        let _ = (seq_ids, num_new_computed_tokens, new_token_ids);
        todo!()
    }
}
