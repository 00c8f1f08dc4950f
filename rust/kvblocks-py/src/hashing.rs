//! `BlockHasher`: the core's block hashing for whole prompts, outside any manager.
//!
//! The core hasher keeps a scratch buffer and namespace caches, so it sits behind a mutex;
//! the locking rule is the manager's (never wait for the mutex while holding the GIL), and
//! long prompts hash with the GIL released.

use kvblocks_core as core;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::args::{names, CacheSalt, Count, LoraId, Parsed, Text, TokenIds};
use crate::errors::IntoPyResult;

/// Prompts of this many tokens hash with the GIL released (as `add_sequence` does).
const DETACH_TOKENS: usize = 2048;

/// Block hashes of prompts, computed exactly as a ``KVCacheManager`` computes them.
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct BlockHasher {
    inner: Mutex<core::BlockHasher>,
    block_size: usize,
}

impl BlockHasher {
    /// Wrap a core hasher (a manager's copy, or a new one).
    pub(crate) fn from_core(hasher: core::BlockHasher, block_size: usize) -> Self {
        BlockHasher {
            inner: Mutex::new(hasher),
            block_size,
        }
    }

    /// Run `f` on the hasher: under the GIL when short and uncontended, else detached.
    fn run<R, F>(&self, py: Python<'_>, long: bool, f: F) -> R
    where
        F: FnOnce(&mut core::BlockHasher) -> R + Send,
        R: Send,
    {
        if !long {
            if let Some(mut guard) = self.inner.try_lock() {
                return f(&mut guard);
            }
        }
        py.detach(|| f(&mut self.inner.lock()))
    }
}

#[pymethods]
impl BlockHasher {
    #[new]
    #[pyo3(
        signature = (block_size, *, hash_algo = None, hash_seed = None),
        text_signature = "(block_size, *, hash_algo='blake3', hash_seed=None)"
    )]
    fn new(
        block_size: Count<names::BlockSize>,
        hash_algo: Option<Parsed<core::HashAlgo, names::HashAlgo>>,
        hash_seed: Option<Text<names::HashSeed>>,
    ) -> PyResult<Self> {
        // A manager's bound: a larger block size gives hashes no manager can emit.
        core::check_block_size(block_size.0).py_err()?;
        let algo = hash_algo.map_or(core::HashAlgo::default(), |a| a.0);
        let seed = match hash_seed {
            Some(seed) => Some(seed.0),
            // As the manager (and vLLM's `init_none_hash`): PYTHONHASHSEED, when set.
            None if algo == core::HashAlgo::Sha256Cbor => std::env::var("PYTHONHASHSEED").ok(),
            None => None,
        };
        let hasher = core::BlockHasher::checked(algo, seed.as_deref()).py_err()?;
        Ok(Self::from_core(hasher, block_size.0))
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// ``"blake3"``, ``"xxh3_128"`` or ``"sha256_cbor"``.
    #[getter]
    fn hash_algo(&self, py: Python<'_>) -> &'static str {
        self.run(py, false, |h| h.algo().as_str())
    }

    /// vLLM's ``NONE_HASH`` with ``sha256_cbor``, else ``None``.
    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        let digest = self.run(py, false, |h| h.none_hash().copied());
        digest.map(|d| PyBytes::new(py, &d))
    }

    /// Map ``lora_id`` to vLLM's LoRA hash key ``(lora_name, lora_path)``; see the stub.
    #[pyo3(signature = (lora_id, lora_name, lora_path = None))]
    fn register_lora(
        &self,
        py: Python<'_>,
        lora_id: LoraId,
        lora_name: Text<names::LoraName>,
        lora_path: Option<Text<names::LoraPath>>,
    ) {
        let (id, name) = (lora_id.0, lora_name.0);
        let path = lora_path.map(|p| p.0).unwrap_or_default();
        self.run(py, false, |h| h.register_lora(id, &name, &path));
    }

    /// Hashes of the prompt's full blocks, in chain order; see the stub.
    #[pyo3(signature = (token_ids, *, cache_salt = None, lora_id = None))]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        token_ids: TokenIds<names::TokenIds>,
        cache_salt: Option<CacheSalt>,
        lora_id: Option<LoraId>,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = token_ids.0;
        let salt = cache_salt.map(|s| s.0);
        let lora = lora_id.map(|l| l.0);
        let bs = self.block_size;
        let hashes = self
            .run(py, tokens.len() >= DETACH_TOKENS, |h| {
                h.prompt_hashes(&tokens, bs, salt.as_deref(), lora)
            })
            .py_err()?;
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "BlockHasher(block_size={}, hash_algo={:?})",
            self.block_size,
            self.hash_algo(py)
        )
    }
}
