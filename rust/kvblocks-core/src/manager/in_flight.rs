//! Prefix blocks being computed right now: reserved by `allocate_slots`, not yet committed.
//!
//! A block enters the prefix cache only at `commit`, after the model wrote its KV, so a
//! sequence admitted in the same step as the sequence computing its prefix cannot share
//! it. Registering blocks at allocation instead (vLLM v1) would let a hitter read KV that
//! is never written when the writer is aborted, preempted or commits less than it
//! reserved. The manager keeps the cache commit-only and instead tells the scheduler
//! which waiting sequences would hit more of the cache after this step's commits
//! ([`KVCacheManager::probe_in_flight`]), so that it can hold them back one step.
//!
//! Bookkeeping: every sequence with a pending reservation records the range of its
//! table (`Sequence::in_flight`) whose blocks the reservation fills completely and whose
//! hashes are known (prompt blocks, hashed at `add_sequence`, and blocks hashed by
//! earlier commits); the manager counts writers per hash. The range is set by
//! `allocate_slots` and dropped by `commit` (whatever it computed), `free`, and a
//! re-allocation before commit. `fork` and `swap_out` refuse sequences with a pending
//! reservation, and `reset_prefix_cache` succeeds only when no block is referenced, so
//! none of them meets a non-empty range.

use std::ops::Range;

use rustc_hash::FxHashMap;

use super::KVCacheManager;
use crate::block_hash::BlockHash;
use crate::error::{KvError, Result};
use crate::sequence::Sequence;

/// Number of pending reservations that fill each block hash.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct InFlight {
    writers: FxHashMap<BlockHash, u32>,
}

impl InFlight {
    /// Whether some pending reservation fills a block with content `hash`.
    #[inline]
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.writers.contains_key(hash)
    }

    /// Number of distinct hashes in flight.
    #[inline]
    pub fn len(&self) -> usize {
        self.writers.len()
    }

    /// The writer counts (for the invariant check).
    pub fn writers(&self) -> &FxHashMap<BlockHash, u32> {
        &self.writers
    }

    fn add(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            *self.writers.entry(*h).or_insert(0) += 1;
        }
    }

    fn remove(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(n) = self.writers.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.writers.remove(h);
                }
            } else {
                debug_assert!(false, "in-flight hash removed twice");
            }
        }
    }

    /// Drop a sequence's range (it committed, was freed or re-allocates).
    #[inline]
    pub fn untrack(&mut self, seq: &mut Sequence) {
        if seq.in_flight.is_empty() {
            // The usual decode step: its one token fills no block, so nothing is tracked.
            seq.in_flight = 0..0;
            return;
        }
        let range = std::mem::take(&mut seq.in_flight);
        if let Some(hashes) = seq.hashes.get(range) {
            self.remove(hashes);
        }
    }
}

/// The table range whose blocks a reservation of `num_new_tokens` fills completely and
/// whose hashes are known: from the first block not yet offered to the prefix cache to
/// the last block the new tokens fill. Lookahead slots are not counted: what the model
/// writes there is a draft, not the KV of known tokens.
pub(super) fn reserved_range(seq: &Sequence, num_new_tokens: usize, bs: usize) -> Range<usize> {
    let end = ((seq.num_computed + num_new_tokens) / bs).min(seq.hashes.len());
    let start = seq.num_registered_blocks.min(end);
    start..end
}

impl KVCacheManager {
    /// Record the blocks the pending reservation of `slot` fills (replacing any earlier
    /// range of the same sequence).
    pub(super) fn track_in_flight(&mut self, slot: usize, num_new_tokens: usize) {
        let seq = &mut self.slots[slot];
        self.in_flight.untrack(seq);
        if !self.pools.caching {
            return;
        }
        let range = reserved_range(seq, num_new_tokens, self.config.block_size);
        if range.is_empty() {
            return; // untrack left it empty
        }
        if let Some(hashes) = seq.hashes.get(range.clone()) {
            self.in_flight.add(hashes);
            seq.in_flight = range;
        }
    }

