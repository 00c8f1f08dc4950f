//! Adding, forking and reading sequences.

use super::KVCacheManager;
use crate::error::Result;

impl KVCacheManager {
    /// Register a sequence and its prompt; return how many leading tokens are cached.
    ///
    /// Hashes the prompt's full blocks once and probes the prefix cache without claiming
    /// anything. The hit is whole blocks and never the whole prompt: at most
    /// `floor((len - 1) / block_size)` blocks. Errors: `DuplicateSequence`.
    pub fn add_sequence(
        &mut self,
        seq_id: u64,
        token_ids: &[u32],
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<usize> {
        let _ = (seq_id, token_ids, cache_salt, lora_id);
        todo!()
    }

    /// Make `child_id` share every block and token of `parent_id` (refcounts + 1).
    ///
    /// Errors: `UnknownSequence(parent)`, `DuplicateSequence(child)`, `SequenceState` if
    /// the parent is swapped or has an allocated-but-uncommitted reservation.
    pub fn fork(&mut self, parent_id: u64, child_id: u64) -> Result<()> {
        let _ = (parent_id, child_id);
        todo!()
    }

    /// Whether the sequence is held.
    pub fn has_sequence(&self, seq_id: u64) -> bool {
        self.seqs.contains_key(&seq_id)
    }

    /// Known tokens: prompt plus committed sampled tokens.
    pub fn num_tokens(&self, seq_id: u64) -> Result<usize> {
        let _ = seq_id;
        todo!()
    }

    /// Tokens whose KV is in the cache; before the first `allocate_slots`, the cached
    /// prefix the sequence would claim now (can shrink through eviction, never grow).
    pub fn num_computed_tokens(&self, seq_id: u64) -> Result<usize> {
        let _ = seq_id;
        todo!()
    }

    /// Prompt tokens served from the prefix cache (claimed, or the probe before the claim).
    pub fn num_cached_tokens(&self, seq_id: u64) -> Result<usize> {
        let _ = seq_id;
        todo!()
    }

    /// The known tokens.
    pub fn token_ids(&self, seq_id: u64) -> Result<&[u32]> {
        let _ = seq_id;
        todo!()
    }

    /// Whether the sequence's blocks are in the CPU pool.
    pub fn is_swapped(&self, seq_id: u64) -> Result<bool> {
        let _ = seq_id;
        todo!()
    }

    /// `num_computed_tokens` for many sequences (for longest-prefix-match ordering).
    pub fn probe_prefixes(&self, seq_ids: &[u64]) -> Result<Vec<i64>> {
        let _ = seq_ids;
        todo!()
    }

    /// Ids of every held sequence (running and swapped), ascending.
    pub fn seq_ids(&self) -> Vec<u64> {
        todo!()
    }

    /// Number of sequences held.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// True when no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}
