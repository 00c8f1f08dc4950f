//! `Blake3`: the core's BLAKE3 (SIMD, released GIL) for the tiers' weights digests and
//! record MACs, where `hashlib` has nothing as fast (BLAKE2b runs at a fraction of it).

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::invalid_argument;

/// Bytes fed to the hasher without a copy: a `bytes` object or a 1-D uint8 array (a view
/// of a memory map, a tensor's `.numpy()`).
pub(crate) enum HashInput<'py> {
    Bytes(Bound<'py, PyBytes>),
    Array(PyReadonlyArray1<'py, u8>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for HashInput<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            return Ok(Self::Bytes(bytes.to_owned()));
        }
        obj.extract::<PyReadonlyArray1<'py, u8>>()
            .map(Self::Array)
            .map_err(|_| invalid_argument("data must be bytes or a 1-D uint8 array".to_owned()))
    }
}

/// An incremental BLAKE3 hash; keyed (a MAC) when built with a 32-byte ``key``.
#[pyclass(module = "kvblocks._core")]
pub(crate) struct Blake3 {
    inner: blake3::Hasher,
}

#[pymethods]
impl Blake3 {
    #[new]
    #[pyo3(signature = (key = None))]
    fn new(key: Option<&[u8]>) -> PyResult<Self> {
        let inner = match key {
            None => blake3::Hasher::new(),
            Some(key) => {
                let key: &[u8; blake3::KEY_LEN] = key.try_into().map_err(|_| {
                    invalid_argument(format!(
                        "a BLAKE3 key is {} bytes, got {}",
                        blake3::KEY_LEN,
                        key.len()
                    ))
                })?;
                blake3::Hasher::new_keyed(key)
            }
        };
        Ok(Self { inner })
    }

    /// Hash more bytes (the GIL is released while they are read).
    fn update(&mut self, py: Python<'_>, data: HashInput<'_>) -> PyResult<()> {
        let hasher = &mut self.inner;
        match &data {
            HashInput::Bytes(bytes) => {
                let slice = bytes.as_bytes();
                py.detach(|| hasher.update(slice));
            }
            HashInput::Array(array) => {
                let slice = array
                    .as_slice()
                    .map_err(|_| invalid_argument("data must be C-contiguous".to_owned()))?;
                py.detach(|| hasher.update(slice));
            }
        }
        Ok(())
    }

    /// The first ``length`` bytes of the output (32: the standard digest); the hasher
    /// may keep being updated.
    #[pyo3(signature = (length = 32))]
    fn digest<'py>(&self, py: Python<'py>, length: usize) -> PyResult<Bound<'py, PyBytes>> {
        if !(1..=1024).contains(&length) {
            return Err(invalid_argument(format!(
                "length must be in [1, 1024], got {length}"
            )));
        }
        let mut out = vec![0u8; length];
        self.inner.finalize_xof().fill(&mut out);
        Ok(PyBytes::new(py, &out))
    }

    /// An independent hasher in the same state.
    fn copy(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

/// A 32-byte key derived from ``material`` for ``context`` (BLAKE3's key derivation mode;
/// the context names the use, so one secret gives unrelated keys to unrelated uses).
#[pyfunction]
pub(crate) fn blake3_derive_key<'py>(
    py: Python<'py>,
    context: &str,
    material: &[u8],
) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &blake3::derive_key(context, material))
}
