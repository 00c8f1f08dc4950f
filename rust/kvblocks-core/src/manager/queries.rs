//! Pool state, events and statistics.

use super::KVCacheManager;
use crate::events::KvCacheEvent;
use crate::stats::Stats;

impl KVCacheManager {
    /// Free GPU blocks, cached-but-unreferenced included (at most `num_blocks - 1`).
    pub fn num_free_blocks(&self) -> usize {
        self.pools.gpu.num_free()
    }

    /// Free CPU blocks.
    pub fn num_free_cpu_blocks(&self) -> usize {
        self.pools.cpu.num_free()
    }

    /// Fraction of usable GPU blocks referenced by some sequence.
    pub fn usage(&self) -> f64 {
        let usable = self.pools.gpu.num_usable();
        (usable - self.pools.gpu.num_free()) as f64 / usable as f64
    }

    /// GPU free-queue order, front (reused first) to back.
    pub fn free_block_ids(&self) -> Vec<u32> {
        self.pools.gpu.free_queue().iter().collect()
    }

    /// CPU free-queue order, front to back.
    pub fn free_cpu_block_ids(&self) -> Vec<u32> {
        self.pools.cpu.free_queue().iter().collect()
    }

    /// Reference count of a GPU block (0 for an out-of-range id).
    pub fn block_ref_count(&self, block_id: u32) -> u32 {
        self.pools
            .gpu
            .ref_counts()
            .get(block_id as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Drain the KV cache events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        let mut events = std::mem::take(&mut self.pools.events);
        // The pools record structure only; each event's spec is its group's.
        for event in &mut events {
            if let KvCacheEvent::BlockStored(stored) = event {
                if let Some(spec) = self.pools.groups.get(stored.group_idx as usize) {
                    stored.kv_cache_spec = *spec;
                }
            }
        }
        events
    }

    /// GPU blocks referenced by the tables of each group (a block shared by several
    /// sequences counted once): one pass over the resident tables, for `stats` only.
    fn used_blocks_per_group(&self) -> Vec<usize> {
        let mut seen = vec![false; self.pools.gpu.num_blocks()];
        let mut used = vec![0; self.pools.groups.len()];
        for seq in self.slots.iter().filter(|s| !s.swapped) {
            for (g, t) in seq.tables.iter().enumerate() {
                for &b in &t.blocks[t.num_released..] {
                    if !std::mem::replace(&mut seen[b as usize], true) {
                        used[g] += 1;
                    }
                }
            }
        }
        used
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        let c = &self.pools.counters;
        let num_free_blocks = self.pools.gpu.num_free();
        Stats {
            num_blocks: self.config.num_blocks,
            num_free_blocks,
            num_used_blocks: self.pools.gpu.num_usable() - num_free_blocks,
            usage: self.usage(),
            num_cpu_blocks: self.config.num_cpu_blocks,
            num_free_cpu_blocks: self.pools.cpu.num_free(),
            num_sequences: self.slots.len(),
            num_swapped_sequences: self.num_swapped,
            num_cached_blocks: self.pools.cache.len(),
            prefix_cache_queries: c.prefix_cache_queries,
            prefix_cache_hits: c.prefix_cache_hits,
            prefix_cache_hit_rate: if c.prefix_cache_queries == 0 {
                0.0
            } else {
                c.prefix_cache_hits as f64 / c.prefix_cache_queries as f64
            },
            evictions: c.evictions,
            cow_copies: c.cow_copies,
            blocks_swapped_out: c.blocks_swapped_out,
            blocks_swapped_in: c.blocks_swapped_in,
            num_used_blocks_per_group: self.used_blocks_per_group(),
            num_cached_blocks_per_group: (0..self.pools.groups.len())
                .map(|g| self.pools.cache.group_len(g))
                .collect(),
            host_tier: self.tier_stats(),
        }
    }
}
