//! Byte-string arguments: block hashes, cache salts, and the host-tier slots they sit in.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyString};

use super::convert;
use crate::errors::invalid_argument;

/// `block_hashes`: a sequence of `bytes` digests, copied out.
pub(crate) struct BlockHashes(pub(crate) Vec<Vec<u8>>);

impl<'a, 'py> FromPyObject<'a, 'py> for BlockHashes {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
            // A str iterates as characters: "" would be a chain of no blocks.
            return Err(invalid_argument(format!(
                "block_hashes must be a sequence of bytes, not one {} object",
                obj.get_type().name()?
            )));
        }
        let Ok(items) = obj.try_iter() else {
            return Err(invalid_argument(format!(
                "block_hashes must be a sequence of bytes, got {}",
                obj.get_type().name()?
            )));
        };
        let mut digests: Vec<Vec<u8>> = Vec::new();
        for item in items {
            let item = item?;
            let Ok(b) = item.cast::<PyBytes>() else {
                return Err(invalid_argument(format!(
                    "block hashes must be bytes, got {}",
                    item.get_type().name()?
                )));
            };
            digests.push(b.as_bytes().to_vec());
        }
        Ok(BlockHashes(digests))
    }
}

/// `cache_salt`: `str` (UTF-8 encoded) or `bytes`; `Option<CacheSalt>` takes `None`.
pub(crate) struct CacheSalt(pub(crate) Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheSalt {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        convert::cache_salt(&obj).map(CacheSalt)
    }
}

/// `slots`: host-tier slot ids to look up. Any int is accepted (one beyond `int64`
/// becomes -1): ids out of range name no slot and answer `None`, not an error.
pub(crate) struct SlotIds(pub(crate) Vec<i64>);

impl<'a, 'py> FromPyObject<'a, 'py> for SlotIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
            return Err(invalid_argument(
                "slots must be a sequence of ints".to_string(),
            ));
        }
        let Ok(items) = obj.try_iter() else {
            return Err(invalid_argument(format!(
                "slots must be a sequence of ints, got {}",
                obj.get_type().name()?
            )));
        };
        let mut ids = Vec::new();
        for item in items {
            let item = item?;
            if item.is_instance_of::<PyBool>() {
                // An int subclass: True would name slot 1.
                return Err(invalid_argument("slots must be ints, got bool".to_string()));
            }
            ids.push(match item.extract::<i64>() {
                Ok(id) => id,
                // An int beyond i64 names no slot either.
                Err(_) if item.is_instance_of::<PyInt>() => -1,
                Err(_) => {
                    return Err(invalid_argument(format!(
                        "slots must be ints, got {}",
                        item.get_type().name()?
                    )))
                }
            });
        }
        Ok(SlotIds(ids))
    }
}
