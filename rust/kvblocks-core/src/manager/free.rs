//! Releasing sequences and the prefix cache.

use super::KVCacheManager;
use crate::error::Result;
use crate::events::{BlockRemoved, KvCacheEvent};
use crate::host_tier::Medium;

impl KVCacheManager {
    /// Release the sequence's blocks (groups last to first, each last block first) and
    /// forget it.
    ///
    /// Unhashed blocks go to the front of the free queue, cached blocks to the back (of
    /// their retention priority's level), so a group's first blocks, and the first
    /// group's, are evicted last.
    /// Works on swapped sequences (their CPU blocks go to the CPU queue's front).
    pub fn free(&mut self, seq_id: u64) -> Result<()> {
        let slot = self.slot_of(seq_id)?;
        self.index.remove(&seq_id);
        let mut seq = self.slots.swap_remove(slot);
        self.in_flight.untrack(&mut seq);
        if let Some(moved) = self.slots.get(slot) {
            self.index.insert(moved.id, slot as u32);
        }
        // Released window entries (a leading run) are null in both pools' tables; CPU
        // id 0 is a real block, so they are skipped by position, not by value.
        for t in seq.tables.iter().rev() {
            for &b in t.blocks[t.num_released..].iter().rev() {
                if seq.swapped {
                    self.pools.release_cpu(b);
                } else {
                    self.pools.release_gpu(b);
                }
            }
        }
        if seq.swapped {
            self.num_swapped -= 1;
        }
        Ok(())
    }

    /// Forget every cached hash; only when no GPU block is referenced. Returns success.
    ///
    /// The host tier drops its blocks too, except those pinned by unconfirmed ops.
    ///
    /// Free-queue order is kept. With prefix caching off this is a no-op returning true.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.pools.gpu.num_free() != self.pools.gpu.num_usable() {
            return false;
        }
        if self.pools.caching {
            self.pools.cache.clear();
            if self.pools.record_events {
                self.pools.events.push(KvCacheEvent::AllBlocksCleared);
            }
            // The host tier keeps blocks pinned by unconfirmed ops (an engine may still be
            // copying them); the rest go, one `BlockRemoved` with medium CPU.
            if let Some(t) = self.pools.tier.as_mut() {
                let removed = t.clear_unpinned();
                if self.pools.record_events {
                    // One event per group that had blocks there.
                    for g in 0..self.pools.groups.len() {
                        let block_hashes: Vec<_> = removed
                            .iter()
                            .filter(|(group, _)| *group == g)
                            .map(|(_, h)| *h)
                            .collect();
                        if !block_hashes.is_empty() {
                            self.pools
                                .events
                                .push(KvCacheEvent::BlockRemoved(BlockRemoved {
                                    block_hashes,
                                    medium: Medium::Cpu,
                                    group_idx: g as u32,
                                }));
                        }
                    }
                }
            }
        }
        true
    }
}