    /// For each waiting sequence, the prompt tokens right past its cached prefix that
    /// other sequences are computing now: `block_size` times the number of consecutive
    /// blocks after the hit `num_computed_tokens` reports whose content (same chain of
    /// hashes, same cache salt and LoRA id) a pending reservation fills completely, never
    /// counting the prompt's last token (like the hit), and ending on a checkpoint boundary
    /// of every recurrent-state group (a hit must). These blocks enter the prefix
    /// cache if their writers commit them; a scheduler may hold the sequence back a step
    /// to claim them instead of computing them again. 0 with prefix caching off.
    ///
    /// Read-only; ids may repeat. Errors, checked in order: `UnknownSequence`,
    /// `SequenceState` (swapped, or already allocated: its prefix was claimed).
    pub fn probe_in_flight(&self, seq_ids: &[u64]) -> Result<Vec<i64>> {
        let bs = self.config.block_size;
        let mut out = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            let seq = self.seq(id)?;
            Self::require_resident(seq, "probe_in_flight")?;
            if seq.allocated {
                return Err(KvError::SequenceState(format!(
                    "probe_in_flight: sequence {id} already has slots (its cached prefix was \
                     claimed); only waiting sequences can be probed"
                )));
            }
            if self.in_flight.len() == 0 {
                out.push(0);
                continue;
            }
            let hit = self.pools.probe(&seq.hashes, seq.probe_cap_blocks);
            let max_hit = (seq.prompt_len.saturating_sub(1) / bs).min(seq.hashes.len());
            let more = seq.hashes[hit.min(max_hit)..max_hit]
                .iter()
                .take_while(|h| self.in_flight.contains(h))
                .count();
            out.push((self.state_boundary(hit, more) * bs) as i64);
        }
        Ok(out)
    }

    /// Of `more` blocks in flight past a hit of `hit` blocks, those a hit can take once
    /// they are committed: with recurrent-state groups the hit must end on a checkpoint
    /// boundary of each (the longest such end at or below `hit + more`, if past `hit`).
    fn state_boundary(&self, hit: usize, more: usize) -> usize {
        if !self.pools.recurrent || more == 0 {
            return more;
        }
        let mut end = hit + more;
        loop {
            let before = end;
            for every in self
                .pools
                .groups
                .iter()
                .filter_map(|g| g.checkpoint_every_blocks())
            {
                end -= end % every;
            }
            if end == before {
                return end.saturating_sub(hit);
            }
        }
    }

    /// The in-flight counts match the sequences' recorded ranges, and each range is what
    /// its pending reservation fills.
    pub(super) fn check_in_flight(&self) -> Result<()> {
        let mut expected: FxHashMap<BlockHash, u32> = FxHashMap::default();
        for seq in &self.slots {
            let range = &seq.in_flight;
            if range.is_empty() {
                continue;
            }
            let id = seq.id;
            let Some(reserved) = seq.reserved else {
                return Err(KvError::InvariantViolation(format!(
                    "sequence {id}: blocks {range:?} in flight without a pending reservation"
                )));
            };
            if seq.swapped
                || !self.pools.caching
                || range.start != seq.num_registered_blocks
                || range.end > seq.hashes.len()
                || range.end * self.config.block_size > reserved.min(seq.tokens.len())
            {
                return Err(KvError::InvariantViolation(format!(
                    "sequence {id}: in-flight blocks {range:?} are not what its reservation \
                     of {reserved} slots fills ({} registered blocks, {} hashes, swapped = {})",
                    seq.num_registered_blocks,
                    seq.hashes.len(),
                    seq.swapped
                )));
            }
            for h in &seq.hashes[range.clone()] {
                *expected.entry(*h).or_insert(0) += 1;
            }
        }
        if &expected != self.in_flight.writers() {
            return Err(KvError::InvariantViolation(format!(
                "in-flight writer counts ({} hashes) differ from the pending reservations' \
                 ranges ({} hashes)",
                self.in_flight.len(),
                expected.len()
            )));
        }
        Ok(())
    }
}
