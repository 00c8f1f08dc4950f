//! `gather_row_prefixes`: the ragged row gather behind FlashInfer's CSR page list.

use numpy::{PyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::args::{names, Indices, IntTable};
use crate::errors::{invalid_argument, IntoPyResult};
use crate::manager::to_numpy;

/// ``table[rows[i], :counts[i]]`` for every ``i``, concatenated (int32); ``rows`` defaults
/// to ``0, 1, ..., len(counts) - 1``. ``table`` must be a C-contiguous 2-D int32 array;
/// an ``(N, 0)`` one has ``N`` rows of no pages.
#[pyfunction]
#[pyo3(signature = (table, counts, rows = None))]
pub(crate) fn gather_row_prefixes<'py>(
    py: Python<'py>,
    table: IntTable<'py>,
    counts: Indices<names::Counts>,
    rows: Option<Indices<names::Rows>>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    // The shape, not the length: a (N, 0) table has N (empty) rows.
    let shape = [table.0.shape()[0], table.0.shape()[1]];
    let data = table
        .0
        .as_slice()
        .map_err(|e| invalid_argument(format!("table: {e}")))?;
    let rows = rows.map(|r| r.0);
    let out =
        kvblocks_core::gather_row_prefixes(data, shape, rows.as_deref(), &counts.0).py_err()?;
    Ok(to_numpy(py, out))
}
