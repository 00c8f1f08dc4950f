//! A scheduler's steady decode step in one call: allocate one token per sequence, sync
//! the caller's block table and report each token's cache slot
//! ([`KVCacheManager::allocate_decode_step`]).
//!
//! The same work as `allocate_slots_batch`, `sync_block_table` and `slot_mapping` in
//! turn, but the batch is resolved and validated once and no intermediate arrays cross
//! the binding: at a thousand sequences per step the separate calls' repeated passes over
//! the same sequences are a large part of the step.

use super::KVCacheManager;
use crate::batch_arg::BatchArg;
use crate::block_table_delta::BlockTableDelta;
use crate::error::{KvError, Result};
use crate::NULL_BLOCK;

/// What [`KVCacheManager::allocate_decode_step`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeStep {
    /// Sequences served, the first `num_served` of the batch (as
    /// [`crate::BatchAllocation::num_served`]).
    pub num_served: usize,
    /// When every sequence was served and the table could take their tables: the writes
    /// into the table and each sequence's cache slot (`block * block_size + offset`) of
    /// the token at its position (-1 when the group is a recurrent-state group, as
    /// `slot_mapping`). `None`: nothing was synced.
    pub synced: Option<(BlockTableDelta, Vec<i64>)>,
}

impl KVCacheManager {
    /// One decode step of `seq_ids`: `allocate_slots_batch(seq_ids, 1,
    /// num_lookahead_tokens)`; then, if that served every sequence, `sync_block_table(seq_ids,
    /// rows, num_rows, num_cols, None, false)` and the cache slot of each sequence's token
    /// at `positions[i]` (what `slot_mapping(seq_ids, 1)` gives when `positions[i]` is the
    /// sequence's next token).
    ///
    /// When the pool runs short the call serves the leading sequences it can, exactly as
    /// `allocate_slots_batch` does, and syncs nothing; so also when a sequence's table would
    /// be wider than `num_cols` or a position's block lies past it (the caller widens its
    /// table and syncs with `sync_block_table`). Either way `synced` is `None`.
    ///
    /// Errors, checked before anything changes: `InvalidArgument` for a manager with more
    /// than one KV cache group, `positions` or `rows` not one per sequence, a row outside
    /// `[0, num_rows)` or listed twice, a position in no block the sequence holds once
    /// served (see [`KVCacheManager::check_decode_positions`]); and those of
    /// `allocate_slots_batch`.
    pub fn allocate_decode_step(
        &mut self,
        seq_ids: &[u64],
        num_lookahead_tokens: usize,
        rows: &[i64],
        num_rows: usize,
        num_cols: usize,
        positions: &[usize],
    ) -> Result<DecodeStep> {
        if self.pools.groups.len() != 1 {
            return Err(KvError::InvalidArgument(format!(
                "allocate_decode_step syncs one block table; this manager has {} KV cache \
                 groups (use allocate_slots_batch and sync_group_block_tables)",
                self.pools.groups.len()
            )));
        }
        if positions.len() != seq_ids.len() {
            return Err(KvError::InvalidArgument(format!(
                "positions has {} entries, expected one per sequence ({})",
                positions.len(),
                seq_ids.len()
            )));
        }
        Self::check_table_rows(rows, seq_ids.len(), num_rows)?;
        let slots = self.batch_slots(seq_ids)?;
        let bs = self.config.block_size;
        let stateful = self.pools.groups[0].is_recurrent();
        let mut fits = true;
        let mut total = 0usize;
        for (i, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
            let slot = slot as usize;
            self.validate_allocation(slot, 1, num_lookahead_tokens)?;
            let seq = &self.slots[slot];
            let t = &seq.tables[0];
            // The table's length once served (as `plan_allocation` counts it; the usual
            // case without its pool lookups), and its first held entry then.
            let (len, first) = if seq.allocated {
                let reserved = seq.num_computed + 1 + num_lookahead_tokens;
                (reserved.div_ceil(bs).max(t.blocks.len()), t.num_released)
            } else {
                let (plan, _) = self.plan_allocation(slot, 1, num_lookahead_tokens);
                let claimed = self.pools.hit_range(0, plan.claim).start;
                (plan.claim + plan.append, claimed)
            };
            if !stateful {
                Self::check_decode_position(seq.id, i, pos, bs, first..len)?;
            }
            fits &= len <= num_cols && pos / bs < num_cols;
            total += len.saturating_sub(t.dirty_from);
        }
        if !fits {
            let done =
                self.allocate_slots_batch(seq_ids, BatchArg::Scalar(1), num_lookahead_tokens)?;
            return Ok(DecodeStep {
                num_served: done.num_served,
                synced: None,
            });
        }
        let mut taken = Vec::new();
        let mut num_served = 0;
        for &slot in &slots {
            if self
                .serve_allocation(slot as usize, 1, num_lookahead_tokens, &mut taken)
                .is_none()
            {
                break;
            }
            num_served += 1;
        }
        if num_served < slots.len() {
            return Ok(DecodeStep {
                num_served,
                synced: None,
            });
        }
        // The row holds the sequence's table padded with the null block: read the slot
        // from the table itself. A recurrent-state group keeps no per-token KV: its slots
        // are -1, as `slot_mapping` gives them (its table's blocks hold states).
        let mut out = Vec::with_capacity(slots.len());
        let delta = self.write_rows(0, &slots, rows, false, total, |i, blocks| {
            if stateful {
                out.push(-1);
                return;
            }
            let pos = positions[i];
            let block = blocks.get(pos / bs).copied().unwrap_or(NULL_BLOCK);
            out.push(block as i64 * bs as i64 + (pos % bs) as i64);
        });
        Ok(DecodeStep {
            num_served,
            synced: Some((delta, out)),
        })
    }

