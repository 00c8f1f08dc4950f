//! Releasing sequences and the prefix cache.

use super::KVCacheManager;
use crate::error::Result;

impl KVCacheManager {
    /// Release the sequence's blocks (last block first) and forget it.
    ///
    /// Unhashed blocks go to the front of the free queue, cached blocks to the back.
    /// Works on swapped sequences (their CPU blocks go to the CPU queue's front).
    pub fn free(&mut self, seq_id: u64) -> Result<()> {
        let _ = seq_id;
        todo!()
    }

    /// Forget every cached hash; only when no GPU block is referenced. Returns success.
    pub fn reset_prefix_cache(&mut self) -> bool {
        todo!()
    }
}
