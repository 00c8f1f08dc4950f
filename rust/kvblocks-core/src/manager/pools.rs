//! The two block pools with the prefix cache, and the free-queue rules that tie them.

use crate::block_hash::BlockHash;
use crate::block_pool::BlockPool;
use crate::events::{BlockRemoved, BlockStored, KvCacheEvent};
use crate::group::GroupSpec;
use crate::host_tier::{HostTier, Medium, MemoryOp, OffloadPolicy};
use crate::prefix_cache::PrefixCache;
use crate::priority_lru::{cached_level, EMPTY_LEVEL};
use crate::retention::RetentionPriority;
use crate::NULL_BLOCK;

/// Running counters (see [`crate::Stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Counters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub evictions: u64,
    pub cow_copies: u64,
    pub blocks_swapped_out: u64,
    pub blocks_swapped_in: u64,
}

/// GPU and CPU pools, the prefix cache over the GPU pool, the host tier below it, their
/// events, counters and memory ops.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Pools {
    pub gpu: BlockPool,
    pub cpu: BlockPool,
    pub cache: PrefixCache,
    pub caching: bool,
    /// Whether cache events are queued for `take_events` (see `ManagerConfig::record_events`).
    pub record_events: bool,
    pub events: Vec<KvCacheEvent>,
    /// Host-tier `BlockStored` events held back until their slot's write is confirmed
    /// (`confirm_memory_ops`), with the slot: a slot being written is no prefix hit, so
    /// a router told of it earlier would count a hit the instance does not give (as
    /// vLLM's offloading manager announces a stored block at `complete_store`).
    pub announce: Vec<(u32, BlockStored)>,
    pub counters: Counters,
    /// The host tier below the GPU pool, if configured.
    pub tier: Option<HostTier>,
    /// Every block move in issue order (with or without a tier), drained by
    /// `take_memory_ops` (or its copy view `take_copy_on_writes`).
    pub ops: Vec<MemoryOp>,
    /// Retention priority of each cached GPU block (the highest of the sequences that
    /// committed or claimed it): its level in the free queue, and what an offload at
    /// eviction hands the tier. Empty without prefix caching.
    pub retention: Vec<RetentionPriority>,
    /// The KV cache groups, in order.
    pub groups: Vec<GroupSpec>,
    /// Whether every group is full attention (the prefix hit is one left-to-right scan).
    pub all_full: bool,
    /// Whether some group is a recurrent-state group (lookahead and partial commits are
    /// refused: a state is saved at the step's end only).
    pub recurrent: bool,
    /// Tokens per block.
    pub block_size: usize,
}

