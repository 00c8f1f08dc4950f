//! `BatchAllocation`: what `allocate_slots_batch` did, as NumPy arrays.

use numpy::PyArray1;
use pyo3::prelude::*;

/// What one ``allocate_slots_batch`` call did for the sequences it served.
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct BatchAllocation {
    num_served: usize,
    num_cached_tokens: Py<PyArray1<i64>>,
    block_ids: Py<PyArray1<i32>>,
    block_indptr: Py<PyArray1<i64>>,
}

impl BatchAllocation {
    /// Wrap the core's result; the arrays are built once, here.
    pub(crate) fn new(py: Python<'_>, a: kvblocks_core::BatchAllocation) -> Self {
        BatchAllocation {
            num_served: a.num_served,
            num_cached_tokens: crate::manager::to_numpy(py, a.num_cached_tokens).unbind(),
            block_ids: crate::manager::to_numpy(py, a.block_ids).unbind(),
            block_indptr: crate::manager::to_numpy(py, a.block_indptr).unbind(),
        }
    }
}

#[pymethods]
impl BatchAllocation {
    /// Sequences served: the first ``num_served`` of the batch, in order.
    #[getter]
    fn num_served(&self) -> usize {
        self.num_served
    }

    /// int64 [num_served]: cached prompt tokens each served sequence claimed in this call
    /// (non-zero only on a sequence's first allocation).
    #[getter]
    fn num_cached_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.num_cached_tokens.bind(py).clone()
    }

    /// int32: block ids taken from the free pool, sequence after sequence (per sequence
    /// as ``allocate_slots`` returns them).
    #[getter]
    fn block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.block_ids.bind(py).clone()
    }

    /// int64 [num_served + 1]: sequence ``i`` got
    /// ``block_ids[block_indptr[i]:block_indptr[i + 1]]``.
    #[getter]
    fn block_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.block_indptr.bind(py).clone()
    }

    fn __repr__(&self) -> String {
        format!("BatchAllocation(num_served={})", self.num_served)
    }
}
