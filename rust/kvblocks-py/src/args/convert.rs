//! The conversions behind the argument newtypes: one Python value (named `name` in
//! messages) to one Rust value.

use numpy::{Element, PyArray1, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyList, PyString, PyTuple};

use crate::errors::invalid_argument;

/// Largest sequence id plus one: ids are non-negative `int64` values.
pub(crate) const SEQ_ID_END: i128 = 1 << 63;
/// Largest token id plus one: tokens are `uint32` values.
pub(crate) const TOKEN_ID_END: i128 = 1 << 32;
/// Bound for counts (tokens, blocks): anything that fits an `int64`.
pub(crate) const COUNT_END: i128 = 1 << 63;
/// Most elements pre-allocated from an iterable's `__len__` (beyond it, the vector grows).
const PREALLOC_HINT_MAX: usize = 1 << 16;

/// One Python int in `[lo, hi)`; bools and non-ints are rejected.
pub(crate) fn int_in(obj: &Bound<'_, PyAny>, name: &str, lo: i128, hi: i128) -> PyResult<i128> {
    let value = scalar_int(obj, name)?;
    check_range(value, name, lo, hi)?;
    Ok(value)
}

/// A sequence id (`[0, 2**63)`).
pub(crate) fn seq_id(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    Ok(int_in(obj, name, 0, SEQ_ID_END)? as u64)
}

/// A LoRA id (any `uint64`).
pub(crate) fn lora_id(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    Ok(int_in(obj, name, 0, 1 << 64)? as u64)
}

/// A retention priority (`0..=100`), as the core's checked newtype.
pub(crate) fn retention_priority(
    obj: &Bound<'_, PyAny>,
    name: &str,
) -> PyResult<kvblocks_core::RetentionPriority> {
    let value = scalar_int(obj, name)?;
    i64::try_from(value)
        .ok()
        .and_then(|v| kvblocks_core::RetentionPriority::new(v).ok())
        .ok_or_else(|| invalid_argument(format!("{name} must be in [0, 100], got {value}")))
}

/// A non-negative count that fits `usize`.
pub(crate) fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let value = int_in(obj, name, 0, COUNT_END)?;
    usize::try_from(value)
        .map_err(|_| invalid_argument(format!("{name} = {value} does not fit this platform")))
}

fn scalar_int(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid_argument(format!(
            "{name} must be an int, got a bool"
        )));
    }
    if let Ok(v) = obj.extract::<i64>() {
        return Ok(i128::from(v));
    }
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(i128::from(v));
    }
    // NumPy integer scalars are not `int` subclasses but support `__index__`; arrays
    // define it too but raise from it unless they hold one integer, so ask it.
    if obj.is_instance_of::<PyInt>() || obj.call_method0("__index__").is_ok() {
        let text = obj.str().map(|s| s.to_string()).unwrap_or_default();
        return Err(invalid_argument(format!(
            "{name} = {text} is out of range (expected a 64-bit integer)"
        )));
    }
    Err(invalid_argument(format!(
        "{name} must be an int, got {}",
        type_name(obj)
    )))
}

fn check_range(value: i128, name: &str, lo: i128, hi: i128) -> PyResult<()> {
    if value < lo || value >= hi {
        return Err(invalid_argument(format!(
            "{name} must be in [{lo}, {hi}), got {value}"
        )));
    }
    Ok(())
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_string())
}

/// Target element types of [`int_vec`]: converted from any NumPy integer type with a range check.
pub(crate) trait IntTarget: Copy {
    /// The value as this type; the caller checked the range.
    fn from_i128(v: i128) -> Self;
    /// The value as this type; the caller checked the range.
    fn from_i64(v: i64) -> Self;
}

