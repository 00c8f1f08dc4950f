//! Committing computed tokens: prefix-cache registration, sliding-window release and
//! recurrent states kept.

use super::pools::Pools;
use super::KVCacheManager;
use crate::batch_arg::BatchArg;
use crate::block_hash::BlockHash;
use crate::error::{KvError, Result};
use crate::events::{BlockStored, KvCacheEvent};
use crate::group::GroupSpec;
use crate::host_tier::{Medium, OffloadPolicy};
use crate::prefix_cache::CacheEntry;
use crate::sequence::{GroupTable, Sequence};
use crate::NULL_BLOCK;

impl KVCacheManager {
    /// The model wrote KV for `num_new_computed_tokens` more tokens; append sampled tokens.
    ///
    /// The computed count may not exceed the reserved slots nor the tokens known before
    /// the call (`InvalidArgument`). Full blocks enter the prefix cache (in every group);
    /// blocks no future query of a window or chunked group sees are released. Clears the
    /// pending reservation.
    pub fn commit(
        &mut self,
        seq_id: u64,
        num_new_computed_tokens: usize,
        new_token_ids: &[u32],
    ) -> Result<()> {
        let slot = self.slot_of(seq_id)?;
        self.validate_commit(slot, num_new_computed_tokens)?;
        self.apply_commit(slot, num_new_computed_tokens, new_token_ids);
        Ok(())
    }

    /// `commit` for many sequences, at most one new token each (`< 0` means none).
    ///
    /// All-or-nothing: every entry is validated before any sequence changes.
    pub fn commit_batch(
        &mut self,
        seq_ids: &[u64],
        num_new_computed_tokens: BatchArg<'_>,
        new_token_ids: Option<BatchArg<'_>>,
    ) -> Result<()> {
        num_new_computed_tokens.check_len(seq_ids.len(), "num_new_computed_tokens")?;
        if let Some(t) = &new_token_ids {
            t.check_len(seq_ids.len(), "new_token_ids")?;
        }
        let slots = self.batch_slots(seq_ids)?;
        for (i, &slot) in slots.iter().enumerate() {
            let n = Self::count_arg(num_new_computed_tokens.get(i), "num_new_computed_tokens")?;
            self.validate_commit(slot as usize, n)?;
            if let Some(t) = &new_token_ids {
                let tok = t.get(i);
                if tok > u32::MAX as i64 {
                    return Err(KvError::InvalidArgument(format!(
                        "new_token_ids[{i}] = {tok} is not a token id (expected < 2**32, or < 0 \
                         for no token)"
                    )));
                }
            }
        }
        for (i, &slot) in slots.iter().enumerate() {
            let n = num_new_computed_tokens.get(i) as usize;
            let tok = new_token_ids.as_ref().map_or(-1, |t| t.get(i));
            if tok >= 0 {
                self.apply_commit(slot as usize, n, &[tok as u32]);
            } else {
                self.apply_commit(slot as usize, n, &[]);
            }
        }
        Ok(())
    }

    /// Check a commit without changing anything.
    fn validate_commit(&self, slot: usize, n: usize) -> Result<()> {
        let seq = &self.slots[slot];
        Self::require_resident(seq, "commit")?;
        let known = seq.tokens.len();
        let reserved = seq.reserved.unwrap_or(seq.num_computed);
        let limit = reserved.min(known);
        if seq.num_computed.checked_add(n).is_none_or(|c| c > limit) {
            return Err(KvError::InvalidArgument(format!(
                "commit: sequence {} has {} computed tokens, {reserved} reserved slots and \
                 {known} known tokens, so num_new_computed_tokens must be <= {}, got {n}{}",
                seq.id,
                seq.num_computed,
                limit - seq.num_computed,
                if seq.reserved.is_none() && n > 0 {
                    " (call allocate_slots first)"
                } else {
                    ""
                }
            )));
        }
        if self.pools.recurrent {
            // The engine saved the state after the reserved tokens only: a commit of
            // fewer would name a state that is nowhere.
            if let Some(r) = seq
                .reserved
                .filter(|&r| n != 0 && seq.num_computed + n != r)
            {
                return Err(KvError::InvalidArgument(format!(
                    "commit: sequence {} reserved {} tokens after its {} computed ones and the \
                     manager has a recurrent-state group, so num_new_computed_tokens must be \
                     {} (the step ran) or 0 (it did not), got {n}",
                    seq.id,
                    r - seq.num_computed,
                    seq.num_computed,
                    r - seq.num_computed
                )));
            }
        }
        Ok(())
    }

