//! `gather_row_prefixes`: the ragged row gather behind FlashInfer's CSR page list.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::args::{self, COUNT_END};
use crate::errors::{invalid_argument, IntoPyResult};
use crate::manager::to_numpy;

/// ``table[rows[i], :counts[i]]`` for every ``i``, concatenated (int32); ``rows`` defaults
/// to ``0, 1, ..., len(counts) - 1``. ``table`` must be a C-contiguous 2-D int32 array.
#[pyfunction]
#[pyo3(signature = (table, counts, rows = None))]
pub(crate) fn gather_row_prefixes<'py>(
    py: Python<'py>,
    table: &Bound<'py, PyAny>,
    counts: &Bound<'py, PyAny>,
    rows: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let Ok(arr) = table.cast::<PyUntypedArray>() else {
        return Err(invalid_argument(
            "table must be a 2-D NumPy int32 array".to_string(),
        ));
    };
    if arr.ndim() != 2 || !arr.is_c_contiguous() {
        return Err(invalid_argument(format!(
            "table must be a C-contiguous 2-D array (got {} dimensions, contiguous: {})",
            arr.ndim(),
            arr.is_c_contiguous()
        )));
    }
    let Ok(typed) = arr.cast::<PyArray2<i32>>() else {
        return Err(invalid_argument("table must have dtype int32".to_string()));
    };
    let num_cols = arr.shape()[1];
    let counts = indices(counts, "counts")?;
    let rows = match rows {
        Some(r) if !r.is_none() => Some(indices(r, "rows")?),
        _ => None,
    };
    let view = typed.readonly();
    let data = view
        .as_slice()
        .map_err(|e| invalid_argument(format!("table: {e}")))?;
    let out =
        kvblocks_core::gather_row_prefixes(data, num_cols, rows.as_deref(), &counts).py_err()?;
    Ok(to_numpy(py, out))
}

/// A 1-D array (or sequence) of non-negative ints as `usize` indices.
fn indices(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let values: Vec<u64> = args::int_vec(obj, name, 0, COUNT_END)?;
    values
        .into_iter()
        .map(|v| {
            usize::try_from(v).map_err(|_| invalid_argument(format!("{name}: {v} is too large")))
        })
        .collect()
}
