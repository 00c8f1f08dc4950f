//! The ordered memory-op list and the host tier's queries.
//!
//! Every block move the manager decides (swaps, copy-on-write copies, host-tier offloads
//! and loads) is journaled in one list, in issue order, with or without a tier: it is the
//! one protocol. [`KVCacheManager::take_copy_on_writes`] is a view of it.
//!
//! Contract (see `docs/scheduler-engine-interface.md`, "Host tier"): the engine drains the
//! ops of a step with [`KVCacheManager::take_memory_ops`] and applies them in the order
//! given, before the step's attention (on one stream, or with each op ordered after the
//! previous ones that touch the same block). GPU-side safety follows from that order: an
//! offload's GPU source is read before the block's new owner writes it, a load's GPU
//! destination is written before any attention reads it. Host-tier slots may be copied
//! asynchronously: every slot an op names stays pinned until
//! [`KVCacheManager::confirm_memory_ops`] confirms the ops taken so far.

use super::pools::host_stored;
use super::KVCacheManager;
use crate::block_hash::BlockHash;
use crate::error::{KvError, Result};
use crate::host_tier::{MemoryOp, MemoryOpKind, TierStats};
use crate::retention::RetentionPriority;

impl KVCacheManager {
    /// Drain every queued block move (swaps, copy-on-write copies, host-tier offloads and
    /// loads) in issue order. Their host-tier slots stay pinned until
    /// `confirm_memory_ops`.
    pub fn take_memory_ops(&mut self) -> Vec<MemoryOp> {
        if let Some(t) = self.pools.tier.as_mut() {
            t.mark_taken();
        }
        std::mem::take(&mut self.pools.ops)
    }

    /// The engine finished every op taken by `take_memory_ops` so far: unpin their
    /// host-tier slots (offloaded blocks become prefix hits, and their `BlockStored`
    /// events, medium CPU, are queued now). Ops still queued stay pinned. A no-op without
    /// a host tier.
    pub fn confirm_memory_ops(&mut self) {
        self.pools.confirm_tier();
    }

    /// The engine could not finish the ops taken by `take_memory_ops` so far (a copy
    /// into the host pool raised, a fetched block could not be written): release their
    /// host-tier pins without trusting what they wrote. The slots offloads or imports
    /// were writing become empty, never prefix hits, and their `BlockStored` events are
    /// never queued; load sources keep their blocks. Ops still queued stay pinned. GPU
    /// blocks the failed ops wrote (loads, swaps, copies) are the engine's to drop (free
    /// their sequences, `reset_prefix_cache`). A no-op without a host tier.
    pub fn discard_memory_ops(&mut self) {
        self.pools.discard_tier();
    }

    /// The block hash each host-tier slot holds or is being written with (`None` for an
    /// empty slot, an id out of range, or without a tier): what an engine that copies
    /// offloaded rows further (to a shared store) keys them by. Read it while the
    /// offload's slot is pinned (before `confirm_memory_ops`), when it cannot be reused.
    pub fn tier_slot_hashes(&self, slots: &[i64]) -> Vec<Option<BlockHash>> {
        self.tier_slot_keys(slots)
            .into_iter()
            .map(|k| k.map(|(_, h)| h))
            .collect()
    }

    /// The KV cache group and block hash of each host-tier slot (as `tier_slot_hashes`):
    /// with several groups a block is keyed by both (each group's block of the same
    /// tokens holds that group's KV).
    pub fn tier_slot_keys(&self, slots: &[i64]) -> Vec<Option<(usize, BlockHash)>> {
        slots
            .iter()
            .map(|&s| {
                let tier = self.pools.tier.as_ref()?;
                tier.slot_key(usize::try_from(s).ok()?)
            })
            .collect()
    }

    /// Leading blocks of a hash chain that a prompt would hit now (in the GPU prefix cache
    /// or written in the host tier, in every group as the hit rule needs), with no side
    /// effect: where fetching from a remote store starts. Digests of another length than
    /// the hash algorithm's never hit.
    pub fn num_cached_prefix_blocks(&self, digests: &[&[u8]]) -> usize {
        let hashes: Vec<BlockHash> = digests
            .iter()
            .map_while(|d| BlockHash::from_digest(d))
            .collect();
        self.pools.probe(&hashes, hashes.len())
    }

    /// [`KVCacheManager::import_group_tier_blocks`] of group 0.
    pub fn import_tier_blocks(
        &mut self,
        digests: &[&[u8]],
        priority: RetentionPriority,
    ) -> Result<Vec<i64>> {
        self.import_group_tier_blocks(digests, priority, 0)
    }