    /// Apply a validated commit.
    fn apply_commit(&mut self, slot: usize, n: usize, new_tokens: &[u32]) {
        let bs = self.config.block_size;
        let seq = &mut self.slots[slot];
        // The reservation ends here, whatever it computed: blocks it did not fill are
        // no longer being written.
        self.in_flight.untrack(seq);
        seq.tokens.extend_from_slice(new_tokens);
        seq.num_computed += n;
        seq.reserved = None;
        let full = seq.num_computed / bs;
        if self.pools.caching && full > seq.num_registered_blocks {
            self.hasher.extend_chain(
                &mut seq.hashes,
                &seq.namespace.clone(),
                &seq.tokens[..full * bs],
                bs,
            );
            for g in 0..seq.tables.len() {
                register_blocks(&mut self.pools, seq, g, full);
            }
        }
        if full > seq.num_registered_blocks {
            seq.num_registered_blocks = full;
        }
        if !self.pools.all_full {
            // Blocks no future query sees go back to the pool: groups last to first, each
            // last block first (the order `free` releases in).
            let pools = &mut self.pools;
            for (g, t) in seq.tables.iter_mut().enumerate().rev() {
                if pools.groups[g].is_recurrent() {
                    release_states(pools, t, seq.num_computed);
                    continue;
                }
                let outside = pools.groups[g]
                    .released_blocks(seq.num_computed, bs)
                    .min(t.blocks.len());
                if outside > t.num_released {
                    for i in (t.num_released..outside).rev() {
                        let b = std::mem::replace(&mut t.blocks[i], NULL_BLOCK);
                        pools.release_gpu(b);
                    }
                    t.dirty_from = t.dirty_from.min(t.num_released);
                    t.num_released = outside;
                }
            }
        }
    }
}

/// A recurrent group's table after a commit keeps only the state after the computed
/// tokens: every other entry (older states, checkpoints just cached, states of a step
/// that did not run) goes back to the pool, last entry first.
fn release_states(pools: &mut Pools, t: &mut GroupTable, computed: usize) {
    let bs = pools.block_size;
    let keep = GroupSpec::state_entry(computed, bs);
    for i in (t.num_released..t.blocks.len()).rev() {
        if Some(i) != keep && t.blocks[i] != NULL_BLOCK {
            let b = std::mem::replace(&mut t.blocks[i], NULL_BLOCK);
            pools.release_gpu(b);
            t.dirty_from = t.dirty_from.min(i);
        }
    }
    t.num_released = keep.unwrap_or(0);
}

/// Offer the sequence's newly full blocks of group `g` (`[num_registered_blocks, full)`)
/// to the prefix cache, with their events and write-through offloads. A recurrent group
/// offers its checkpoint entries only (each holds the state at its block's end).
fn register_blocks(pools: &mut Pools, seq: &Sequence, g: usize, full: usize) {
    let bs = pools.block_size;
    let t = &seq.tables[g];
    let first = seq.num_registered_blocks;
    let max_block = t.blocks[first..full]
        .iter()
        .copied()
        .max()
        .unwrap_or(NULL_BLOCK);
    pools.cache.reserve(g, full - first, max_block);
    let mut run: Option<BlockStored> = None;
    let spec = pools.groups[g];
    for i in first..full {
        if spec.is_recurrent() && !spec.is_checkpoint(i) {
            // No state of this boundary is kept: a gap in the group's chain.
            if let Some(ev) = run.take() {
                pools.events.push(KvCacheEvent::BlockStored(ev));
            }
            continue;
        }
        let hash = seq.hashes[i];
        let block = t.blocks[i];
        if block == NULL_BLOCK || pools.cache.is_cached(block) {
            // Released, or already cached (a claimed hit): a gap ends the run of
            // consecutive blocks.
            if let Some(b) = pools.cache.lookup(g, &hash) {
                pools.raise_retention(g, b, &hash, seq.retention);
            }
            if let Some(ev) = run.take() {
                pools.events.push(KvCacheEvent::BlockStored(ev));
            }
            continue;
        }
        // A block whose content is cached already (computed again) is cached too, as one
        // more copy, like vLLM's block pool: the hash stays hittable while any copy is,
        // and its `BlockStored` is published like any other's.
        let parent: Option<BlockHash> = (i > 0).then(|| seq.hashes[i - 1]);
        let tokens = &seq.tokens[i * bs..(i + 1) * bs];
        pools.cache.insert(
            g,
            block,
            CacheEntry::new(hash, parent, seq.namespace, tokens),
        );
        pools.set_retention(block, seq.retention);
        if pools
            .tier
            .as_ref()
            .is_some_and(|t| t.policy == OffloadPolicy::WriteThrough)
        {
            pools.offload(g, block, hash, seq.retention, || {
                let mut ev = seq.stored_event(g as u32, parent, 1, bs, Medium::Cpu);
                ev.token_ids.extend_from_slice(tokens);
                ev
            });
        }
        if !pools.record_events {
            continue;
        }
        // A run holds at most the blocks left to register: size it once.
        let ev: &mut BlockStored = run
            .get_or_insert_with(|| seq.stored_event(g as u32, parent, full - i, bs, Medium::Gpu));
        ev.block_hashes.push(hash);
        ev.token_ids.extend_from_slice(tokens);
    }
    if let Some(ev) = run {
        pools.events.push(KvCacheEvent::BlockStored(ev));
    }
}
