//! `StateMapping`: where a step reads and writes a recurrent group's states, as NumPy
//! arrays.

use numpy::PyArray1;
use pyo3::prelude::*;

/// Where one step reads and writes the states of one recurrent-state group (see
/// ``KVCacheManager.state_mapping``), in CSR form.
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct StateMapping {
    read_blocks: Py<PyArray1<i64>>,
    write_indptr: Py<PyArray1<i64>>,
    write_positions: Py<PyArray1<i64>>,
    write_blocks: Py<PyArray1<i64>>,
}

impl StateMapping {
    /// Wrap the core's result; the arrays are built once, here.
    pub(crate) fn new(py: Python<'_>, s: kvblocks_core::StateMapping) -> Self {
        use crate::manager::to_numpy;
        StateMapping {
            read_blocks: to_numpy(py, s.read_blocks).unbind(),
            write_indptr: to_numpy(py, s.write_indptr).unbind(),
            write_positions: to_numpy(py, s.write_positions).unbind(),
            write_blocks: to_numpy(py, s.write_blocks).unbind(),
        }
    }
}

#[pymethods]
impl StateMapping {
    /// int64 [S]: the block holding each sequence's state after its computed tokens, or
    /// ``-1`` before any token is computed (start from the zero state).
    #[getter]
    fn read_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.read_blocks.bind(py).clone()
    }

    /// int64 [S + 1]: sequence ``i`` writes entries ``write_indptr[i]:write_indptr[i + 1]``.
    #[getter]
    fn write_indptr<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.write_indptr.bind(py).clone()
    }

    /// int64: the tokens each saved state covers (the state after tokens ``[0, p)``),
    /// ascending per sequence; a sequence's last one ends its reserved tokens.
    #[getter]
    fn write_positions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.write_positions.bind(py).clone()
    }

    /// int64: the block each state is saved in.
    #[getter]
    fn write_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.write_blocks.bind(py).clone()
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.read_blocks.bind(py).len().unwrap_or(0)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StateMapping(num_seqs={}, num_writes={})",
            self.read_blocks.bind(py).len().unwrap_or(0),
            self.write_blocks.bind(py).len().unwrap_or(0)
        )
    }
}
