//! Block-table arguments: the table an in-place update writes, the rows it writes, and
//! the read-only table `gather_row_prefixes` reads.

use numpy::{
    PyArray2, PyArray3, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray2, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::convert;
use crate::errors::invalid_argument;

/// `block_table`: a C-contiguous, writeable 2-D int32 NumPy array (`[max_rows, max_blocks]`).
pub(crate) struct WritableTable<'py>(pub(crate) Bound<'py, PyArray2<i32>>);

impl<'a, 'py> FromPyObject<'a, 'py> for WritableTable<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let arr = writable_int32(&obj, "block_table", 2, "[max_rows, max_blocks]")?;
        let Ok(table) = arr.cast::<PyArray2<i32>>() else {
            return Err(invalid_argument(
                "block_table must have dtype int32".to_string(),
            ));
        };
        Ok(WritableTable(table.to_owned()))
    }
}

impl WritableTable<'_> {
    /// `(num_rows, num_cols)` of the table.
    pub(crate) fn dims(&self) -> (usize, usize) {
        let shape = self.0.shape();
        (shape[0], shape[1])
    }
}

/// `block_tables`: a C-contiguous, writeable 3-D int32 NumPy array, one table per KV
/// cache group (`[num_groups, max_rows, max_blocks]`).
pub(crate) struct WritableTables<'py>(pub(crate) Bound<'py, PyArray3<i32>>);

impl<'a, 'py> FromPyObject<'a, 'py> for WritableTables<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let arr = writable_int32(
            &obj,
            "block_tables",
            3,
            "[num_groups, max_rows, max_blocks]",
        )?;
        let Ok(table) = arr.cast::<PyArray3<i32>>() else {
            return Err(invalid_argument(
                "block_tables must have dtype int32".to_string(),
            ));
        };
        Ok(WritableTables(table.to_owned()))
    }
}

/// Check that `obj` (the argument `name`) is a C-contiguous, writeable int32 NumPy array
/// of `ndim` dimensions (`shape` says which, for the message).
fn writable_int32<'a, 'py>(
    obj: &Borrowed<'a, 'py, PyAny>,
    name: &str,
    ndim: usize,
    shape: &str,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let Ok(arr) = obj.cast::<PyUntypedArray>() else {
        return Err(invalid_argument(format!(
            "{name} must be a NumPy int32 array, got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )));
    };
    if arr.ndim() != ndim {
        return Err(invalid_argument(format!(
            "{name} must be {ndim}-D {shape}, got {} dimensions",
            arr.ndim()
        )));
    }
    if !arr.dtype().is_equiv_to(&numpy::dtype::<i32>(obj.py())) {
        return Err(invalid_argument(format!(
            "{name} must have dtype int32, got {}",
            arr.dtype().str().map(|s| s.to_string()).unwrap_or_default()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(format!(
            "{name} must be C-contiguous (a row-major array, not a view with strides)"
        )));
    }
    // SAFETY: `arr` is a live NumPy array, so its object (and its fields, which is how
    // the `numpy` crate itself reads the writeable flag) is valid to read.
    let flags =
        unsafe { (*numpy::npyffi::objects::_PyArray_GET_ITEM_DATA(arr.as_array_ptr())).flags };
    if flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
        return Err(invalid_argument(format!(
            "{name} must be writeable (got a read-only array)"
        )));
    }
    Ok(arr.to_owned())
}

/// `rows`: the table row of each sequence, a 1-D integer array or a sequence of ints.
///
/// Their bound is the table's row count, which another argument gives (the table's
/// shape, or `max_rows`), so conversion waits for [`RowIndices::parse`].
pub(crate) struct RowIndices<'a, 'py>(Borrowed<'a, 'py, PyAny>);

impl<'a, 'py> FromPyObject<'a, 'py> for RowIndices<'a, 'py> {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(RowIndices(obj))
    }
}

impl RowIndices<'_, '_> {
    /// The rows, each in `[0, num_rows)`.
    pub(crate) fn parse(&self, num_rows: usize) -> PyResult<Vec<i64>> {
        convert::int_vec(&self.0, "rows", 0, num_rows as i128)
    }
}

/// `table` of `gather_row_prefixes`: a C-contiguous 2-D int32 NumPy array, borrowed
/// read-only for the call.
pub(crate) struct IntTable<'py>(pub(crate) PyReadonlyArray2<'py, i32>);

impl<'a, 'py> FromPyObject<'a, 'py> for IntTable<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let Ok(arr) = obj.cast::<PyUntypedArray>() else {
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
        Ok(IntTable(typed.readonly()))
    }
}
