//! Step inputs: block tables (whole and persistent), their deltas, slot and state
//! mappings.

use kvblocks_core as core;
use numpy::ndarray::Array3;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::args::{
    names, Count, Flag, Indices, PerSeqCounts, RowIndices, SeqId, SeqIds, WritableTable,
    WritableTables,
};
use crate::block_table_delta::BlockTableDelta;
use crate::errors::{invalid_argument, IntoPyResult};

use super::{group_of, matrix_to_numpy, to_numpy, GroupArg, KVCacheManager, Work};

impl KVCacheManager {
    /// The core sync without a buffer (the caller applies the delta with the GIL held);
    /// `rows` are checked against `num_rows` here, the one bound they have.
    #[allow(clippy::too_many_arguments)]
    fn sync(
        &self,
        py: Python<'_>,
        group: usize,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        num_rows: usize,
        num_cols: usize,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<core::BlockTableDelta> {
        let ids = seq_ids.0;
        let rows = rows.parse(num_rows)?;
        let full = full.is_some_and(|f| f.0);
        self.run(py, Work::for_batch(ids.len()), |m| {
            m.sync_group_block_table(group, &ids, &rows, num_rows, num_cols, None, full)
        })
        .py_err()
    }

    /// The core sync of every group without a buffer, as [`Self::sync`].
    fn sync_groups(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        num_rows: usize,
        num_cols: usize,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<Vec<core::BlockTableDelta>> {
        let ids = seq_ids.0;
        let rows = rows.parse(num_rows)?;
        let full = full.is_some_and(|f| f.0);
        self.run(py, Work::for_batch(ids.len()), |m| {
            m.sync_group_block_tables(&ids, &rows, num_rows, num_cols, None, full)
        })
        .py_err()
    }
}

#[pymethods]
impl KVCacheManager {
    // -- step inputs ---------------------------------------------------------------

    /// The sequence's block table of ``group``.
    #[pyo3(signature = (seq_id, *, group = None), text_signature = "(self, seq_id, *, group=0)")]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqId,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let group = group_of(group);
        let table = self.on_seq(py, seq_id, Work::Short, |m, id| {
            m.group_block_table(id, group)
        })?;
        Ok(to_numpy(py, table))
    }

    /// 2-D block tables of ``group``, padded with the null block to the longest (or
    /// ``max_blocks``).
    #[pyo3(
        signature = (seq_ids, *, max_blocks = None, group = None),
        text_signature = "(self, seq_ids, *, max_blocks=None, group=0)"
    )]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        max_blocks: Option<Count<names::MaxBlocks>>,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = seq_ids.0;
        let max_blocks = max_blocks.map(|b| b.0);
        let group = group_of(group);
        let tables = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.group_block_tables(&ids, max_blocks, Some(group))
            })
            .py_err()?;
        matrix_to_numpy(py, tables.num_rows, tables.num_cols, tables.data)
    }

    /// Block tables of every group, ``[num_groups, len(seq_ids), max_blocks]``.
    #[pyo3(signature = (seq_ids, *, max_blocks = None))]
    fn group_block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        max_blocks: Option<Count<names::MaxBlocks>>,
    ) -> PyResult<Bound<'py, PyArray3<i32>>> {
        let ids = seq_ids.0;
        let max_blocks = max_blocks.map(|b| b.0);
        let tables = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.group_block_tables(&ids, max_blocks, None)
            })
            .py_err()?;
        let shape = (tables.num_groups, tables.num_rows, tables.num_cols);
        Array3::from_shape_vec(shape, tables.data)
            .map(|a| a.into_pyarray(py))
            .map_err(|e| invalid_argument(format!("internal error: {e}")))
    }

    /// Bring rows ``rows[i]`` of a persistent int32 ``[max_rows, max_blocks]`` table of
    /// ``group`` up to date with the block tables of ``seq_ids[i]``, in place; returns
    /// what was written.
    #[pyo3(
        signature = (block_table, seq_ids, rows, *, full = None, group = None),
        text_signature = "(self, block_table, seq_ids, rows, *, full=None, group=0)"
    )]
    fn update_block_table(
        &self,
        py: Python<'_>,
        block_table: WritableTable<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        full: Option<Flag<names::Full>>,
        group: GroupArg,
    ) -> PyResult<BlockTableDelta> {
        let (num_rows, num_cols) = block_table.dims();
        let table = block_table.0;
        let delta = self.sync(py, group_of(group), seq_ids, rows, num_rows, num_cols, full)?;
        // SAFETY: `WritableTable` checked that the array is C-contiguous and writeable.
        // The GIL is held from here to the end of the write, so no Python code can touch
        // the buffer meanwhile, and no Rust view of it exists in this call.
        let data = unsafe { table.as_slice_mut() }
            .map_err(|e| invalid_argument(format!("block_table: {e}")))?;
        // The core checked every written entry against this shape.
        delta.apply(data, num_rows, num_cols).py_err()?;
        Ok(BlockTableDelta::new(py, delta))
    }

    /// ``update_block_table`` of group 0 for a step of decodes, and the cache slot of
    /// each sequence's token at ``positions[i]`` read from its row just written: one call
    /// for what the scheduler's decode-only step otherwise gathers in NumPy.
    fn update_decode_block_table<'py>(
        &self,
        py: Python<'py>,
        block_table: WritableTable<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        positions: Indices<names::Positions>,
    ) -> PyResult<(BlockTableDelta, Bound<'py, PyArray1<i64>>)> {
        let (num_rows, num_cols) = block_table.dims();
        let table = block_table.0;
        let ids = seq_ids.0;
        let rows = rows.parse(num_rows)?;
        let positions = positions.0;
        if positions.len() != ids.len() {
            return Err(invalid_argument(format!(
                "positions has {} entries, expected one per sequence ({})",
                positions.len(),
                ids.len()
            )));
        }
        let (bs, stateful) = self.read(py, |m| (m.block_size(), m.groups()[0].is_recurrent()));
        // The slots are read from the rows after the sync: check every position's column
        // first, so that a bad position writes and consumes nothing.
        if let Some((i, pos)) = positions
            .iter()
            .enumerate()
            .find(|(_, &p)| p / bs >= num_cols)
        {
            return Err(invalid_argument(format!(
                "positions[{i}] = {pos} is past the table's {num_cols} columns of {bs} tokens"
            )));
        }
        // A position in no block the sequence holds would read the row's null padding:
        // refused before the sync writes or consumes anything.
        let delta = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.check_decode_positions(&ids, &positions)?;
                m.sync_group_block_table(0, &ids, &rows, num_rows, num_cols, None, false)
            })
            .py_err()?;
        // SAFETY: as in `update_block_table`: `WritableTable` checked that the array is
        // C-contiguous and writeable, and the GIL is held until the reads are done.
        let data = unsafe { table.as_slice_mut() }
            .map_err(|e| invalid_argument(format!("block_table: {e}")))?;
        delta.apply(data, num_rows, num_cols).py_err()?;
        let slots: Vec<i64> = rows
            .iter()
            .zip(&positions)
            .map(|(&row, &pos)| {
                // A recurrent-state group keeps no per-token KV: -1, as slot_mapping.
                if stateful {
                    return -1;
                }
                let block = data[row as usize * num_cols + pos / bs] as i64;
                block * bs as i64 + (pos % bs) as i64
            })
            .collect();
        Ok((BlockTableDelta::new(py, delta), to_numpy(py, slots)))
    }

    /// ``allocate_slots_batch(seq_ids, 1)`` and, when it served every sequence,
    /// ``update_decode_block_table``, in one call: a scheduler's steady decode step.
    #[pyo3(
        signature = (block_table, seq_ids, rows, positions, *, num_lookahead_tokens = None),
        text_signature = "(self, block_table, seq_ids, rows, positions, *, num_lookahead_tokens=0)"
    )]
    #[allow(clippy::type_complexity)]
    fn allocate_decode_step<'py>(
        &self,
        py: Python<'py>,
        block_table: WritableTable<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        positions: Indices<names::Positions>,
        num_lookahead_tokens: Option<Count<names::NumLookaheadTokens>>,
    ) -> PyResult<(usize, Option<(BlockTableDelta, Bound<'py, PyArray1<i64>>)>)> {
        let (num_rows, num_cols) = block_table.dims();
        let table = block_table.0;
        let ids = seq_ids.0;
        let rows = rows.parse(num_rows)?;
        let positions = positions.0;
        let lookahead = num_lookahead_tokens.map_or(0, |n| n.0);
        let step = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.allocate_decode_step(&ids, lookahead, &rows, num_rows, num_cols, &positions)
            })
            .py_err()?;
        let Some((delta, slots)) = step.synced else {
            return Ok((step.num_served, None));
        };
        // SAFETY: as in `update_block_table`: `WritableTable` checked that the array is
        // C-contiguous and writeable, and the GIL is held from here to the end of the write.
        let data = unsafe { table.as_slice_mut() }
            .map_err(|e| invalid_argument(format!("block_table: {e}")))?;
        // The core checked every row and every table's width against this shape.
        delta.apply(data, num_rows, num_cols).py_err()?;
        let synced = (BlockTableDelta::new(py, delta), to_numpy(py, slots));
        Ok((step.num_served, Some(synced)))
    }

    /// ``update_block_table`` of every group: ``block_tables`` is int32 ``[num_groups,
    /// max_rows, max_blocks]``, one persistent table per group; one delta per group.
    #[pyo3(signature = (block_tables, seq_ids, rows, *, full = None))]
    fn update_group_block_tables(
        &self,
        py: Python<'_>,
        block_tables: WritableTables<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<Vec<BlockTableDelta>> {
        let tables = block_tables.0;
        let (num_groups, num_rows, num_cols) = {
            let shape = tables.shape();
            (shape[0], shape[1], shape[2])
        };
        let have = self.read(py, |m| m.num_groups());
        if num_groups != have {
            return Err(invalid_argument(format!(
                "block_tables has {num_groups} tables but the manager has {have} KV cache \
                 group(s); expected one table per group"
            )));
        }
        let deltas = self.sync_groups(py, seq_ids, rows, num_rows, num_cols, full)?;
        // SAFETY: `WritableTables` checked that the array is C-contiguous and writeable;
        // the GIL is held until the writes are done (see `update_block_table`).
        let data = unsafe { tables.as_slice_mut() }
            .map_err(|e| invalid_argument(format!("block_tables: {e}")))?;
        let matrix = num_rows * num_cols;
        for (g, delta) in deltas.iter().enumerate() {
            delta
                .apply(&mut data[g * matrix..(g + 1) * matrix], num_rows, num_cols)
                .py_err()?;
        }
        Ok(deltas
            .into_iter()
            .map(|d| BlockTableDelta::new(py, d))
            .collect())
    }

    /// The writes ``update_block_table`` would make to a ``[max_rows, max_blocks]`` table
    /// of ``group`` kept elsewhere (e.g. on a device); consumes the changes the same way.
    #[pyo3(
        signature = (seq_ids, rows, *, max_rows, max_blocks, full = None, group = None),
        text_signature = "(self, seq_ids, rows, *, max_rows, max_blocks, full=None, group=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn block_table_delta(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        max_rows: Count<names::MaxRows>,
        max_blocks: Count<names::MaxBlocks>,
        full: Option<Flag<names::Full>>,
        group: GroupArg,
    ) -> PyResult<BlockTableDelta> {
        let (num_rows, num_cols) = (max_rows.0, max_blocks.0);
        let delta = self.sync(py, group_of(group), seq_ids, rows, num_rows, num_cols, full)?;
        Ok(BlockTableDelta::new(py, delta))
    }

    /// ``block_table_delta`` of every group: one delta per group.
    #[pyo3(signature = (seq_ids, rows, *, max_rows, max_blocks, full = None))]
    fn group_block_table_deltas(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        max_rows: Count<names::MaxRows>,
        max_blocks: Count<names::MaxBlocks>,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<Vec<BlockTableDelta>> {
        let (num_rows, num_cols) = (max_rows.0, max_blocks.0);
        let deltas = self.sync_groups(py, seq_ids, rows, num_rows, num_cols, full)?;
        Ok(deltas
            .into_iter()
            .map(|d| BlockTableDelta::new(py, d))
            .collect())
    }

    /// Cache slots (``block * block_size + offset``) of the tokens computed this step, in
    /// the tables of ``group``.
    #[pyo3(
        signature = (seq_ids, num_tokens = None, *, group = None),
        text_signature = "(self, seq_ids, num_tokens=None, *, group=0)"
    )]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        num_tokens: Option<PerSeqCounts<names::NumTokens>>,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ids = seq_ids.0;
        let counts = num_tokens.map(|n| n.0);
        let group = group_of(group);
        let slots = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.group_slot_mapping(&ids, counts.as_ref().map(|c| c.as_batch_arg()), Some(group))
            })
            .py_err()?;
        Ok(to_numpy(py, slots))
    }

    /// Where the pending step of each sequence reads and writes the states of recurrent
    /// group ``group``: the block holding its state after its computed tokens (``-1``:
    /// none yet, start from zeros), and for its pending reservation every state to save
    /// (each checkpoint boundary crossed, then the state after the reserved tokens).
    #[pyo3(signature = (seq_ids, *, group))]
    fn state_mapping(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        group: Count<names::Group>,
    ) -> PyResult<crate::state_mapping::StateMapping> {
        let ids = seq_ids.0;
        let mapping = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.state_mapping(&ids, group.0)
            })
            .py_err()?;
        Ok(crate::state_mapping::StateMapping::new(py, mapping))
    }

    /// ``slot_mapping`` of every group, ``[num_groups, num_tokens]``.
    #[pyo3(signature = (seq_ids, num_tokens = None))]
    fn group_slot_mappings<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        num_tokens: Option<PerSeqCounts<names::NumTokens>>,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let ids = seq_ids.0;
        let counts = num_tokens.map(|n| n.0);
        let (groups, slots) = self
            .run(py, Work::for_batch(ids.len()), |m| {
                let slots =
                    m.group_slot_mapping(&ids, counts.as_ref().map(|c| c.as_batch_arg()), None)?;
                Ok((m.num_groups(), slots))
            })
            .py_err()?;
        let per_group = slots.len() / groups;
        matrix_to_numpy(py, groups, per_group, slots)
    }
}
