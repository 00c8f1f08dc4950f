//! Scalar arguments: counts, flags, reals, strings, retention priorities.

use std::marker::PhantomData;
use std::str::FromStr;

use kvblocks_core::{KvError, RetentionPriority};
use pyo3::prelude::*;

use super::convert::{self, PerSeq};
use super::ArgName;
use crate::errors::IntoPyResult;

named_arg! {
    /// A non-negative count (tokens, blocks) that fits `usize`.
    Count(usize) = convert::count
}

named_arg! {
    /// Non-negative indices or counts: a 1-D integer array or a sequence of ints.
    Indices(Vec<usize>) = convert::indices
}

named_arg! {
    /// A count per sequence: one int for all, or a 1-D array/sequence with one each.
    PerSeqCounts(PerSeq) = convert::per_seq_count
}

named_arg! {
    /// A `bool` (NumPy booleans included); ints and other truthy objects are rejected.
    Flag(bool) = convert::flag
}

named_arg! {
    /// A real number (`float` or `int`; bools rejected).
    Real(f64) = convert::real
}

named_arg! {
    /// A `str`.
    Text(String) = convert::text
}

named_arg! {
    /// A retention priority (`0..=100`), as the core's checked newtype.
    RetentionPriorityArg(RetentionPriority) = convert::retention_priority
}

/// A `str` parsed by the core (`hash_algo`, `host_offload`): a parse failure is the
/// core's error, raised when the argument is converted.
pub(crate) struct Parsed<T, N: ArgName>(pub(crate) T, PhantomData<N>);

impl<'a, 'py, T, N> FromPyObject<'a, 'py> for Parsed<T, N>
where
    T: FromStr<Err = KvError>,
    N: ArgName,
{
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let value = convert::text(&obj, N::NAME)?.parse().py_err()?;
        Ok(Parsed(value, PhantomData))
    }
}
