//! Incremental block tables: keeping a caller's persistent table in step with the
//! sequences' tables by writing only what changed.
//!
//! Each sequence remembers the first table entry changed since its last sync
//! (`dirty_from`: appends land past it, copy-on-write, sliding-window releases and
//! swap-in lower it) and the row it was last synced to. The manager remembers which
//! sequence it last wrote into each row. A sync writes a sequence's entries
//! `[dirty_from, len)` when both agree that the row still holds this sequence's table;
//! otherwise (first sync, a new row, a row another sequence was written to since, or
//! `full`) it writes the whole table and pads the rest of the row with the null block.
//! The manager cannot see the caller's memory: a caller that keeps more than one table
//! of a group, or whose table was overwritten behind the manager's back (a new device
//! buffer), passes `full = true`. Each KV cache group has its own table on the caller's
//! side, and the bookkeeping above is kept per group.

use super::KVCacheManager;
use crate::block_table_delta::BlockTableDelta;
use crate::error::{KvError, Result};

impl KVCacheManager {
    /// [`KVCacheManager::sync_group_block_table`] of group 0.
    pub fn sync_block_table(
        &mut self,
        seq_ids: &[u64],
        rows: &[i64],
        num_rows: usize,
        num_cols: usize,
        buffer: Option<&mut [i32]>,
        full: bool,
    ) -> Result<BlockTableDelta> {
        self.sync_group_block_table(0, seq_ids, rows, num_rows, num_cols, buffer, full)
    }

    /// Bring rows `rows[i]` of a persistent `[num_rows, num_cols]` block table of `group`
    /// up to date with the tables of `seq_ids[i]` in that group and report what was
    /// written.
    ///
    /// `buffer` (row-major, `num_rows * num_cols` ids) is written in place when given;
    /// without it only the delta is produced (for a table that lives elsewhere, e.g. on a
    /// device). Either way the changes are consumed: the next sync writes only what
    /// changes after this one.
    ///
    /// Errors, checked before anything is written (nothing changes on error):
    /// `InvalidArgument` (a group out of range, lengths differ, a row outside `[0,
    /// num_rows)`, a row or a sequence listed twice, a buffer of the wrong size, a table
    /// longer than `num_cols`), `UnknownSequence`, `SequenceState` (swapped: its table
    /// holds CPU ids).
    #[allow(clippy::too_many_arguments)]
    pub fn sync_group_block_table(
        &mut self,
        group: usize,
        seq_ids: &[u64],
        rows: &[i64],
        num_rows: usize,
        num_cols: usize,
        buffer: Option<&mut [i32]>,
        full: bool,
    ) -> Result<BlockTableDelta> {
        self.check_group(group)?;
        if let Some(buf) = &buffer {
            // After the rows' length, before their values (the order of the checks).
            if rows.len() == seq_ids.len() && Some(buf.len()) != num_rows.checked_mul(num_cols) {
                return Err(KvError::InvalidArgument(format!(
                    "block table buffer holds {} ids; expected {num_rows} x {num_cols}",
                    buf.len()
                )));
            }
        }
        Self::check_table_rows(rows, seq_ids.len(), num_rows)?;
        let slots = self.batch_slots(seq_ids)?;
        let mut total = 0usize;
        for &slot in &slots {
            let seq = &self.slots[slot as usize];
            Self::require_resident(seq, "sync_block_table")?;
            let t = &seq.tables[group];
            if t.blocks.len() > num_cols {
                return Err(KvError::InvalidArgument(format!(
                    "sequence {} has {} blocks but the block table has {num_cols} columns; \
                     expected a table at least as wide as the longest block table",
                    seq.id,
                    t.blocks.len()
                )));
            }
            total += t.blocks.len() - t.dirty_from;
        }
        let delta = self.write_rows(group, &slots, rows, full, total, |_, _| {});
        if let Some(buf) = buffer {
            // Every entry was checked against the table's shape above.
            delta.apply(buf, num_rows, num_cols)?;
        }
        Ok(delta)
    }

