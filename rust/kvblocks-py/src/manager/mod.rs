//! `KVCacheManager`: the core manager behind a mutex, with NumPy arrays in and out.
//!
//! Locking rule: a thread never blocks on the mutex while it holds the GIL (that would
//! deadlock against a thread that holds the mutex in a GIL-free section and waits to
//! re-attach). Short calls take the lock with `try_lock` and fall back to waiting with
//! the GIL released; long calls (hashing prompts, batch calls) always run detached.

mod sequences;
mod stats;
mod tables;
mod tiers;

use kvblocks_core as core;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::{names, Count, Flag, LoraId, Parsed, Real, SeqId, SeqIds, SeqKey, Text};
use crate::errors::{invalid_argument, IntoPyResult};
use crate::group_spec::{GroupSpec, GroupSpecs};
use crate::hashing::BlockHasher;

/// The `group` argument: a group index, 0 when not given.
type GroupArg = Option<Count<names::Group>>;

/// The group index a `group` argument names.
fn group_of(group: GroupArg) -> usize {
    group.map_or(0, |g| g.0)
}

/// Paged KV-cache block manager: block pools, prefix cache, block tables, CoW, swap.
#[pyclass(frozen, module = "kvblocks._core")]
pub(crate) struct KVCacheManager {
    inner: Mutex<core::KVCacheManager>,
}

/// Whether a call runs long enough (or over enough data) to release the GIL.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Work {
    /// O(1) or O(sequence) bookkeeping: keep the GIL unless the lock is contended.
    Short,
    /// Hashing or batch work: always release the GIL.
    Long,
}

/// Releasing and re-taking the GIL costs about a microsecond: worth it only when the
/// call does more than that. Prompts of this many tokens (hashing) or batches of this
/// many sequences run detached.
const DETACH_TOKENS: usize = 2048;
const DETACH_SEQS: usize = 64;

impl Work {
    fn for_tokens(n: usize) -> Self {
        if n >= DETACH_TOKENS {
            Work::Long
        } else {
            Work::Short
        }
    }

    fn for_batch(n: usize) -> Self {
        if n >= DETACH_SEQS {
            Work::Long
        } else {
            Work::Short
        }
    }

    /// Short whatever the batch size (O(1)-per-id checks).
    fn short(_: usize) -> Self {
        Work::Short
    }
}

