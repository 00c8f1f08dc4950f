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
pub(super) struct AllocPlan {
    /// Cached-prefix blocks to claim (first call only), host-tier hits included: the
    /// table positions of the hit; each group claims the ones its next query sees.
    pub(super) claim: usize,
    /// Of the claimed blocks (all groups), those loaded from the host tier.
    loads: usize,
    /// Of the claimed positions, those some group loads (tokens served by the tier).
    tier_positions: usize,
    /// Bit `g`: the block of group `g` at the next write position must be copied first.
    cow: u64,
    /// Entries to append to every group's table (each with a fresh block in attention
    /// groups; recurrent groups fill only the entries their states go to).
    pub(super) append: usize,
    /// Fresh blocks the recurrent groups' state writes take (over all of them).
    fills: usize,
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
        self.check_lookahead(num_lookahead_tokens, "can_allocate")?;
        let total = seq
            .tokens
            .len()
            .checked_add(num_lookahead_tokens)
            .ok_or_else(|| {
                KvError::InvalidArgument("num_lookahead_tokens is too large".to_string())
            })?;
        let hit = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
        let (mut required, mut claimed) = (0, 0);
        for g in 0..self.pools.groups.len() {
            required += self.held_by_step(g, hit, total);
            claimed += self.pools.hit_range(g, hit).len();
        }
        // Referenced GPU hits cost nothing; free GPU hits and host-tier hits take a block.
        let shared = claimed
            - self.pools.probe_free(&seq.hashes, hit)
            - self.pools.probe_tier(&seq.hashes, hit);
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

