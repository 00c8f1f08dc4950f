//! `BlockTableDelta`: the writes of one block-table sync, as NumPy arrays.

use numpy::PyArray1;
use pyo3::prelude::*;

/// The block-table entries one ``update_block_table`` / ``block_table_delta`` call wrote.
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct BlockTableDelta {
    len: usize,
    rows: Py<PyArray1<i32>>,
    start_cols: Py<PyArray1<i32>>,
    indptr: Py<PyArray1<i64>>,
    block_ids: Py<PyArray1<i32>>,
    reset: Py<PyArray1<bool>>,
}

impl BlockTableDelta {
    /// Wrap the core's result; the arrays are built once, here.
    pub(crate) fn new(py: Python<'_>, d: kvblocks_core::BlockTableDelta) -> Self {
        use crate::manager::to_numpy;
        BlockTableDelta {
            len: d.rows.len(),
            rows: to_numpy(py, d.rows).unbind(),
            start_cols: to_numpy(py, d.start_cols).unbind(),
            indptr: to_numpy(py, d.indptr).unbind(),
            block_ids: to_numpy(py, d.block_ids).unbind(),
            reset: to_numpy(py, d.reset).unbind(),
        }
    }
}

#[pymethods]
impl BlockTableDelta {
    /// int32 [n]: the rows written (rows without a change are left out).
    #[getter]
    fn rows<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.rows.bind(py).clone()
    }

    /// int32 [n]: first column written in each row.
    #[getter]
    fn start_cols<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.start_cols.bind(py).clone()
    }

    /// int64 [n + 1]: row ``k`` got ``block_ids[indptr[k]:indptr[k + 1]]``.
    #[getter]
    fn indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.indptr.bind(py).clone()
    }

    /// int32: the block ids written, row after row.
    #[getter]
    fn block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.block_ids.bind(py).clone()
    }

    /// bool [n]: the row was written whole: every column outside the written ids is the
    /// null block (a sequence new to the row).
    #[getter]
    fn reset<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        self.reset.bind(py).clone()
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let ids = self.block_ids.bind(py).len().unwrap_or(0);
        format!("BlockTableDelta(rows={}, block_ids={ids})", self.len)
    }
}