impl KVCacheManager {
    /// Run `f` on the core under the lock (see the module docs for the locking rule).
    fn run<R, F>(&self, py: Python<'_>, work: Work, f: F) -> R
    where
        F: FnOnce(&mut core::KVCacheManager) -> R + Send,
        R: Send,
    {
        if work == Work::Short {
            if let Some(mut guard) = self.inner.try_lock() {
                return f(&mut guard);
            }
        }
        py.detach(|| f(&mut self.inner.lock()))
    }

    /// Read-only access (same locking rule).
    fn read<R, F>(&self, py: Python<'_>, f: F) -> R
    where
        F: FnOnce(&core::KVCacheManager) -> R + Send,
        R: Send,
    {
        self.run(py, Work::Short, |m| f(m))
    }

    /// A core call on the sequence named by the `seq_id` argument.
    fn on_seq<R, F>(&self, py: Python<'_>, seq_id: SeqId, work: Work, f: F) -> PyResult<R>
    where
        F: FnOnce(&mut core::KVCacheManager, u64) -> core::Result<R> + Send,
        R: Send,
    {
        let id = seq_id.0;
        self.run(py, work, |m| f(m, id)).py_err()
    }

    /// A core call on the sequences named by the `seq_ids` argument; `work` says from
    /// their number whether the call releases the GIL.
    fn on_seqs<R, F>(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        work: fn(usize) -> Work,
        f: F,
    ) -> PyResult<R>
    where
        F: FnOnce(&mut core::KVCacheManager, &[u64]) -> core::Result<R> + Send,
        R: Send,
    {
        let ids = seq_ids.0;
        self.run(py, work(ids.len()), |m| f(m, &ids)).py_err()
    }
}

/// Arrays up to this many elements are copied into NumPy-owned memory; longer ones hand
/// their Rust buffer over without a copy. Copying a small array is cheaper than the
/// extra owner object a zero-copy array needs.
const COPY_MAX_ELEMENTS: usize = 1 << 14;

/// A 1-D NumPy array holding `values`.
pub(crate) fn to_numpy<T: numpy::Element>(
    py: Python<'_>,
    values: Vec<T>,
) -> Bound<'_, PyArray1<T>> {
    if values.len() <= COPY_MAX_ELEMENTS {
        PyArray1::from_slice(py, &values)
    } else {
        values.into_pyarray(py)
    }
}

/// A C-ordered `[rows, cols]` NumPy array holding `data` (row-major, `rows * cols` long).
fn matrix_to_numpy<T: numpy::Element + Copy>(
    py: Python<'_>,
    rows: usize,
    cols: usize,
    data: Vec<T>,
) -> PyResult<Bound<'_, PyArray2<T>>> {
    if data.len() != rows * cols {
        return Err(invalid_argument(format!(
            "internal error: {} values for a {rows} x {cols} array",
            data.len()
        )));
    }
    if data.len() > COPY_MAX_ELEMENTS {
        return Array2::from_shape_vec((rows, cols), data)
            .map(|a| a.into_pyarray(py))
            .map_err(|e| invalid_argument(format!("internal error: {e}")));
    }
    // SAFETY: `new` leaves the elements uninitialised; all `rows * cols` of them are
    // written by `copy_from_slice` before the array reaches Python (the length was
    // checked above). The array was created here and nothing else references it, so the
    // mutable slice cannot alias. (The safe `zeros` + `readwrite()` route spends
    // microseconds per call in NumPy's dynamic borrow tracking.)
    let out = unsafe { PyArray2::<T>::new(py, [rows, cols], false) };
    // SAFETY: the array is freshly created, C-contiguous and referenced nowhere else, so
    // this is the only view of its buffer while the slice lives.
    let dst = unsafe { out.as_slice_mut() }
        .map_err(|e| invalid_argument(format!("internal error: {e}")))?;
    dst.copy_from_slice(&data);
    Ok(out)
}

/// One run of `take_memory_ops`: a kind and its `(src, dst)` rows.
type OpRun<'py> = (&'static str, Bound<'py, PyArray2<i64>>);

/// `(src, dst)` rows as an `int64 [n, 2]` array.
fn pairs_to_py(py: Python<'_>, pairs: Vec<[i64; 2]>) -> PyResult<Bound<'_, PyArray2<i64>>> {
    let n = pairs.len();
    matrix_to_numpy(py, n, 2, pairs.into_iter().flatten().collect())
}

#[pymethods]
impl KVCacheManager {
    #[new]
    #[pyo3(signature = (
        num_blocks,
        block_size,
        *,
        num_cpu_blocks = None,
        enable_prefix_caching = None,
        hash_algo = None,
        hash_seed = None,
        watermark = None,
        sliding_window = None,
        record_events = None,
        host_cache_blocks = None,
        host_offload = None,
        groups = None,
    ),
    text_signature = "(num_blocks, block_size, *, num_cpu_blocks=0, enable_prefix_caching=True, \
                      hash_algo='blake3', hash_seed=None, watermark=0.01, sliding_window=None, \
                      record_events=True, host_cache_blocks=0, host_offload='evict', \
                      groups=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: Count<names::NumBlocks>,
        block_size: Count<names::BlockSize>,
        num_cpu_blocks: Option<Count<names::NumCpuBlocks>>,
        enable_prefix_caching: Option<Flag<names::EnablePrefixCaching>>,
        hash_algo: Option<Parsed<core::HashAlgo, names::HashAlgo>>,
        hash_seed: Option<Text<names::HashSeed>>,
        watermark: Option<Real<names::Watermark>>,
        sliding_window: Option<Count<names::SlidingWindow>>,
        record_events: Option<Flag<names::RecordEvents>>,
        host_cache_blocks: Option<Count<names::HostCacheBlocks>>,
        host_offload: Option<Parsed<core::OffloadPolicy, names::HostOffload>>,
        groups: Option<GroupSpecs>,
    ) -> PyResult<Self> {
        let mut config = core::ManagerConfig::new(num_blocks.0, block_size.0);
        if let Some(n) = num_cpu_blocks {
            config.num_cpu_blocks = n.0;
        }
        if let Some(flag) = enable_prefix_caching {
            config.enable_prefix_caching = flag.0;
        }
        if let Some(algo) = hash_algo {
            config.hash_algo = algo.0;
        }
        config.hash_seed = match hash_seed {
            Some(seed) => Some(seed.0),
            // As vLLM's `init_none_hash`: PYTHONHASHSEED, when set, seeds NONE_HASH.
            None if config.hash_algo == core::HashAlgo::Sha256Cbor => {
                std::env::var("PYTHONHASHSEED").ok()
            }
            None => None,
        };
        if let Some(w) = watermark {
            config.watermark = w.0;
        }
        if let Some(flag) = record_events {
            config.record_events = flag.0;
        }
        if let Some(n) = host_cache_blocks {
            config.host_cache_blocks = n.0;
        }
        if let Some(p) = host_offload {
            config.host_offload = p.0;
        }
        config.sliding_window = sliding_window.map(|w| w.0);
        if let Some(g) = groups {
            config.groups = g.0;
        }
        Ok(KVCacheManager {
            inner: Mutex::new(core::KVCacheManager::new(config).py_err()?),
        })
    }

