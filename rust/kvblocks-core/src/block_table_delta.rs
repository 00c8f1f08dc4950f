//! The result of `sync_block_table`: what changed in a caller-kept block table.

use crate::error::{KvError, Result};
use crate::NULL_BLOCK;

/// Entries written into a caller's persistent `[num_rows, num_cols]` block table by one
/// `sync_block_table` call, in CSR form, so a device copy can be patched with the same
/// writes (a scatter) instead of being uploaded whole.
///
/// Entry `k` says: row `rows[k]` gets `block_ids[indptr[k]..indptr[k + 1]]` at columns
/// `start_cols[k]..`; if `reset[k]`, every column past those ids is the null block (the
/// row was written whole: its sequence was not synced to that row before). Rows without
/// a change are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTableDelta {
    /// Row of each written entry.
    pub rows: Vec<i32>,
    /// First column written.
    pub start_cols: Vec<i32>,
    /// `len(rows) + 1` offsets into `block_ids`.
    pub indptr: Vec<i64>,
    /// The block ids written, entry after entry.
    pub block_ids: Vec<i32>,
    /// Whether the rest of the row (past the written ids) was reset to the null block.
    pub reset: Vec<bool>,
}

impl BlockTableDelta {
    /// Number of rows written.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when nothing was written.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Apply the writes to a row-major `[num_rows, num_cols]` table (what an engine does
    /// to its copy). `InvalidArgument`, with `table` unchanged, if the table is not
    /// `num_rows * num_cols` long or an entry does not fit it.
    pub fn apply(&self, table: &mut [i32], num_rows: usize, num_cols: usize) -> Result<()> {
        let n = self.rows.len();
        let bad = || KvError::InvalidArgument("block table delta does not fit the table".into());
        if self.start_cols.len() != n
            || self.reset.len() != n
            || self.indptr.len() != n + 1
            || Some(table.len()) != num_rows.checked_mul(num_cols)
        {
            return Err(bad());
        }
        let mut spans = Vec::with_capacity(n);
        for k in 0..n {
            let row = usize::try_from(self.rows[k]).map_err(|_| bad())?;
            let start = usize::try_from(self.start_cols[k]).map_err(|_| bad())?;
            let lo = usize::try_from(self.indptr[k]).map_err(|_| bad())?;
            let hi = usize::try_from(self.indptr[k + 1]).map_err(|_| bad())?;
            if row >= num_rows
                || lo > hi
                || hi > self.block_ids.len()
                || start + (hi - lo) > num_cols
            {
                return Err(bad());
            }
            spans.push((row * num_cols, start, lo, hi));
        }
        for (k, (base, start, lo, hi)) in spans.into_iter().enumerate() {
            let row = &mut table[base..base + num_cols];
            let end = start + (hi - lo);
            row[start..end].copy_from_slice(&self.block_ids[lo..hi]);
            if self.reset[k] {
                row[..start].fill(NULL_BLOCK as i32);
                row[end..].fill(NULL_BLOCK as i32);
            }
        }
        Ok(())
    }
}