macro_rules! int_target {
    ($($t:ty),*) => {$(
        impl IntTarget for $t {
            #[inline]
            fn from_i128(v: i128) -> Self {
                v as $t
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    )*};
}
int_target!(u32, u64, i64);

/// The usual case of [`copy_array`]: a contiguous `int64` array and bounds that fit
/// `int64`, checked and converted without widening each value to `i128` (ids of a
/// thousand sequences go through here several times per scheduler step).
fn copy_contiguous_i64<T: IntTarget>(
    arr: &Bound<'_, PyUntypedArray>,
    name: &str,
    lo: i128,
    hi: i128,
    out: &mut Vec<T>,
) -> PyResult<bool> {
    let (Ok(lo64), Ok(last64)) = (i64::try_from(lo), i64::try_from(hi - 1)) else {
        return Ok(false);
    };
    let Ok(typed) = arr.cast::<PyArray1<i64>>() else {
        return Ok(false);
    };
    let view = typed.readonly();
    let Ok(slice) = view.as_slice() else {
        return Ok(false);
    };
    if let Some(bad) = slice.iter().find(|&&x| x < lo64 || x > last64) {
        return Err(invalid_argument(format!(
            "every entry of {name} must be in [{lo}, {hi}), got {bad}"
        )));
    }
    out.extend(slice.iter().map(|&x| T::from_i64(x)));
    Ok(true)
}

/// Copy a NumPy array of element type `S` into `out`, checking every value's range.
fn copy_array<S, T>(
    arr: &Bound<'_, PyUntypedArray>,
    name: &str,
    lo: i128,
    hi: i128,
    out: &mut Vec<T>,
) -> PyResult<bool>
where
    S: Element + Copy + Into<i128>,
    T: IntTarget,
{
    let Ok(typed) = arr.cast::<PyArray1<S>>() else {
        return Ok(false);
    };
    let view = typed.readonly();
    let in_range = |x: &S| {
        let v: i128 = (*x).into();
        lo <= v && v < hi
    };
    let report = |x: &S| {
        let v: i128 = (*x).into();
        invalid_argument(format!(
            "every entry of {name} must be in [{lo}, {hi}), got {v}"
        ))
    };
    // Validate first, then convert: two tight loops the compiler can vectorise.
    match view.as_slice() {
        Ok(slice) => {
            if let Some(bad) = slice.iter().find(|x| !in_range(x)) {
                return Err(report(bad));
            }
            out.extend(slice.iter().map(|&x| T::from_i128(x.into())));
        }
        Err(_) => {
            let array = view.as_array();
            if let Some(bad) = array.iter().find(|x| !in_range(x)) {
                return Err(report(bad));
            }
            out.extend(array.iter().map(|&x| T::from_i128(x.into())));
        }
    }
    Ok(true)
}

/// A 1-D integer array (any NumPy integer dtype) or a sequence of ints as a `Vec<T>`
/// with every value in `[lo, hi)`.
pub(crate) fn int_vec<T: IntTarget>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    lo: i128,
    hi: i128,
) -> PyResult<Vec<T>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(invalid_argument(format!(
                "{name} must be a 1-D array, got {} dimensions",
                arr.ndim()
            )));
        }
        let mut out = Vec::with_capacity(arr.len());
        if arr.is_empty() {
            // `np.array([])` is float64; an empty array of any dtype is an empty list.
            return Ok(out);
        }
        let done = copy_contiguous_i64::<T>(arr, name, lo, hi, &mut out)?
            || copy_array::<i64, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<i32, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<u32, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<u64, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<i16, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<u16, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<i8, T>(arr, name, lo, hi, &mut out)?
            || copy_array::<u8, T>(arr, name, lo, hi, &mut out)?;
        if !done {
            return Err(invalid_argument(format!(
                "{name} must have an integer dtype, got {}",
                arr.dtype().str().map(|s| s.to_string()).unwrap_or_default()
            )));
        }
        return Ok(out);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Err(invalid_argument(format!(
            "{name} must be a sequence of ints, got {}",
            type_name(obj)
        )));
    }
    // Lists and tuples are read in place, without the generic iterator protocol.
    if let Ok(list) = obj.cast::<PyList>() {
        return ints_in(list.iter(), list.len(), name, lo, hi);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return ints_in(tuple.iter(), tuple.len(), name, lo, hi);
    }
    let Ok(iter) = obj.try_iter() else {
        return Err(invalid_argument(format!(
            "{name} must be a 1-D integer array or a sequence of ints, got {}",
            type_name(obj)
        )));
    };
    // `__len__` is only a hint (it can lie, or not exist): pre-allocate within reason.
    let len = obj.len().unwrap_or(0).min(PREALLOC_HINT_MAX);
    ints_in(iter, len, name, lo, hi)
}

/// Collect Python ints from `items` (about `len` of them), each in `[lo, hi)`.
fn ints_in<'py, T, I, R>(items: I, len: usize, name: &str, lo: i128, hi: i128) -> PyResult<Vec<T>>
where
    T: IntTarget,
    I: Iterator<Item = R>,
    R: IntoItem<'py>,
{
    let mut out = Vec::with_capacity(len);
    for item in items {
        let v = scalar_int(&item.into_item()?, name)?;
        if v < lo || v >= hi {
            return Err(invalid_argument(format!(
                "every entry of {name} must be in [{lo}, {hi}), got {v}"
            )));
        }
        out.push(T::from_i128(v));
    }
    Ok(out)
}

