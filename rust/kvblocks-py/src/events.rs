//! KV cache events as frozen Python classes (drained by `take_events`).

use kvblocks_core::{BlockHash, KvCacheEvent};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

fn hashes_to_py<'py>(py: Python<'py>, hashes: &[BlockHash]) -> Vec<Bound<'py, PyBytes>> {
    hashes
        .iter()
        .map(|h| PyBytes::new(py, h.as_bytes()))
        .collect()
}

fn hex(hashes: &[BlockHash]) -> String {
    hashes
        .iter()
        .map(|h| {
            h.as_bytes()
                .iter()
                .take(4)
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// KV cache event: full blocks entered the prefix cache (one event per block run).
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct BlockStored {
    inner: kvblocks_core::BlockStored,
}

#[pymethods]
impl BlockStored {
    /// Hashes of the stored blocks, in chain order.
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        hashes_to_py(py, &self.inner.block_hashes)
    }

    /// Hash of the block before the first stored one; ``None`` for a prompt's first block.
    #[getter]
    fn parent_block_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner
            .parent_block_hash
            .as_ref()
            .map(|h| PyBytes::new(py, h.as_bytes()))
    }

    /// Tokens of all stored blocks, concatenated (``block_size`` per block).
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.inner.token_ids.clone()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }

    /// LoRA adapter of the sequence that stored the blocks.
    #[getter]
    fn lora_id(&self) -> Option<u64> {
        self.inner.lora_id
    }

    /// Name of that LoRA when its id was registered (``register_lora``), else ``None``.
    #[getter]
    fn lora_name(&self) -> Option<&str> {
        self.inner.lora_name.as_deref()
    }

    /// vLLM's ``extra_keys`` as its events carry them (``to_event_extra_keys``): per
    /// block, the untagged keys hashed into it (the LoRA's name on every block of a LoRA
    /// sequence, then the cache salt on the chain's first block) or ``None``; ``None``
    /// as a whole unless ``hash_algo="sha256_cbor"``.
    #[getter]
    fn extra_keys<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        if self.inner.extra_keys.is_none() {
            return Ok(None);
        }
        let list = PyList::empty(py);
        for j in 0..self.inner.block_hashes.len() {
            match self.inner.block_extra_keys(j) {
                None => list.append(py.None())?,
                Some((lora, salt)) => {
                    let keys: Vec<&str> = lora.map(|l| &*l.name).into_iter().chain(salt).collect();
                    list.append(PyTuple::new(py, keys)?)?;
                }
            }
        }
        Ok(Some(list))
    }

    /// The KV cache group of the blocks (vLLM's ``group_idx``; 0 with one group).
    #[getter]
    fn group_idx(&self) -> u32 {
        self.inner.group_idx
    }

    /// What the group's layers attend to: ``"full_attention"``, ``"sliding_window"``,
    /// ``"chunked_local_attention"`` or ``"mamba"`` (a recurrent-state group).
    #[getter]
    fn kv_cache_spec_kind(&self) -> &'static str {
        self.inner.kv_cache_spec.kind()
    }

    /// The group's sliding window in tokens; ``None`` for other groups.
    #[getter]
    fn kv_cache_spec_sliding_window(&self) -> Option<usize> {
        self.inner.kv_cache_spec.sliding_window()
    }

    /// Where the blocks were stored: ``"GPU"`` or ``"CPU"`` (the host tier, announced by
    /// the ``confirm_memory_ops`` that completes the block's write; blocks offloaded at
    /// eviction carry hashes only, no parent and no tokens).
    #[getter]
    fn medium(&self) -> &'static str {
        self.inner.medium.as_str()
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockStored(blocks={}, hashes=[{}], lora_id={:?}, lora_name={:?})",
            self.inner.block_hashes.len(),
            hex(&self.inner.block_hashes),
            self.inner.lora_id,
            self.inner.lora_name.as_deref()
        )
    }
}

/// KV cache event: blocks left the prefix cache (evicted or reset).
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct BlockRemoved {
    inner: kvblocks_core::BlockRemoved,
}

#[pymethods]
impl BlockRemoved {
    /// Hashes of the removed blocks.
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        hashes_to_py(py, &self.inner.block_hashes)
    }

    /// Where the blocks were removed from: ``"GPU"`` or ``"CPU"`` (the host tier).
    #[getter]
    fn medium(&self) -> &'static str {
        self.inner.medium.as_str()
    }

    /// The KV cache group whose blocks these are (vLLM's ``group_idx``; 0 with one group).
    #[getter]
    fn group_idx(&self) -> u32 {
        self.inner.group_idx
    }

    fn __repr__(&self) -> String {
        format!("BlockRemoved(hashes=[{}])", hex(&self.inner.block_hashes))
    }
}

/// KV cache event: ``reset_prefix_cache`` dropped every cached block, on every medium.
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct AllBlocksCleared;

#[pymethods]
impl AllBlocksCleared {
    fn __repr__(&self) -> &'static str {
        "AllBlocksCleared()"
    }
}

/// Wrap one core event in its Python class.
pub(crate) fn event_to_py(py: Python<'_>, event: KvCacheEvent) -> PyResult<Bound<'_, PyAny>> {
    Ok(match event {
        KvCacheEvent::BlockStored(inner) => Bound::new(py, BlockStored { inner })?.into_any(),
        KvCacheEvent::BlockRemoved(inner) => Bound::new(py, BlockRemoved { inner })?.into_any(),
        KvCacheEvent::AllBlocksCleared => Bound::new(py, AllBlocksCleared)?.into_any(),
    })
}
