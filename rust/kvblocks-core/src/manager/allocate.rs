//! Admission checks and slot reservation (prefix claim, copy-on-write, growth).

use super::KVCacheManager;
use crate::alloc_status::AllocStatus;
use crate::batch_allocation::BatchAllocation;
use crate::batch_arg::BatchArg;
use crate::error::{KvError, Result};
use crate::events::KvCacheEvent;
use crate::host_tier::{Medium, MemoryOp, MemoryOpKind};
use crate::prefix_cache::CacheEntry;
use crate::NULL_BLOCK;

/// What serving one `allocate_slots` request takes, computed before anything changes.
#[derive(Debug, Clone, Copy)]
struct AllocPlan {
    /// Cached-prefix blocks to claim (first call only), host-tier hits included.
    claim: usize,
    /// Of `claim`, the blocks loaded from the host tier.
    loads: usize,
    /// Whether the block at the next write position must be copied first.
    cow: bool,
    /// Blocks to append to the table.
    append: usize,
    /// Slots reserved once served.
    reserved: usize,
}

impl KVCacheManager {
    /// Can the whole known sequence (plus lookahead) get blocks, keeping the watermark free?
    ///
    /// Only for sequences not yet allocated and not swapped (else `SequenceState`).
    pub fn can_allocate(&self, seq_id: u64, num_lookahead_tokens: usize) -> Result<AllocStatus> {
        let seq = self.seq(seq_id)?;
        Self::require_resident(seq, "can_allocate")?;
        if seq.allocated {
            return Err(KvError::SequenceState(format!(
                "can_allocate: sequence {seq_id} already has slots; it is an admission check \
                 for sequences not yet allocated"
            )));
        }
        let bs = self.config.block_size;
        let total = seq
            .tokens
            .len()
            .checked_add(num_lookahead_tokens)
            .ok_or_else(|| {
                KvError::InvalidArgument("num_lookahead_tokens is too large".to_string())
            })?;
        let required = total.div_ceil(bs);
        let hit = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
        // Referenced GPU hits cost nothing; free GPU hits and host-tier hits take a block.
        let shared =
            hit - self.pools.probe_free(&seq.hashes, hit) - self.pools.probe_tier(&seq.hashes, hit);
        let needed = required - shared;
        let usable = self.config.num_blocks - 1;
        if required > usable.saturating_sub(self.watermark_blocks) {
            return Ok(AllocStatus::Never);
        }
        let free = self.pools.gpu.num_free() as i128;
        if free - (needed as i128) < self.watermark_blocks as i128 {
            return Ok(AllocStatus::Later);
        }
        Ok(AllocStatus::Ok)
    }

