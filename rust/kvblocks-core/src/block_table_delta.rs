//! The result of `sync_block_table`: what changed in a caller-kept block table.

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
}