    /// `InvalidArgument` unless every `positions[i]` lies in a block the group-0 table of
    /// `seq_ids[i]` holds now (from its first unreleased entry to its end): the check
    /// `update_decode_block_table` makes before syncing, after the step's allocation.
    /// Past the table (or in a released window block) the caller's row holds the null
    /// block, so the slot read from it would send the token's K/V to the null block, to
    /// be lost. A recurrent-state group 0 keeps no per-token KV (its slots are -1): no
    /// position is checked then.
    ///
    /// Errors: those of the check; `UnknownSequence`; `InvalidArgument` when `positions`
    /// is not one per sequence.
    pub fn check_decode_positions(&mut self, seq_ids: &[u64], positions: &[usize]) -> Result<()> {
        if positions.len() != seq_ids.len() {
            return Err(KvError::InvalidArgument(format!(
                "positions has {} entries, expected one per sequence ({})",
                positions.len(),
                seq_ids.len()
            )));
        }
        if self.pools.groups[0].is_recurrent() {
            return Ok(());
        }
        let bs = self.config.block_size;
        let slots = self.batch_slots(seq_ids)?;
        for (i, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
            let seq = &self.slots[slot as usize];
            let t = &seq.tables[0];
            Self::check_decode_position(seq.id, i, pos, bs, t.num_released..t.blocks.len())?;
        }
        Ok(())
    }

    /// `InvalidArgument` unless block `pos / bs` is in `held` (the entries of sequence
    /// `seq_id`'s table that hold blocks).
    fn check_decode_position(
        seq_id: u64,
        i: usize,
        pos: usize,
        bs: usize,
        held: std::ops::Range<usize>,
    ) -> Result<()> {
        let block = pos / bs;
        if held.contains(&block) {
            return Ok(());
        }
        Err(KvError::InvalidArgument(format!(
            "positions[{i}] = {pos} is in block {block} of sequence {seq_id}, which holds \
             blocks {}..{} (of {bs} tokens): its slot would be the null block's",
            held.start, held.end
        )))
    }
}
