//! `GroupSpec`: the attention of one KV cache group, as a frozen Python class.

use kvblocks_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::args::{names, Count};
use crate::errors::{invalid_argument, IntoPyResult};

/// The attention of one KV cache group's layers: which past tokens they see.
#[pyclass(frozen, eq, hash, module = "kvblocks._core")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GroupSpec {
    pub(crate) inner: core::GroupSpec,
}

#[pymethods]
impl GroupSpec {
    /// Full attention: a query sees every earlier token.
    #[staticmethod]
    fn full_attention() -> Self {
        GroupSpec {
            inner: core::GroupSpec::FullAttention,
        }
    }

    /// A sliding window of ``window`` tokens: a query at ``p`` sees ``[p - window + 1, p]``.
    #[staticmethod]
    fn sliding_window(window: Count<names::Window>) -> PyResult<Self> {
        let inner = core::GroupSpec::SlidingWindow { window: window.0 };
        inner.validate().py_err()?;
        Ok(GroupSpec { inner })
    }

    /// Chunked local attention: a query at ``p`` sees its own chunk, ``[p // chunk * chunk, p]``.
    #[staticmethod]
    fn chunked_local_attention(chunk: Count<names::Chunk>) -> PyResult<Self> {
        let inner = core::GroupSpec::ChunkedLocalAttention { chunk: chunk.0 };
        inner.validate().py_err()?;
        Ok(GroupSpec { inner })
    }

    /// vLLM's ``kv_cache_spec_kind``: ``"full_attention"``, ``"sliding_window"`` or
    /// ``"chunked_local_attention"``.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    /// The window in tokens of a sliding-window group, else ``None``.
    #[getter]
    fn window(&self) -> Option<usize> {
        self.inner.sliding_window()
    }

    /// The chunk in tokens of a chunked local group, else ``None``.
    #[getter]
    fn chunk(&self) -> Option<usize> {
        self.inner.chunk_size()
    }

    /// The first position a query at ``position`` (or later) attends to.
    fn first_visible(&self, position: Count<names::Position>) -> usize {
        self.inner.first_visible(position.0)
    }

    fn __repr__(&self) -> String {
        match self.inner {
            core::GroupSpec::FullAttention => "GroupSpec.full_attention()".to_string(),
            core::GroupSpec::SlidingWindow { window } => {
                format!("GroupSpec.sliding_window({window})")
            }
            core::GroupSpec::ChunkedLocalAttention { chunk } => {
                format!("GroupSpec.chunked_local_attention({chunk})")
            }
        }
    }
}

/// `groups`: a list or tuple of `GroupSpec`.
pub(crate) struct GroupSpecs(pub(crate) Vec<core::GroupSpec>);

impl<'a, 'py> FromPyObject<'a, 'py> for GroupSpecs {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let wrong = || {
            invalid_argument(format!(
                "groups must be a list or tuple of kvblocks.GroupSpec, got {}",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        };
        let items: Vec<Bound<'py, PyAny>> = if let Ok(list) = obj.cast::<PyList>() {
            list.iter().collect()
        } else if let Ok(tuple) = obj.cast::<PyTuple>() {
            tuple.iter().collect()
        } else {
            return Err(wrong());
        };
        if items.is_empty() {
            return Err(invalid_argument(
                "groups must name at least one group (or be None for one full-attention group)"
                    .to_string(),
            ));
        }
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let Ok(spec) = item.cast::<GroupSpec>() else {
                return Err(invalid_argument(format!(
                    "groups[{i}] must be a kvblocks.GroupSpec, got {}",
                    item.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                )));
            };
            out.push(spec.get().inner);
        }
        Ok(GroupSpecs(out))
    }
}
