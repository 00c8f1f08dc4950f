//! Pool state, events and statistics.

use super::KVCacheManager;
use crate::events::KvCacheEvent;
use crate::stats::Stats;

impl KVCacheManager {
    /// Free GPU blocks, cached-but-unreferenced included (at most `num_blocks - 1`).
    pub fn num_free_blocks(&self) -> usize {
        self.gpu.num_free()
    }

    /// Free CPU blocks.
    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }

    /// Fraction of usable GPU blocks referenced by some sequence.
    pub fn usage(&self) -> f64 {
        let usable = self.gpu.num_usable();
        (usable - self.gpu.num_free()) as f64 / usable as f64
    }

    /// GPU free-queue order, front (reused first) to back.
    pub fn free_block_ids(&self) -> Vec<u32> {
        self.gpu.free_queue().iter().collect()
    }

    /// CPU free-queue order, front to back.
    pub fn free_cpu_block_ids(&self) -> Vec<u32> {
        self.cpu.free_queue().iter().collect()
    }

    /// Reference count of a GPU block (0 for an out-of-range id).
    pub fn block_ref_count(&self, block_id: u32) -> u32 {
        self.gpu
            .ref_counts()
            .get(block_id as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Drain the KV cache events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        todo!()
    }
}