    /// Reserve KV slots for `computed + num_new_tokens + num_lookahead_tokens` tokens.
    ///
    /// Returns the block ids taken from the free pool (CoW replacements first, then
    /// appended blocks), possibly empty; `Ok(None)` with no state change when the pool is
    /// short. Errors: `UnknownSequence`, `SequenceState` (swapped), `InvalidArgument`
    /// (`computed + num_new_tokens > num_tokens`).
    pub fn allocate_slots(
        &mut self,
        seq_id: u64,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<Option<Vec<i32>>> {
        let slot = self.slot_of(seq_id)?;
        self.validate_allocation(slot, num_new_tokens, num_lookahead_tokens)?;
        let mut taken = Vec::new();
        if self
            .serve_allocation(slot, num_new_tokens, num_lookahead_tokens, &mut taken)
            .is_some()
        {
            Ok(Some(taken))
        } else {
            Ok(None)
        }
    }

    /// `allocate_slots` for many sequences; reports what the served prefix got.
    ///
    /// Every entry is validated before anything changes; then sequences are served in
    /// order until the first one the pool cannot serve.
    pub fn allocate_slots_batch(
        &mut self,
        seq_ids: &[u64],
        num_new_tokens: BatchArg<'_>,
        num_lookahead_tokens: usize,
    ) -> Result<BatchAllocation> {
        num_new_tokens.check_len(seq_ids.len(), "num_new_tokens")?;
        let slots = self.batch_slots(seq_ids)?;
        for (i, &slot) in slots.iter().enumerate() {
            let new = Self::count_arg(num_new_tokens.get(i), "num_new_tokens")?;
            self.validate_allocation(slot as usize, new, num_lookahead_tokens)?;
        }
        let mut out = BatchAllocation {
            num_served: 0,
            num_cached_tokens: Vec::with_capacity(slots.len()),
            block_ids: Vec::new(),
            block_indptr: Vec::with_capacity(slots.len() + 1),
        };
        out.block_indptr.push(0);
        for (i, &slot) in slots.iter().enumerate() {
            // Validated above; a negative count cannot reach here.
            let new = num_new_tokens.get(i) as usize;
            let Some(claimed) =
                self.serve_allocation(slot as usize, new, num_lookahead_tokens, &mut out.block_ids)
            else {
                break;
            };
            out.num_served += 1;
            out.num_cached_tokens.push(claimed as i64);
            out.block_indptr.push(out.block_ids.len() as i64);
        }
        Ok(out)
    }

    /// A non-negative count from a batch argument.
    #[inline]
    pub(super) fn count_arg(value: i64, what: &str) -> Result<usize> {
        usize::try_from(value)
            .map_err(|_| KvError::InvalidArgument(format!("{what} must be >= 0, got {value}")))
    }

    /// Check an allocation request without changing anything.
    fn validate_allocation(&self, slot: usize, new: usize, lookahead: usize) -> Result<()> {
        let seq = &self.slots[slot];
        Self::require_resident(seq, "allocate_slots")?;
        let computed = self.computed_of(seq);
        let known = seq.tokens.len();
        let upto = computed.checked_add(new);
        if upto.is_none_or(|u| u > known) {
            return Err(KvError::InvalidArgument(format!(
                "allocate_slots: sequence {} has {computed} computed of {known} known tokens, \
                 so num_new_tokens must be <= {}, got {new} (speculative tokens go through \
                 num_lookahead_tokens)",
                seq.id,
                known - computed
            )));
        }
        if upto.and_then(|u| u.checked_add(lookahead)).is_none() {
            return Err(KvError::InvalidArgument(format!(
                "allocate_slots: num_lookahead_tokens {lookahead} is too large"
            )));
        }
        Ok(())
    }

    /// What serving the (validated) request needs, given the pool as it is now.
    fn plan_allocation(&self, slot: usize, new: usize, lookahead: usize) -> (AllocPlan, usize) {
        let seq = &self.slots[slot];
        let bs = self.config.block_size;
        let (claim, loads, claim_from_free, computed, table_len) = if seq.allocated {
            (0, 0, 0, seq.num_computed, seq.table.len())
        } else {
            let claim = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
            let loads = self.pools.probe_tier(&seq.hashes, claim);
            let from_free = self.pools.probe_free(&seq.hashes, claim);
            (claim, loads, from_free, claim * bs, claim)
        };
        let reserved = computed + new + lookahead;
        let append = reserved.div_ceil(bs).saturating_sub(table_len);
        let pos_block = computed / bs;
        let cow = new + lookahead > 0
            && seq.allocated
            && pos_block < table_len
            && seq.table[pos_block] != NULL_BLOCK
            && self.pools.gpu.ref_count(seq.table[pos_block]) > 1;
        let plan = AllocPlan {
            claim,
            loads,
            cow,
            append,
            reserved,
        };
        (plan, append + cow as usize + claim_from_free + loads)
    }

    /// Serve a validated request if the pool can: appends the blocks it takes to
    /// `taken` and returns the cached tokens it claimed; `None` (nothing changed) if the
    /// pool is short.
    fn serve_allocation(
        &mut self,
        slot: usize,
        new: usize,
        lookahead: usize,
        taken: &mut Vec<i32>,
    ) -> Option<usize> {
        let (plan, need) = self.plan_allocation(slot, new, lookahead);
        if need > self.pools.gpu.num_free() {
            return None;
        }
        let bs = self.config.block_size;
        taken.reserve(plan.append + plan.cow as usize);
        let pools = &mut self.pools;
        let seq = &mut self.slots[slot];
        if !seq.allocated {
            // Claim the cached prefix: take free cached blocks out of the queue (they
            // must not be evicted by the pops below) and share referenced ones.
            seq.table.reserve(plan.claim + plan.append);
            let mut tier_hits: Vec<(usize, u32)> = Vec::with_capacity(plan.loads);
            for (i, h) in seq.hashes[..plan.claim].iter().enumerate() {
                if let Some(b) = pools.cache.lookup(h) {
                    if pools.gpu.ref_count(b) == 0 {
                        pools.gpu.take_free(b);
                    } else {
                        pools.gpu.incref(b);
                    }
                    pools.raise_retention(b, h, seq.retention);
                    seq.table.push(b);
                } else if let Some(s) = pools.tier.as_mut().and_then(|t| {
                    let s = t.lookup_ready(h)?;
                    // Pinned before any pop below can offload into the tier.
                    t.pin_read(s);
                    Some(s)
                }) {
                    tier_hits.push((i, s));
                    seq.table.push(NULL_BLOCK);
                } else {
                    debug_assert!(false, "planned claim of an uncached block");
                    break;
                }
            }
            // Host-tier hits get fresh GPU blocks (after the GPU hits left the free queue,
            // so these pops cannot evict them) and enter the GPU cache at once: their
            // loads come before this step's attention, like every memory op.
            for &(i, s) in &tier_hits {
                let b = pools.pop_gpu()?;
                seq.table[i] = b;
                let hash = seq.hashes[i];
                let mut priority = seq.retention;
                if let Some(t) = pools.tier.as_mut() {
                    t.load(s, b, &mut pools.ops);
                    // The block keeps the higher of its tier priority and this sequence's.
                    priority = priority.max(t.slot_priority(s));
                    t.raise_priority(&hash, priority);
                }
                let parent = (i > 0).then(|| seq.hashes[i - 1]);
                let tokens = &seq.tokens[i * bs..(i + 1) * bs];
                pools
                    .cache
                    .insert(b, CacheEntry::new(hash, parent, seq.namespace, tokens));
                pools.set_retention(b, priority);
                if pools.record_events {
                    let mut ev = seq.stored_event(parent, 1, bs, Medium::Gpu);
                    ev.block_hashes.push(hash);
                    ev.token_ids.extend_from_slice(tokens);
                    pools.events.push(KvCacheEvent::BlockStored(ev));
                }
            }
            seq.allocated = true;
            seq.num_computed = plan.claim * bs;
            seq.num_cached_tokens = plan.claim * bs;
            seq.num_tier_tokens = plan.loads * bs;
            seq.num_registered_blocks = plan.claim;
            if let Some(t) = pools.tier.as_mut() {
                t.stats.hits += (plan.loads * bs) as u64;
            }
            if pools.caching {
                pools.counters.prefix_cache_queries += seq.prompt_len as u64;
                // GPU hits only; host-tier hits are counted by the tier.
                pools.counters.prefix_cache_hits += ((plan.claim - plan.loads) * bs) as u64;
            }
        }
        if plan.cow {
            let i = seq.num_computed / bs;
            let src = seq.table[i];
            // The plan counted this block as available.
            let dst = pools.pop_gpu()?;
            pools.gpu.decref(src);
            seq.table[i] = dst;
            seq.dirty_from = seq.dirty_from.min(i);
            pools.ops.push(MemoryOp {
                kind: MemoryOpKind::Copy,
                src: src as i64,
                dst: dst as i64,
            });
            pools.counters.cow_copies += 1;
            taken.push(dst as i32);
        }
        for _ in 0..plan.append {
            let b = pools.pop_gpu()?;
            seq.table.push(b);
            taken.push(b as i32);
        }
        seq.reserved = Some(plan.reserved);
        self.track_in_flight(slot, new);
        Some(plan.claim * bs)
    }
}
