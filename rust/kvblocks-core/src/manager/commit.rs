//! Committing computed tokens: prefix-cache registration and sliding-window release.

use super::KVCacheManager;
use crate::batch_arg::BatchArg;
use crate::block_hash::BlockHash;
use crate::error::{KvError, Result};
use crate::events::{BlockStored, KvCacheEvent};
use crate::host_tier::{Medium, OffloadPolicy};
use crate::prefix_cache::CacheEntry;
use crate::NULL_BLOCK;

impl KVCacheManager {
    /// The model wrote KV for `num_new_computed_tokens` more tokens; append sampled tokens.
    ///
    /// The computed count may not exceed the reserved slots nor the tokens known before
    /// the call (`InvalidArgument`). Full blocks enter the prefix cache; with a sliding
    /// window, blocks wholly outside it are released. Clears the pending reservation.
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
        Ok(())
    }

    /// Apply a validated commit.
    fn apply_commit(&mut self, slot: usize, n: usize, new_tokens: &[u32]) {
        let bs = self.config.block_size;
        let pools = &mut self.pools;
        let seq = &mut self.slots[slot];
        // The reservation ends here, whatever it computed: blocks it did not fill are
        // no longer being written.
        self.in_flight.untrack(seq);
        seq.tokens.extend_from_slice(new_tokens);
        seq.num_computed += n;
        seq.reserved = None;
        let full = seq.num_computed / bs;
        if pools.caching && full > seq.num_registered_blocks {
            self.hasher.extend_chain(
                &mut seq.hashes,
                &seq.namespace.clone(),
                &seq.tokens[..full * bs],
                bs,
            );
            let max_block = seq.table[seq.num_registered_blocks..full]
                .iter()
                .copied()
                .max()
                .unwrap_or(NULL_BLOCK);
            pools
                .cache
                .reserve(full - seq.num_registered_blocks, max_block);
            let mut run: Option<BlockStored> = None;
            for i in seq.num_registered_blocks..full {
                let hash = seq.hashes[i];
                let block = seq.table[i];
                let fresh = block != NULL_BLOCK
                    && pools.cache.lookup(&hash).is_none()
                    && !pools.cache.is_cached(block);
                if !fresh {
                    // Duplicate content: the cache keeps the block it already maps to;
                    // this one stays uncached. A gap ends the run of consecutive blocks.
                    if let Some(b) = pools.cache.lookup(&hash) {
                        pools.raise_retention(b, &hash, seq.retention);
                    }
                    if let Some(ev) = run.take() {
                        pools.events.push(KvCacheEvent::BlockStored(ev));
                    }
                    continue;
                }
                let parent: Option<BlockHash> = (i > 0).then(|| seq.hashes[i - 1]);
                let tokens = &seq.tokens[i * bs..(i + 1) * bs];
                pools
                    .cache
                    .insert(block, CacheEntry::new(hash, parent, seq.namespace, tokens));
                pools.set_retention(block, seq.retention);
                if pools
                    .tier
                    .as_ref()
                    .is_some_and(|t| t.policy == OffloadPolicy::WriteThrough)
                {
                    pools.offload(block, hash, seq.retention, || {
                        let mut ev = seq.stored_event(parent, 1, bs, Medium::Cpu);
                        ev.token_ids.extend_from_slice(tokens);
                        ev
                    });
                }
                if !pools.record_events {
                    continue;
                }
                // A run holds at most the blocks left to register: size it once.
                let ev: &mut BlockStored =
                    run.get_or_insert_with(|| seq.stored_event(parent, full - i, bs, Medium::Gpu));
                ev.block_hashes.push(hash);
                ev.token_ids.extend_from_slice(tokens);
            }
            if let Some(ev) = run {
                pools.events.push(KvCacheEvent::BlockStored(ev));
            }
        }
        if full > seq.num_registered_blocks {
            seq.num_registered_blocks = full;
        }
        if let Some(window) = self.config.sliding_window {
            // Block i is outside every future query's window once
            // (i + 1) * bs <= computed - window + 1.
            let outside = ((seq.num_computed + 1).saturating_sub(window) / bs).min(seq.table.len());
            if outside > seq.num_released_blocks {
                for i in (seq.num_released_blocks..outside).rev() {
                    let b = std::mem::replace(&mut seq.table[i], NULL_BLOCK);
                    pools.release_gpu(b);
                }
                seq.dirty_from = seq.dirty_from.min(seq.num_released_blocks);
                seq.num_released_blocks = outside;
            }
        }
    }
}