    /// Can the sequence's next step, `num_new_tokens` tokens past its cached prefix (plus
    /// lookahead), get its blocks in every group, keeping the watermark free?
    ///
    /// The admission check of a scheduler that computes a prompt in steps: the blocks
    /// counted are those the step's `allocate_slots` takes (a window or chunked group
    /// needs only the blocks from its claim on, not every block of the prompt).
    /// `Never` when the pool minus the watermark holds less than this step keeps, or than
    /// the least any schedule of the rest of the known tokens needs once this step is
    /// computed (one a step: a full-attention group's every block, a window group's worst
    /// window; see `peak_held`). The positions this step computes count only as this
    /// step: a recurrent group's step from position 0 reads no state and writes only its
    /// checkpoints and last state, so computed one a step they would hold an input and an
    /// output state that this step never holds together. Only for sequences not yet
    /// allocated and not swapped (else `SequenceState`); `InvalidArgument` as
    /// `allocate_slots`.
    pub fn can_allocate_step(
        &self,
        seq_id: u64,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<AllocStatus> {
        let slot = self.slot_of(seq_id)?;
        let seq = &self.slots[slot];
        Self::require_resident(seq, "can_allocate")?;
        if seq.allocated {
            return Err(KvError::SequenceState(format!(
                "can_allocate: sequence {seq_id} already has slots; it is an admission check \
                 for sequences not yet allocated"
            )));
        }
        self.validate_allocation(slot, num_new_tokens, num_lookahead_tokens)?;
        let (plan, needed) = self.plan_allocation(slot, num_new_tokens, num_lookahead_tokens);
        let step_held: usize = (0..self.pools.groups.len())
            .map(|g| self.held_by_step(g, plan.claim, plan.reserved))
            .sum();
        let usable = (self.config.num_blocks - 1).saturating_sub(self.watermark_blocks);
        if step_held > usable || self.peak_held(slot, num_new_tokens, num_lookahead_tokens) > usable
        {
            return Ok(AllocStatus::Never);
        }
        let free = self.pools.gpu.num_free() as i128;
        if free - (needed as i128) < self.watermark_blocks as i128 {
            return Ok(AllocStatus::Later);
        }
        Ok(AllocStatus::Ok)
    }

    /// Blocks group `g` holds once a step from a claim of `claim` cached blocks has
    /// reserved `end` tokens: an attention group a block per table entry but those its
    /// claim leaves null, a recurrent group its claimed state and the states the step
    /// writes (not a block per entry).
    fn held_by_step(&self, g: usize, claim: usize, end: usize) -> usize {
        let bs = self.config.block_size;
        let spec = self.pools.groups[g];
        let range = self.pools.hit_range(g, claim);
        if spec.is_recurrent() {
            range.len() + spec.state_writes(claim * bs, end, bs).count()
        } else {
            let table_len = end.div_ceil(bs);
            table_len - range.start.min(table_len)
        }
    }

    /// The most blocks the (not yet allocated) sequence holds in all groups together
    /// while the known tokens past a first step of `first_step` tokens from its cached
    /// prefix are computed one at a time: the least any schedule of the rest needs
    /// (found at a few candidate positions, see the `peak` module). Once that step is
    /// computed every recurrent group holds a state, so one token a step is the least
    /// for every kind of group; 0 when the step computes every known token.
    fn peak_held(&self, slot: usize, first_step: usize, lookahead: usize) -> usize {
        let seq = &self.slots[slot];
        let bs = self.config.block_size;
        let known = seq.tokens.len();
        let cached = self.computed_of(seq).min(known.saturating_sub(1));
        let claim = cached / bs;
        let from = cached.saturating_add(first_step).min(known);
        super::peak::peak_held(&self.pools.groups, bs, known, from, lookahead, |g| {
            self.pools.hit_range(g, claim).start
        })
    }

    /// Reserve KV slots for `computed + num_new_tokens + num_lookahead_tokens` tokens in
    /// every group.
    ///
    /// Returns the block ids taken from the free pool (group by group: the CoW
    /// replacement first, then appended blocks), possibly empty; `Ok(None)` with no
    /// state change when the pool is short. Errors: `UnknownSequence`, `SequenceState`
    /// (swapped), `InvalidArgument` (`computed + num_new_tokens > num_tokens`).
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
    #[inline]
    pub(super) fn validate_allocation(
        &self,
        slot: usize,
        new: usize,
        lookahead: usize,
    ) -> Result<()> {
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
        self.check_lookahead(lookahead, "allocate_slots")
    }

    /// `InvalidArgument` for lookahead slots with a recurrent-state group: its state is
    /// saved after the step's known tokens, and draft tokens have no state to roll back
    /// to.
    fn check_lookahead(&self, lookahead: usize, op: &str) -> Result<()> {
        if lookahead > 0 && self.pools.recurrent {
            return Err(KvError::InvalidArgument(format!(
                "{op}: num_lookahead_tokens must be 0 with a recurrent-state group (a \
                 state is saved after the known tokens only), got {lookahead}"
            )));
        }
        Ok(())
    }

    /// What serving the (validated) request needs, given the pool as it is now.
    pub(super) fn plan_allocation(
        &self,
        slot: usize,
        new: usize,
        lookahead: usize,
    ) -> (AllocPlan, usize) {
        let seq = &self.slots[slot];
        let pools = &self.pools;
        let bs = self.config.block_size;
        if !seq.allocated {
            let claim = pools.probe(&seq.hashes, seq.probe_cap_blocks);
            let loads = pools.probe_tier(&seq.hashes, claim);
            let reserved = claim * bs + new + lookahead;
            let append = reserved.div_ceil(bs) - claim;
            let mut plan = AllocPlan {
                claim,
                loads,
                tier_positions: pools.tier_positions(&seq.hashes, claim),
                cow: 0,
                append,
                fills: 0,
                reserved,
            };
            let from_free = pools.probe_free(&seq.hashes, claim);
            let mut need = from_free + loads + append * seq.tables.len();
            if pools.recurrent {
                // Past the claim every entry is new: a recurrent group takes a block for
                // each state the step writes, not for each entry.
                for spec in pools.groups.iter().filter(|g| g.is_recurrent()) {
                    plan.fills += spec.state_writes(claim * bs, reserved, bs).count();
                    need -= append;
                }
                need += plan.fills;
            }
            return (plan, need);
        }
        let computed = seq.num_computed;
        let table_len = seq.table_len();
        let reserved = computed + new + lookahead;
        let append = reserved.div_ceil(bs).saturating_sub(table_len);
        let mut need = append * seq.tables.len();
        let mut cow = 0u64;
        let pos_block = computed / bs;
        if new + lookahead > 0 && pos_block < table_len {
            // The block at the write position (a recurrent group's: its state after the
            // computed tokens, updated in place) is copied first when shared.
            for (g, t) in seq.tables.iter().enumerate() {
                let b = t.blocks[pos_block];
                if b != NULL_BLOCK && pools.gpu.ref_count(b) > 1 {
                    cow |= 1 << g;
                    need += 1;
                }
            }
        }
        let mut fills = 0;
        if pools.recurrent {
            for (spec, t) in pools.groups.iter().zip(&seq.tables) {
                if spec.is_recurrent() {
                    need -= append;
                    fills += spec
                        .state_writes(computed, reserved, bs)
                        .filter(|&(j, _)| t.blocks.get(j).is_none_or(|&b| b == NULL_BLOCK))
                        .count();
                }
            }
            need += fills;
        }
        let plan = AllocPlan {
            claim: 0,
            loads: 0,
            tier_positions: 0,
            cow,
            append,
            fills,
            reserved,
        };
        (plan, need)
    }

    /// Serve a validated request if the pool can: appends the blocks it takes to
    /// `taken` and returns the cached tokens it claimed; `None` (nothing changed) if the
    /// pool is short.
    pub(super) fn serve_allocation(
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
        if !self.slots[slot].allocated {
            self.claim_prefix(slot, &plan)?;
        }
        let pools = &mut self.pools;
        let seq = &mut self.slots[slot];
        // Most decode steps take no block: only the reservation changes.
        let takes = plan.cow != 0 || plan.append != 0 || plan.fills != 0;
        if takes {
            taken.reserve(
                plan.append * seq.tables.len() + plan.fills + plan.cow.count_ones() as usize,
            );
        }
        let computed = seq.num_computed;
        for (g, t) in seq.tables.iter_mut().enumerate().filter(|_| takes) {
            if plan.cow & (1 << g) != 0 {
                let i = seq.num_computed / bs;
                let src = t.blocks[i];
                // The plan counted this block as available.
                let dst = pools.pop_gpu()?;
                pools.gpu.decref(src);
                t.blocks[i] = dst;
                t.dirty_from = t.dirty_from.min(i);
                pools.ops.push(MemoryOp {
                    kind: MemoryOpKind::Copy,
                    src: src as i64,
                    dst: dst as i64,
                });
                pools.counters.cow_copies += 1;
                taken.push(dst as i32);
            }
            let spec = pools.groups[g];
            if spec.is_recurrent() {
                // Entries whose states the step writes get a block; the rest stay null.
                let old_len = t.blocks.len();
                t.blocks.resize(old_len + plan.append, NULL_BLOCK);
                for (j, _) in spec.state_writes(computed, plan.reserved, bs) {
                    if t.blocks[j] == NULL_BLOCK {
                        let b = pools.pop_gpu()?;
                        t.blocks[j] = b;
                        if j < old_len {
                            t.dirty_from = t.dirty_from.min(j);
                        }
                        taken.push(b as i32);
                    }
                }
                continue;
            }
            for _ in 0..plan.append {
                let b = pools.pop_gpu()?;
                t.blocks.push(b);
                taken.push(b as i32);
            }
        }
        seq.reserved = Some(plan.reserved);
        self.track_in_flight(slot, new);
        Some(plan.claim * bs)
    }

    /// The first allocation of a sequence: claim its cached prefix in every group (the
    /// blocks each group's next query sees; null entries before them).
    fn claim_prefix(&mut self, slot: usize, plan: &AllocPlan) -> Option<()> {
        let bs = self.config.block_size;
        let pools = &mut self.pools;
        let seq = &mut self.slots[slot];
        // Take every group's free cached hits out of the queue first (the pops below
        // must not evict them) and share referenced ones; pin host-tier hits.
        let mut tier_hits: Vec<(usize, usize, u32)> = Vec::with_capacity(plan.loads);
        for g in 0..seq.tables.len() {
            let range = pools.hit_range(g, plan.claim);
            let t = &mut seq.tables[g];
            t.blocks.reserve(plan.claim + plan.append);
            t.blocks.resize(range.start, NULL_BLOCK);
            t.num_released = range.start;
            for i in range {
                let h = &seq.hashes[i];
                if let Some(b) = pools.cached_block(g, h) {
                    if pools.gpu.ref_count(b) == 0 {
                        pools.gpu.take_free(b);
                    } else {
                        pools.gpu.incref(b);
                    }
                    pools.raise_retention(g, b, h, seq.retention);
                    t.blocks.push(b);
                } else if let Some(s) = pools.tier.as_mut().and_then(|tier| {
                    let s = tier.lookup_ready(g, h)?;
                    // Pinned before any pop below can offload into the tier.
                    tier.pin_read(s);
                    Some(s)
                }) {
                    tier_hits.push((g, i, s));
                    t.blocks.push(NULL_BLOCK);
                } else {
                    debug_assert!(false, "planned claim of an uncached block");
                    return None;
                }
            }
        }
        // Host-tier hits get fresh GPU blocks (after the GPU hits left the free queue,
        // so these pops cannot evict them) and enter the GPU cache at once: their
        // loads come before this step's attention, like every memory op.
        for &(g, i, s) in &tier_hits {
            let b = pools.pop_gpu()?;
            seq.tables[g].blocks[i] = b;
            let hash = seq.hashes[i];
            let mut priority = seq.retention;
            if let Some(t) = pools.tier.as_mut() {
                t.load(s, b, &mut pools.ops);
                // The block keeps the higher of its tier priority and this sequence's.
                priority = priority.max(t.slot_priority(s));
                t.raise_priority(g, &hash, priority);
            }
            let parent = (i > 0).then(|| seq.hashes[i - 1]);
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            pools
                .cache
                .insert(g, b, CacheEntry::new(hash, parent, seq.namespace, tokens));
            pools.set_retention(b, priority);
            if pools.record_events {
                let mut ev = seq.stored_event(g as u32, parent, 1, bs, Medium::Gpu);
                ev.block_hashes.push(hash);
                ev.token_ids.extend_from_slice(tokens);
                pools.events.push(KvCacheEvent::BlockStored(ev));
            }
        }
        seq.allocated = true;
        seq.num_computed = plan.claim * bs;
        seq.num_cached_tokens = plan.claim * bs;
        seq.num_tier_tokens = plan.tier_positions * bs;
        seq.num_registered_blocks = plan.claim;
        if let Some(t) = pools.tier.as_mut() {
            t.stats.hits += (plan.tier_positions * bs) as u64;
        }
        if pools.caching {
            pools.counters.prefix_cache_queries += seq.prompt_len as u64;
            // GPU hits only; host-tier hits are counted by the tier.
            pools.counters.prefix_cache_hits += ((plan.claim - plan.tier_positions) * bs) as u64;
        }
        Some(())
    }
}