    /// Reserve host-tier slots for blocks of `group` the engine fetched from elsewhere (a
    /// shared remote store), one entry per digest: the slot to write the block's KV into, or -1
    /// when nothing is to be written (already in the GPU prefix cache or the tier, or
    /// every slot pinned or holding blocks of higher retention priority than `priority`,
    /// which the imported blocks keep in the tier). Reserved slots are pinned and no prefix hit until the engine
    /// has written them and called `confirm_memory_ops`; then a probe finds them and a
    /// claim loads them like offloaded blocks. Emits `BlockStored` (medium CPU) per slot at
    /// that `confirm_memory_ops`.
    ///
    /// Fails with `InvalidArgument` (nothing reserved) without a host tier, without
    /// prefix caching, for a group out of range, or for a digest whose length is not the
    /// hash algorithm's.
    pub fn import_group_tier_blocks(
        &mut self,
        digests: &[&[u8]],
        priority: RetentionPriority,
        group: usize,
    ) -> Result<Vec<i64>> {
        self.check_group(group)?;
        if self.pools.tier.is_none() || !self.pools.caching {
            return Err(KvError::InvalidArgument(
                "import_tier_blocks needs a host tier and prefix caching".to_string(),
            ));
        }
        let want = match self.config.hash_algo {
            crate::config::HashAlgo::Xxh3_128 => 16,
            _ => 32,
        };
        let mut hashes = Vec::with_capacity(digests.len());
        for (i, d) in digests.iter().enumerate() {
            match BlockHash::from_digest(d).filter(|_| d.len() == want) {
                Some(h) => hashes.push(h),
                None => {
                    return Err(KvError::InvalidArgument(format!(
                        "block hash {i} has {} bytes, expected {want}",
                        d.len()
                    )))
                }
            }
        }
        let mut slots = Vec::with_capacity(hashes.len());
        for hash in hashes {
            if self.pools.cache.lookup(group, &hash).is_some() {
                slots.push(-1);
                continue;
            }
            let Some(tier) = self.pools.tier.as_mut() else {
                slots.push(-1);
                continue;
            };
            let Some((slot, evicted)) = tier.reserve(group, hash, priority) else {
                slots.push(-1);
                continue;
            };
            slots.push(slot as i64);
            if self.pools.record_events {
                self.pools.record_host_eviction(evicted);
                self.pools
                    .announce_when_written(group, hash, host_stored(group, vec![hash]));
            }
        }
        Ok(slots)
    }

    /// Drain the journal as copy-on-write `(src, dst)` block pairs: a view of
    /// `take_memory_ops` for a caller that applies swaps from the rows `swap_out` and
    /// `swap_in` return (their journal entries are dropped here).
    ///
    /// Fails with `SequenceState`, changing nothing, while the journal holds an offload or
    /// a load: those cannot be expressed as copies nor dropped (drain them with
    /// `take_memory_ops`).
    pub fn take_copy_on_writes(&mut self) -> Result<Vec<[i64; 2]>> {
        let tier_op = |op: &MemoryOp| matches!(op.kind, MemoryOpKind::Offload | MemoryOpKind::Load);
        if self.pools.ops.iter().any(tier_op) {
            return Err(KvError::SequenceState(
                "take_copy_on_writes: host-tier offloads or loads are queued, ordered with \
                 the copies; drain them with take_memory_ops"
                    .to_string(),
            ));
        }
        Ok(self
            .pools
            .ops
            .drain(..)
            .filter(|op| op.kind == MemoryOpKind::Copy)
            .map(|op| [op.src, op.dst])
            .collect())
    }

    /// Of the sequence's cached tokens, those loaded from the host tier (before the
    /// first `allocate_slots`: those a claim now would load); with several groups, the
    /// tokens of the blocks some group loads.
    pub fn num_tier_tokens(&self, seq_id: u64) -> Result<usize> {
        let seq = self.seq(seq_id)?;
        Ok(if seq.allocated {
            seq.num_tier_tokens
        } else {
            let hit = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
            self.pools.tier_positions(&seq.hashes, hit) * self.config.block_size
        })
    }

    /// The host-tier blocks a waiting sequence's claim would load, over all groups (each
    /// group loads the blocks of the hit its queries see): what a scheduler counts
    /// against `max_load_blocks_per_step`. Errors: `UnknownSequence`, `SequenceState`
    /// (already allocated, or swapped).
    pub fn num_tier_loads(&self, seq_id: u64) -> Result<usize> {
        let seq = self.seq(seq_id)?;
        Self::require_resident(seq, "num_tier_loads")?;
        if seq.allocated {
            return Err(KvError::SequenceState(format!(
                "num_tier_loads: sequence {seq_id} already has slots; it counts a waiting \
                 sequence's loads"
            )));
        }
        let hit = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
        Ok(self.pools.probe_tier(&seq.hashes, hit))
    }

    /// Lower a waiting sequence's cached-prefix cap so that its claim loads at most
    /// `max_loads` blocks from the host tier (over all groups): the hit is cut right
    /// before its `max_loads + 1`-th tier block (with window or chunked groups: to the
    /// longest shorter hit whose loads fit), and the blocks past the cut are computed
    /// instead.
    /// Returns the cached tokens the sequence would claim now. How a scheduler bounds a
    /// step's host-to-GPU transfers; `refresh_prefixes` restores the full hit. Nothing
    /// changes without a tier or when the loads fit. Errors: `UnknownSequence`,
    /// `SequenceState` (already allocated, or swapped).
    pub fn limit_tier_loads(&mut self, seq_id: u64, max_loads: usize) -> Result<usize> {
        let slot = self.slot_of(seq_id)?;
        let seq = &self.slots[slot];
        Self::require_resident(seq, "limit_tier_loads")?;
        if seq.allocated {
            return Err(KvError::SequenceState(format!(
                "limit_tier_loads: sequence {seq_id} already has slots (its prefix was \
                 claimed); only waiting sequences can be limited"
            )));
        }
        let hit = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
        let cap = self.pools.limit_loads(&seq.hashes, hit, max_loads);
        // cap <= hit <= probe_cap_blocks: the cap only shrinks, as through eviction.
        self.slots[slot].probe_cap_blocks = cap;
        Ok(cap * self.config.block_size)
    }

    /// Counters of the host tier, `None` without one.
    pub fn tier_stats(&self) -> Option<TierStats> {
        self.pools.tier.as_ref().map(|t| t.stats())
    }

    /// Record a swap's rows in the op list.
    pub(super) fn queue_swap(&mut self, kind: MemoryOpKind, rows: &[[i64; 2]]) {
        self.pools.ops.extend(rows.iter().map(|r| MemoryOp {
            kind,
            src: r[0],
            dst: r[1],
        }));
    }
}
