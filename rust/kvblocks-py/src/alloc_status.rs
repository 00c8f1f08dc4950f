//! `AllocStatus`, the answer of `can_allocate`, as a Python enum-like class.

use pyo3::prelude::*;

/// Answer of :meth:`KVCacheManager.can_allocate`: ``OK``, ``LATER`` or ``NEVER``.
#[pyclass(eq, eq_int, frozen, hash, module = "kvblocks._core")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum AllocStatus {
    /// Enough free blocks now, with the watermark kept free.
    #[pyo3(name = "OK")]
    Ok = 0,
    /// Not enough free blocks now; may fit once others finish.
    #[pyo3(name = "LATER")]
    Later = 1,
    /// Can never fit: the sequence needs more blocks than the pool minus the watermark.
    #[pyo3(name = "NEVER")]
    Never = 2,
}

impl From<kvblocks_core::AllocStatus> for AllocStatus {
    fn from(status: kvblocks_core::AllocStatus) -> Self {
        match status {
            kvblocks_core::AllocStatus::Ok => AllocStatus::Ok,
            kvblocks_core::AllocStatus::Later => AllocStatus::Later,
            kvblocks_core::AllocStatus::Never => AllocStatus::Never,
        }
    }
}
