//! `paged_decode_attention`: the core's CPU decode kernel on NumPy arrays.
//!
//! The CPU ops pass zero-copy NumPy views of their torch tensors (`tensor.numpy()`), so
//! the kernel reads the paged cache where it lives. Shapes are checked here (the core
//! checks lengths and ranges), the output may share memory with no input, and the GIL is
//! released while the kernel runs.

use numpy::{
    Element, PyReadonlyArray, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3,
    PyReadonlyArray4, PyReadwriteArray3, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::{invalid_argument, IntoPyResult};

/// A C-contiguous array's elements, or an `InvalidArgumentError` naming it.
fn slice<'a, T: Element, D: numpy::ndarray::Dimension>(
    array: &'a PyReadonlyArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a [T]> {
    // `as_slice` also accepts a Fortran-ordered array, whose elements it would hand over
    // in the wrong order: only C order is read.
    let c_order = array.is_c_contiguous();
    match array.as_slice() {
        Ok(data) if c_order => Ok(data),
        _ => Err(invalid_argument(format!("{name} must be C-contiguous"))),
    }
}

/// The byte range `[start, end)` a slice covers.
fn span<T>(data: &[T]) -> (usize, usize) {
    let start = data.as_ptr() as usize;
    (start, start + std::mem::size_of_val(data))
}

/// Decode attention of one query per sequence over the paged cache, into ``out``.
#[pyfunction]
#[pyo3(signature = (
    out, query, key_cache, value_cache, block_tables, seq_lens, *, scale,
    sliding_window = None, soft_cap = None, sinks = None, threads = 1,
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode_attention(
    py: Python<'_>,
    mut out: PyReadwriteArray3<'_, f32>,
    query: PyReadonlyArray3<'_, f32>,
    key_cache: PyReadonlyArray4<'_, f32>,
    value_cache: PyReadonlyArray4<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    sliding_window: Option<usize>,
    soft_cap: Option<f32>,
    sinks: Option<PyReadonlyArray1<'_, f32>>,
    threads: usize,
) -> PyResult<()> {
    let cache_shape = key_cache.shape();
    let (num_kv_heads, block_size, head_size) = (cache_shape[1], cache_shape[2], cache_shape[3]);
    if value_cache.shape() != cache_shape {
        return Err(invalid_argument(format!(
            "value_cache {:?} and key_cache {cache_shape:?} differ in shape",
            value_cache.shape()
        )));
    }
    let query_shape = query.shape();
    let num_seqs = query_shape[0];
    if query_shape[2] != head_size || out.shape() != query_shape {
        return Err(invalid_argument(format!(
            "query {query_shape:?} and out {:?} must be [num_seqs, num_heads, {head_size}]",
            out.shape()
        )));
    }
    if block_tables.shape()[0] != num_seqs || seq_lens.shape()[0] != num_seqs {
        return Err(invalid_argument(format!(
            "block_tables {:?} and seq_lens {:?} must have {num_seqs} rows",
            block_tables.shape(),
            seq_lens.shape()
        )));
    }
    let batch = kvblocks_core::DecodeBatch {
        query: slice(&query, "query")?,
        key_cache: slice(&key_cache, "key_cache")?,
        value_cache: slice(&value_cache, "value_cache")?,
        block_tables: slice(&block_tables, "block_tables")?,
        seq_lens: slice(&seq_lens, "seq_lens")?,
    };
    let sinks = match &sinks {
        Some(array) => Some(slice(array, "sinks")?),
        None => None,
    };
    if !out.is_c_contiguous() {
        return Err(invalid_argument("out must be C-contiguous".to_owned()));
    }
    let out = out
        .as_slice_mut()
        .map_err(|_| invalid_argument("out must be C-contiguous".to_owned()))?;
    let (lo, hi) = span(out);
    let inputs = [
        span(batch.query),
        span(batch.key_cache),
        span(batch.value_cache),
    ];
    let others = [
        span(batch.block_tables),
        span(batch.seq_lens),
        sinks.map_or((0, 0), span),
    ];
    if !out.is_empty() && inputs.iter().chain(&others).any(|&(a, b)| a < hi && lo < b) {
        return Err(invalid_argument(
            "out must not share memory with an input".to_owned(),
        ));
    }
    let shape = kvblocks_core::PagedShape {
        num_heads: query_shape[1],
        num_kv_heads,
        head_size,
        block_size,
    };
    let params = kvblocks_core::AttentionParams {
        scale,
        sliding_window,
        soft_cap,
        sinks,
    };
    py.detach(|| kvblocks_core::paged_decode_attention(out, &batch, shape, &params, threads))
        .py_err()
}