    /// `sync_group_block_table` of every group into one persistent table per group
    /// (`buffers`: `num_groups * num_rows * num_cols` ids, group after group, when
    /// given); one delta per group.
    ///
    /// All or nothing: every group's tables of a sequence have the same length and the
    /// other checks do not depend on the group, so the first group's sync validates them
    /// all before anything is written.
    pub fn sync_group_block_tables(
        &mut self,
        seq_ids: &[u64],
        rows: &[i64],
        num_rows: usize,
        num_cols: usize,
        mut buffers: Option<&mut [i32]>,
        full: bool,
    ) -> Result<Vec<BlockTableDelta>> {
        let num_groups = self.pools.groups.len();
        let matrix = num_rows.checked_mul(num_cols);
        if let Some(buf) = &buffers {
            if Some(buf.len()) != matrix.and_then(|m| m.checked_mul(num_groups)) {
                return Err(KvError::InvalidArgument(format!(
                    "block table buffers hold {} ids; expected {num_groups} x {num_rows} x \
                     {num_cols}",
                    buf.len()
                )));
            }
        }
        let matrix = matrix.unwrap_or(0);
        let mut deltas = Vec::with_capacity(num_groups);
        for g in 0..num_groups {
            let buffer = buffers
                .as_deref_mut()
                .map(|b| &mut b[g * matrix..(g + 1) * matrix]);
            deltas.push(
                self.sync_group_block_table(g, seq_ids, rows, num_rows, num_cols, buffer, full)?,
            );
        }
        Ok(deltas)
    }

    /// `InvalidArgument` unless `rows` has `n` entries, each in `[0, num_rows)` (and an
    /// int32) and none listed twice.
    pub(super) fn check_table_rows(rows: &[i64], n: usize, num_rows: usize) -> Result<()> {
        if rows.len() != n {
            return Err(KvError::InvalidArgument(format!(
                "rows has {} entries for {n} sequence ids; expected one row per sequence",
                rows.len()
            )));
        }
        // Delta rows are int32.
        let row_limit = num_rows.min(i32::MAX as usize);
        let mut max_row = 0usize;
        for &r in rows {
            let Some(row) = usize::try_from(r).ok().filter(|&x| x < row_limit) else {
                return Err(KvError::InvalidArgument(format!(
                    "row {r} is outside the block table's rows [0, {row_limit}) (rows are int32)"
                )));
            };
            max_row = max_row.max(row);
        }
        Self::check_distinct_rows(rows, max_row)
    }

    /// The writes of a validated sync of `group` (sequences in `slots`, rows checked by
    /// [`Self::check_table_rows`], tables no wider than the caller's): each sequence's
    /// entries `[dirty_from, len)`, or its whole table when the row may hold another
    /// table; the changes are consumed. `visit(i, blocks)` sees each sequence's whole
    /// table after its write (what its row now holds), in batch order. `capacity`: the
    /// ids expected, to size the delta.
    pub(super) fn write_rows(
        &mut self,
        group: usize,
        slots: &[u32],
        rows: &[i64],
        full: bool,
        capacity: usize,
        mut visit: impl FnMut(usize, &[u32]),
    ) -> BlockTableDelta {
        let mut delta = BlockTableDelta {
            rows: Vec::new(),
            start_cols: Vec::new(),
            indptr: Vec::with_capacity(slots.len() + 1),
            block_ids: Vec::with_capacity(capacity),
            reset: Vec::new(),
        };
        delta.indptr.push(0);
        for (i, (&slot, &r)) in slots.iter().zip(rows).enumerate() {
            // Validated by the caller: 0 <= r < num_rows <= i32::MAX.
            let row = r as u32;
            let seq = &mut self.slots[slot as usize];
            let id = seq.id;
            let t = &mut seq.tables[group];
            let owners = &mut self.row_owner[group];
            let whole = full || t.synced_row != Some(row) || owners.get(&row) != Some(&id);
            let start = if whole { 0 } else { t.dirty_from };
            let len = t.blocks.len();
            if whole || start < len {
                delta.rows.push(row as i32);
                delta.start_cols.push(start as i32);
                delta
                    .block_ids
                    .extend(t.blocks[start..len].iter().map(|&b| b as i32));
                delta.indptr.push(delta.block_ids.len() as i64);
                delta.reset.push(whole);
            }
            t.dirty_from = len;
            if whole {
                t.synced_row = Some(row);
                owners.insert(row, id);
            }
            visit(i, &t.blocks);
        }
        delta
    }

    /// `InvalidArgument` if a row is listed twice (rows are in `[0, max_row]`).
    fn check_distinct_rows(rows: &[i64], max_row: usize) -> Result<()> {
        let twice = |row: i64| {
            KvError::InvalidArgument(format!(
                "row {row} is listed twice; expected one sequence per row"
            ))
        };
        // A bitmap over the rows used is the cheap case (a table's rows); rows far apart
        // (a huge, sparse table) are sorted instead so memory stays O(len(rows)).
        if max_row / 64 <= rows.len().max(1024) {
            let mut seen = vec![0u64; max_row / 64 + 1];
            for &r in rows {
                let row = r as usize;
                let (word, bit) = (row / 64, 1u64 << (row % 64));
                if seen[word] & bit != 0 {
                    return Err(twice(r));
                }
                seen[word] |= bit;
            }
        } else {
            let mut sorted = rows.to_vec();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(twice(w[0]));
            }
        }
        Ok(())
    }
}
