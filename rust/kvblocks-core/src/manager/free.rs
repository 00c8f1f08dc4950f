//! Releasing sequences and the prefix cache.

use super::pools::host_stored;
use super::KVCacheManager;
use crate::error::Result;
use crate::events::KvCacheEvent;

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
        self.scratch.forget_batch();
        let mut seq = self.slots.swap_remove(slot);
        self.in_flight.untrack(&mut seq);
        if let Some(moved) = self.slots.get(slot) {
            self.index.insert(moved.id, slot as u32);
        }
        // Released window entries (a leading run) and a recurrent group's entries
        // without a state are null in both pools' tables; CPU id 0 is a real block, so a
        // swapped table is read by position (`held_range`), not by value.
        for (g, t) in seq.tables.iter().enumerate().rev() {
            if seq.swapped {
                let held = t.held_range(self.pools.groups[g], seq.num_computed);
                for &b in t.blocks[held].iter().rev() {
                    self.pools.release_cpu(b);
                }
            } else {
                for &b in t.blocks[t.num_released..].iter().rev() {
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
    /// Events: one `AllBlocksCleared`, meaning every medium (no `BlockRemoved` follows
    /// for what it dropped), then one host-tier `BlockStored` of the written blocks the
    /// tier kept, if any (kept blocks still being written are announced when their write
    /// is confirmed), so a consumer that clears every tier of the instance holds exactly
    /// the blocks the manager serves.
    ///
    /// Free-queue order is kept. With prefix caching off this is a no-op returning true.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.pools.gpu.num_free() != self.pools.gpu.num_usable() {
            return false;
        }
        if self.pools.caching {
            self.pools.cache.clear();
            // The host tier keeps blocks pinned by unconfirmed ops (an engine may still be
            // copying them); the rest go. Of those kept, the written ones (sources of
            // loads) are hits now and announced below; those being written are announced
            // when their write is confirmed, as every offload is.
            let kept = self.pools.tier.as_mut().map_or_else(Vec::new, |t| {
                t.clear_unpinned();
                t.ready_hashes()
            });
            if self.pools.record_events {
                self.pools.events.push(KvCacheEvent::AllBlocksCleared);
                // Per group, hashes only: the kept blocks' tokens are not at hand.
                for g in 0..self.pools.groups.len() {
                    let block_hashes: Vec<_> = kept
                        .iter()
                        .filter(|(group, _)| *group == g)
                        .map(|(_, h)| *h)
                        .collect();
                    if !block_hashes.is_empty() {
                        self.pools
                            .events
                            .push(KvCacheEvent::BlockStored(host_stored(g, block_hashes)));
                    }
                }
            }
        }
        true
    }
}