    // -- configuration -------------------------------------------------------------

    /// GPU blocks in the pool, the null block included.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.num_blocks())
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.block_size())
    }

    /// Blocks in the CPU pool used by ``swap_out``/``swap_in``.
    #[getter]
    fn num_cpu_blocks(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.num_cpu_blocks())
    }

    /// Whether full blocks are shared between sequences by content hash.
    #[getter]
    fn enable_prefix_caching(&self, py: Python<'_>) -> bool {
        self.read(py, |m| m.enable_prefix_caching())
    }

    /// ``"blake3"``, ``"xxh3_128"`` or ``"sha256_cbor"``.
    #[getter]
    fn hash_algo(&self, py: Python<'_>) -> &'static str {
        self.read(py, |m| m.hash_algo().as_str())
    }

    /// vLLM's ``NONE_HASH`` (the parent hash of first blocks) with ``sha256_cbor``, else
    /// ``None``.
    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        let digest = self.read(py, |m| m.none_hash().copied());
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
        self.run(py, Work::Short, |m| m.register_lora(id, &name, &path));
    }

    /// A ``BlockHasher`` that hashes prompts as this manager does; see the stub.
    fn block_hasher(&self, py: Python<'_>) -> BlockHasher {
        let (hasher, block_size) = self.read(py, |m| (m.block_hasher(), m.block_size()));
        BlockHasher::from_core(hasher, block_size)
    }

    /// Fraction of GPU blocks kept free at admission.
    #[getter]
    fn watermark(&self, py: Python<'_>) -> f64 {
        self.read(py, |m| m.watermark())
    }

    /// Attention window in tokens, or ``None``.
    #[getter]
    fn sliding_window(&self, py: Python<'_>) -> Option<usize> {
        self.read(py, |m| m.sliding_window())
    }

    /// The KV cache groups, in order (one unless the manager was built with several).
    #[getter]
    fn groups(&self, py: Python<'_>) -> Vec<GroupSpec> {
        let specs = self.read(py, |m| m.groups().to_vec());
        specs.into_iter().map(|inner| GroupSpec { inner }).collect()
    }

    /// Number of KV cache groups.
    #[getter]
    fn num_groups(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.num_groups())
    }

    /// Whether KV cache events are queued for ``take_events``.
    #[getter]
    fn record_events(&self, py: Python<'_>) -> bool {
        self.read(py, |m| m.config().record_events)
    }

    /// Slots of the host tier (0: none).
    #[getter]
    fn host_cache_blocks(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.host_cache_blocks())
    }

    /// When blocks are copied to the host tier: ``"evict"`` or ``"commit"``.
    #[getter]
    fn host_offload(&self, py: Python<'_>) -> &'static str {
        self.read(py, |m| m.host_offload().as_str())
    }

    /// The reserved block id (0) used for padding and released window blocks.
    #[getter]
    fn null_block(&self) -> u32 {
        core::NULL_BLOCK
    }

    // -- pool state ----------------------------------------------------------------

    /// Free GPU blocks, cached-but-unreferenced ones included (at most ``num_blocks - 1``).
    fn num_free_blocks(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.num_free_blocks())
    }

    /// Free CPU blocks.
    fn num_free_cpu_blocks(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.num_free_cpu_blocks())
    }

    /// Fraction of usable GPU blocks referenced by some sequence.
    fn usage(&self, py: Python<'_>) -> f64 {
        self.read(py, |m| m.usage())
    }

    /// Number of sequences held (running and swapped).
    fn __len__(&self, py: Python<'_>) -> usize {
        self.read(py, |m| m.len())
    }

    fn __contains__(&self, py: Python<'_>, seq_id: SeqKey) -> bool {
        match seq_id.0 {
            Some(id) => self.read(py, |m| m.has_sequence(id)),
            None => false,
        }
    }

    /// Ids of the sequences held, ascending.
    fn seq_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let ids: Vec<i64> = self.read(py, |m| m.seq_ids().into_iter().map(|i| i as i64).collect());
        to_numpy(py, ids)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.read(py, |m| {
            format!(
                "KVCacheManager(num_blocks={}, block_size={}, num_cpu_blocks={}, \
                 enable_prefix_caching={}, hash_algo={:?}, free_blocks={}, sequences={})",
                m.num_blocks(),
                m.block_size(),
                m.num_cpu_blocks(),
                if m.enable_prefix_caching() {
                    "True"
                } else {
                    "False"
                },
                m.hash_algo().as_str(),
                m.num_free_blocks(),
                m.len()
            )
        })
    }
}
