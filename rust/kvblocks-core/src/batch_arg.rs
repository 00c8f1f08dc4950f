//! Per-sequence integer arguments of the batch methods.

use crate::error::{KvError, Result};

/// An integer argument of a batch call: one value for every sequence, or one per sequence.
///
/// Values are `i64` so that NumPy `int64` arrays can be handed over without conversion;
/// the manager validates ranges (negative counts are [`KvError::InvalidArgument`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchArg<'a> {
    /// The same value for every sequence of the batch.
    Scalar(i64),
    /// One value per sequence; the length must equal the number of sequences.
    Each(&'a [i64]),
}

impl BatchArg<'_> {
    /// Fail unless this argument fits a batch of `n` sequences.
    pub(crate) fn check_len(&self, n: usize, what: &str) -> Result<()> {
        match self {
            BatchArg::Scalar(_) => Ok(()),
            BatchArg::Each(v) if v.len() == n => Ok(()),
            BatchArg::Each(v) => Err(KvError::InvalidArgument(format!(
                "{what} has {} entries, expected one per sequence ({n})",
                v.len()
            ))),
        }
    }

    /// The value for entry `i` (length checked beforehand by `check_len`).
    #[inline]
    pub(crate) fn get(&self, i: usize) -> i64 {
        match self {
            BatchArg::Scalar(x) => *x,
            BatchArg::Each(v) => v[i],
        }
    }
}

impl From<i64> for BatchArg<'_> {
    fn from(x: i64) -> Self {
        BatchArg::Scalar(x)
    }
}

impl<'a> From<&'a [i64]> for BatchArg<'a> {
    fn from(v: &'a [i64]) -> Self {
        BatchArg::Each(v)
    }
}