/// An item of a list/tuple (always present) or of a generic iterator (may fail).
trait IntoItem<'py> {
    fn into_item(self) -> PyResult<Bound<'py, PyAny>>;
}

impl<'py> IntoItem<'py> for Bound<'py, PyAny> {
    #[inline]
    fn into_item(self) -> PyResult<Bound<'py, PyAny>> {
        Ok(self)
    }
}

impl<'py> IntoItem<'py> for PyResult<Bound<'py, PyAny>> {
    #[inline]
    fn into_item(self) -> PyResult<Bound<'py, PyAny>> {
        self
    }
}

/// A 1-D array (or sequence) of non-negative ints as `usize` indices.
pub(crate) fn indices(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let values: Vec<u64> = int_vec(obj, name, 0, COUNT_END)?;
    values
        .into_iter()
        .map(|v| {
            usize::try_from(v).map_err(|_| invalid_argument(format!("{name}: {v} is too large")))
        })
        .collect()
}

/// Sequence ids of a batch call.
pub(crate) fn seq_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    int_vec(obj, name, 0, SEQ_ID_END)
}

/// Token ids (`uint32`).
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    int_vec(obj, name, 0, TOKEN_ID_END)
}

/// A per-sequence integer argument: an int for every sequence, or one value each.
pub(crate) enum PerSeq {
    /// The same value for every sequence.
    Scalar(i64),
    /// One value per sequence (length checked by the core).
    Each(Vec<i64>),
}

impl PerSeq {
    /// Parse an int or a 1-D integer array/sequence with values in `[lo, hi)`.
    pub(crate) fn extract(
        obj: &Bound<'_, PyAny>,
        name: &str,
        lo: i128,
        hi: i128,
    ) -> PyResult<Self> {
        if obj.is_instance_of::<PyInt>()
            || (obj.hasattr("__index__")? && !obj.hasattr("__len__")?)
        {
            return Ok(PerSeq::Scalar(int_in(obj, name, lo, hi)? as i64));
        }
        Ok(PerSeq::Each(int_vec(obj, name, lo, hi)?))
    }

    /// The core's view of this argument.
    pub(crate) fn as_batch_arg(&self) -> kvblocks_core::BatchArg<'_> {
        match self {
            PerSeq::Scalar(v) => kvblocks_core::BatchArg::Scalar(*v),
            PerSeq::Each(v) => kvblocks_core::BatchArg::Each(v),
        }
    }
}

/// A per-sequence count: an int for every sequence or one per sequence, each `>= 0`.
pub(crate) fn per_seq_count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<PerSeq> {
    PerSeq::extract(obj, name, 0, COUNT_END)
}

/// A per-sequence token: a token id for every sequence or one per sequence, where a
/// negative value means no token.
pub(crate) fn per_seq_token(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<PerSeq> {
    PerSeq::extract(obj, name, -(1 << 63), TOKEN_ID_END)
}

/// A `bool` (NumPy booleans included); ints and other truthy objects are rejected.
pub(crate) fn flag(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    obj.extract::<bool>()
        .map_err(|_| invalid_argument(format!("{name} must be a bool, got {}", type_name(obj))))
}

/// A `str`'s UTF-8: one with a lone surrogate (`"\ud800"`) has none, and would raise
/// Python's `UnicodeEncodeError`, not a `KVBlocksError`.
fn utf8<'a>(s: &'a Bound<'_, PyString>, name: &str) -> PyResult<std::borrow::Cow<'a, str>> {
    s.to_cow().map_err(|_| {
        invalid_argument(format!(
            "{name} must be a str encodable as UTF-8, got one with a lone surrogate"
        ))
    })
}

/// A `str`.
pub(crate) fn text(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => Ok(utf8(s, name)?.into_owned()),
        Err(_) => Err(invalid_argument(format!(
            "{name} must be a str, got {}",
            type_name(obj)
        ))),
    }
}

/// A real number (`float` or `int`; bools rejected).
pub(crate) fn real(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyString>() {
        return Err(invalid_argument(format!(
            "{name} must be a float, got {}",
            type_name(obj)
        )));
    }
    obj.extract::<f64>()
        .map_err(|_| invalid_argument(format!("{name} must be a float, got {}", type_name(obj))))
}

/// A cache salt: `str` (UTF-8 encoded) or `bytes` (`None` is handled by `Option`).
pub(crate) fn cache_salt(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(utf8(s, "cache_salt")?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(invalid_argument(format!(
        "cache_salt must be str, bytes or None, got {}",
        type_name(obj)
    )))
}
