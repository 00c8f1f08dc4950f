//! Swapping sequences between the GPU and CPU pools.

use super::KVCacheManager;
use crate::error::Result;

impl KVCacheManager {
    /// Whether the CPU pool can take the sequences' distinct GPU blocks.
    pub fn can_swap_out(&self, seq_ids: &[u64]) -> Result<bool> {
        let _ = seq_ids;
        todo!()
    }

    /// Whether the GPU pool can take the swapped sequences' distinct blocks, keeping
    /// the watermark free.
    pub fn can_swap_in(&self, seq_ids: &[u64]) -> Result<bool> {
        let _ = seq_ids;
        todo!()
    }

    /// Move the sequences' blocks to the CPU pool; returns `(gpu, cpu)` rows.
    ///
    /// Errors: `OutOfBlocks` if the CPU pool is short; `SequenceState` if a sequence is
    /// swapped or has a pending reservation.
    pub fn swap_out(&mut self, seq_ids: &[u64]) -> Result<Vec<[i64; 2]>> {
        let _ = seq_ids;
        todo!()
    }

    /// Move swapped sequences back; returns `(cpu, gpu)` rows. `OutOfBlocks` if short.
    pub fn swap_in(&mut self, seq_ids: &[u64]) -> Result<Vec<[i64; 2]>> {
        let _ = seq_ids;
        todo!()
    }
}