impl Pools {
    /// Take the front free GPU block (one reference), evicting its cache entry if any.
    #[inline]
    pub fn pop_gpu(&mut self) -> Option<u32> {
        let id = self.gpu.pop_free()?;
        if self.caching {
            if let Some(gone) = self.cache.remove(id) {
                let (old_group, hash) = (gone.group, gone.hash);
                self.counters.evictions += 1;
                if self.record_events {
                    self.events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![hash],
                        medium: Medium::Gpu,
                        group_idx: old_group as u32,
                    }));
                }
                // The block's KV is still intact: the op is queued before anything that
                // overwrites it (its new owner writes only after this step's ops).
                // A copy whose content another cached block still holds is not offloaded:
                // the hash stays hittable on the GPU, and its last copy goes to the tier.
                if gone.last_copy
                    && self
                        .tier
                        .as_ref()
                        .is_some_and(|t| t.policy == OffloadPolicy::OnEvict)
                {
                    let priority = self.retention_of(id);
                    // The GPU cache keeps no tokens nor keys: the event has the hash only.
                    self.offload(old_group, id, hash, priority, || {
                        host_stored(old_group, Vec::new())
                    });
                }
            }
        }
        Some(id)
    }

    /// The cached block of `group` holding `hash` that a claim takes, if any: of several
    /// copies, one some sequence already uses (sharing it takes nothing from the free
    /// queue), else the head of the copies (vLLM's choice: its first cached copy).
    #[inline(always)]
    pub fn cached_block(&self, group: usize, hash: &BlockHash) -> Option<u32> {
        let head = self.cache.lookup(group, hash)?;
        // The only copy (the common case) is answered inline, on the claim's hot path.
        if self.cache.has_next_copy(head) {
            return Some(self.copy_to_claim(group, hash, head));
        }
        Some(head)
    }

    /// [`Pools::cached_block`] of a hash with several copies.
    #[cold]
    #[inline(never)]
    fn copy_to_claim(&self, group: usize, hash: &BlockHash, head: u32) -> u32 {
        if self.gpu.ref_count(head) > 0 {
            return head;
        }
        self.cache
            .copies(group, hash)
            .find(|&b| self.gpu.ref_count(b) > 0)
            .unwrap_or(head)
    }

    /// Copy cached GPU block `id` (content `hash` of `group`) to the host tier at
    /// retention `priority`, with its events; `event` makes the `BlockStored` (its hash
    /// is added).
    pub fn offload(
        &mut self,
        group: usize,
        id: u32,
        hash: BlockHash,
        priority: RetentionPriority,
        event: impl FnOnce() -> BlockStored,
    ) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let (evicted, stored) = tier.offload(group, id, hash, priority, &mut self.ops);
        if !self.record_events {
            return;
        }
        self.record_host_eviction(evicted);
        if stored {
            let mut ev = event();
            ev.block_hashes.push(hash);
            self.announce_when_written(group, hash, ev);
        }
    }

    /// Queue the host-tier `BlockStored` `ev` of block `hash` of `group` until the write
    /// of its slot is confirmed (callers check `record_events`).
    pub fn announce_when_written(&mut self, group: usize, hash: BlockHash, ev: BlockStored) {
        if let Some(slot) = self.tier.as_ref().and_then(|t| t.slot_of(group, &hash)) {
            self.announce.push((slot, ev));
        }
    }

    /// Confirm the tier's taken ops and publish the `BlockStored` of every slot whose
    /// write they completed, in the order the blocks were stored.
    pub fn confirm_tier(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        tier.confirm();
        if self.announce.is_empty() {
            return;
        }
        let (done, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.announce)
            .into_iter()
            .partition(|(slot, _)| tier.is_ready(*slot));
        self.announce = waiting;
        self.events.extend(
            done.into_iter()
                .map(|(_, ev)| KvCacheEvent::BlockStored(ev)),
        );
    }

    /// The engine could not finish the taken ops: the tier slots they were writing are
    /// emptied and never announced (see `HostTier::discard`).
    pub fn discard_tier(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let emptied = tier.discard();
        if !emptied.is_empty() {
            self.announce.retain(|(slot, _)| !emptied.contains(slot));
        }
    }

    /// Record the `BlockRemoved` of the host-tier block a store evicted, if any (callers
    /// check `record_events`).
    pub fn record_host_eviction(&mut self, evicted: Option<(usize, BlockHash)>) {
        if let Some((group, old)) = evicted {
            self.events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![old],
                medium: Medium::Cpu,
                group_idx: group as u32,
            }));
        }
    }

    /// Retention priority of cached GPU block `id` (the default without prefix caching).
    #[inline]
    pub fn retention_of(&self, id: u32) -> RetentionPriority {
        self.retention.get(id as usize).copied().unwrap_or_default()
    }

    /// Block `id` enters the GPU cache for a sequence of retention `priority`.
    #[inline]
    pub fn set_retention(&mut self, id: u32, priority: RetentionPriority) {
        if let Some(r) = self.retention.get_mut(id as usize) {
            *r = priority;
        }
    }

    /// A sequence of retention `priority` shares cached block `id` (content `hash` of
    /// `group`): the block, and its host-tier copy if any, keep the higher priority (a
    /// free block moves to the back of its new level, as a block just used).
    #[inline]
    pub fn raise_retention(
        &mut self,
        group: usize,
        id: u32,
        hash: &BlockHash,
        priority: RetentionPriority,
    ) {
        let Some(r) = self.retention.get_mut(id as usize) else {
            return;
        };
        if priority > *r {
            *r = priority;
            let queue = self.gpu.free_queue_mut();
            if queue.contains(id) {
                queue.remove(id);
                queue.push_back(id, cached_level(priority));
            }
            if let Some(t) = self.tier.as_mut() {
                t.raise_priority(group, hash, priority);
            }
        }
    }

    /// Drop one reference to a GPU block; at zero it is queued: cached blocks at the
    /// back of their retention priority's level (evicted after uncached blocks and after
    /// cached ones of lower priority; with one priority, simply last), others at the
    /// front (reused first).
    #[inline]
    pub fn release_gpu(&mut self, id: u32) {
        if id == NULL_BLOCK {
            return;
        }
        if self.gpu.decref(id) == 0 {
            if self.caching && self.cache.is_cached(id) {
                let level = cached_level(self.retention_of(id));
                self.gpu.free_queue_mut().push_back(id, level);
            } else {
                self.gpu.free_queue_mut().push_front(id, EMPTY_LEVEL);
            }
        }
    }

    /// Drop one reference to a CPU block; at zero it goes to the front of the CPU queue.
    #[inline]
    pub fn release_cpu(&mut self, id: u32) {
        if self.cpu.decref(id) == 0 {
            self.cpu.free_queue_mut().push_front(id, EMPTY_LEVEL);
        }
    }
}

/// A host-tier `BlockStored` of `block_hashes` that carries the hashes only: blocks that
/// reach the host tier from the GPU cache or an import come without tokens or keys.
pub(super) fn host_stored(group: usize, block_hashes: Vec<BlockHash>) -> BlockStored {
    BlockStored {
        block_hashes,
        parent_block_hash: None,
        token_ids: Vec::new(),
        block_size: 0,
        lora_id: None,
        lora_name: None,
        extra_keys: None,
        medium: Medium::Cpu,
        group_idx: group as u32,
        kv_cache_spec: GroupSpec::default(),
    }
}
