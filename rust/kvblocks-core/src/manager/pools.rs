//! The two block pools with the prefix cache, and the free-queue rules that tie them.

use crate::block_hash::BlockHash;
use crate::block_pool::BlockPool;
use crate::events::{BlockRemoved, BlockStored, KvCacheEvent};
use crate::host_tier::{HostTier, Medium, MemoryOp, OffloadPolicy};
use crate::prefix_cache::PrefixCache;
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
    pub counters: Counters,
    /// The host tier below the GPU pool, if configured.
    pub tier: Option<HostTier>,
    /// Block moves in issue order, drained by `take_memory_ops` / `take_copy_on_writes`.
    pub ops: Vec<MemoryOp>,
}

impl Pools {
    /// Take the front free GPU block (one reference), evicting its cache entry if any.
    #[inline]
    pub fn pop_gpu(&mut self) -> Option<u32> {
        let id = self.gpu.pop_free()?;
        if self.caching {
            if let Some(hash) = self.cache.remove(id) {
                self.counters.evictions += 1;
                if self.record_events {
                    self.events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![hash],
                        medium: Medium::Gpu,
                    }));
                }
                // The block's KV is still intact: the op is queued before anything that
                // overwrites it (its new owner writes only after this step's ops).
                if self
                    .tier
                    .as_ref()
                    .is_some_and(|t| t.policy == OffloadPolicy::OnEvict)
                {
                    self.offload(id, hash, None, &[], 0, None);
                }
            }
        }
        Some(id)
    }

    /// Copy cached GPU block `id` (content `hash`) to the host tier, with its events.
    pub fn offload(
        &mut self,
        id: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        lora_id: Option<u64>,
    ) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let (evicted, stored) = tier.offload(id, hash, &mut self.ops);
        if !self.record_events {
            return;
        }
        if let Some(old) = evicted {
            self.events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![old],
                medium: Medium::Cpu,
            }));
        }
        if stored {
            self.events.push(KvCacheEvent::BlockStored(BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size,
                lora_id,
                medium: Medium::Cpu,
            }));
        }
    }

    /// Drop one reference to a GPU block; at zero it is queued: cached blocks at the
    /// back (evicted last), others at the front (reused first).
    #[inline]
    pub fn release_gpu(&mut self, id: u32) {
        if id == NULL_BLOCK {
            return;
        }
        if self.gpu.decref(id) == 0 {
            if self.caching && self.cache.is_cached(id) {
                self.gpu.free_queue_mut().push_back(id);
            } else {
                self.gpu.free_queue_mut().push_front(id);
            }
        }
    }

    /// Drop one reference to a CPU block; at zero it goes to the front of the CPU queue.
    #[inline]
    pub fn release_cpu(&mut self, id: u32) {
        if self.cpu.decref(id) == 0 {
            self.cpu.free_queue_mut().push_front(id);
        }
    }

    /// Leading blocks of the hash chain present in the cache, at most `cap`.
    #[inline]
    pub fn probe(&self, hashes: &[BlockHash], cap: usize) -> usize {
        if !self.caching {
            return 0;
        }
        let n = cap.min(hashes.len());
        match &self.tier {
            None => hashes[..n]
                .iter()
                .take_while(|h| self.cache.lookup(h).is_some())
                .count(),
            Some(tier) => hashes[..n]
                .iter()
                .take_while(|h| self.cache.lookup(h).is_some() || tier.lookup_ready(h).is_some())
                .count(),
        }
    }

    /// Of the first `n` blocks of the chain (all hits), how many come from the host tier
    /// (not in the GPU cache): the loads a claim would queue.
    #[inline]
    pub fn probe_tier(&self, hashes: &[BlockHash], n: usize) -> usize {
        if self.tier.is_none() {
            return 0;
        }
        hashes[..n]
            .iter()
            .filter(|h| self.cache.lookup(h).is_none())
            .count()
    }

    /// Of the first `n` blocks of the chain (all cached), how many sit in the free queue.
    #[inline]
    pub fn probe_free(&self, hashes: &[BlockHash], n: usize) -> usize {
        hashes[..n]
            .iter()
            .filter(|h| {
                self.cache
                    .lookup(h)
                    .is_some_and(|b| self.gpu.ref_count(b) == 0)
            })
            .count()
    }
}
