//! `KVCacheManager`: the core manager behind a mutex, with NumPy arrays in and out.
//!
//! Locking rule: a thread never blocks on the mutex while it holds the GIL (that would
//! deadlock against a thread that holds the mutex in a GIL-free section and waits to
//! re-attach). Short calls take the lock with `try_lock` and fall back to waiting with
//! the GIL released; long calls (hashing prompts, batch calls) always run detached.

use kvblocks_core as core;
use numpy::ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::alloc_status::AllocStatus;
use crate::args::{
    names, BlockHashes, CacheSalt, Count, Flag, LoraId, Parsed, PerSeqCounts, PerSeqTokens, Real,
    RetentionPriorityArg, RowIndices, SeqId, SeqIds, SeqKey, SlotIds, Text, TokenIds,
    WritableTable, WritableTables,
};
use crate::batch_allocation::BatchAllocation;
use crate::block_table_delta::BlockTableDelta;
use crate::errors::{invalid_argument, IntoPyResult};
use crate::events::event_to_py;
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

impl KVCacheManager {
    /// The core sync without a buffer (the caller applies the delta with the GIL held);
    /// `rows` are checked against `num_rows` here, the one bound they have.
    #[allow(clippy::too_many_arguments)]
    fn sync(
        &self,
        py: Python<'_>,
        group: usize,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        num_rows: usize,
        num_cols: usize,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<core::BlockTableDelta> {
        let ids = seq_ids.0;
        let rows = rows.parse(num_rows)?;
        let full = full.is_some_and(|f| f.0);
        self.run(py, Work::for_batch(ids.len()), |m| {
            m.sync_group_block_table(group, &ids, &rows, num_rows, num_cols, None, full)
        })
        .py_err()
    }

    /// The core sync of every group without a buffer, as [`Self::sync`].
    fn sync_groups(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        num_rows: usize,
        num_cols: usize,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<Vec<core::BlockTableDelta>> {
        let ids = seq_ids.0;
        let rows = rows.parse(num_rows)?;
        let full = full.is_some_and(|f| f.0);
        self.run(py, Work::for_batch(ids.len()), |m| {
            m.sync_group_block_tables(&ids, &rows, num_rows, num_cols, None, full)
        })
        .py_err()
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

    // -- sequences -----------------------------------------------------------------

    /// Register a sequence and its prompt; return how many leading tokens are cached.
    #[pyo3(signature = (
        seq_id, token_ids, *, cache_salt = None, lora_id = None, retention_priority = None
    ))]
    fn add_sequence(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        token_ids: TokenIds<names::TokenIds>,
        cache_salt: Option<CacheSalt>,
        lora_id: Option<LoraId>,
        retention_priority: Option<RetentionPriorityArg<names::RetentionPriority>>,
    ) -> PyResult<usize> {
        let (id, tokens) = (seq_id.0, token_ids.0);
        let salt = cache_salt.map(|s| s.0);
        let lora = lora_id.map(|l| l.0);
        let priority = retention_priority.map_or(core::RetentionPriority::DEFAULT, |p| p.0);
        self.run(py, Work::for_tokens(tokens.len()), |m| {
            let cached = m.add_sequence(id, &tokens, salt.as_deref(), lora)?;
            // Cannot fail: the sequence was just added.
            m.set_retention_priority(id, priority)?;
            Ok(cached)
        })
        .py_err()
    }

    /// Set the sequence's retention priority (0..100); see the stub.
    fn set_retention_priority(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        priority: RetentionPriorityArg<names::Priority>,
    ) -> PyResult<()> {
        let p = priority.0;
        self.on_seq(py, seq_id, Work::Short, |m, id| {
            m.set_retention_priority(id, p)
        })
    }

    /// The sequence's retention priority.
    fn retention_priority(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<u8> {
        self.on_seq(py, seq_id, Work::Short, |m, id| {
            m.retention_priority(id).map(|p| p.get())
        })
    }

    /// Known tokens of the sequence: prompt plus committed sampled tokens.
    fn num_tokens(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<usize> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.num_tokens(id))
    }

    /// Tokens whose KV is in the cache (the current prefix probe before the first allocation).
    fn num_computed_tokens(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<usize> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.num_computed_tokens(id))
    }

    /// Prompt tokens served from the prefix cache (claimed, or the probe before the claim).
    fn num_cached_tokens(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<usize> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.num_cached_tokens(id))
    }

    /// The sequence's known tokens.
    fn token_ids<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqId,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let tokens = self.on_seq(py, seq_id, Work::Short, |m, id| {
            m.token_ids(id).map(|t| t.to_vec())
        })?;
        Ok(to_numpy(py, tokens))
    }

    /// Whether the sequence's blocks are in the CPU pool.
    fn is_swapped(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<bool> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.is_swapped(id))
    }

    /// Batch form of ``num_computed_tokens`` for ordering waiting sequences.
    fn probe_prefixes<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let out = self.on_seqs(py, seq_ids, Work::for_batch, |m, ids| m.probe_prefixes(ids))?;
        Ok(to_numpy(py, out))
    }

    /// Re-probe the cache for waiting sequences; their cached-prefix caps may grow.
    fn refresh_prefixes<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let out = self.on_seqs(py, seq_ids, Work::for_batch, |m, ids| {
            m.refresh_prefixes(ids)
        })?;
        Ok(to_numpy(py, out))
    }

    /// Prompt tokens right past each waiting sequence's cached prefix that other
    /// sequences are computing now (reserved, not yet committed).
    fn probe_in_flight<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let out = self.on_seqs(py, seq_ids, Work::for_batch, |m, ids| {
            m.probe_in_flight(ids)
        })?;
        Ok(to_numpy(py, out))
    }

    /// Can the whole known sequence (plus lookahead) get blocks, keeping the watermark free?
    /// With ``num_new_tokens``: can the next step of that many tokens past the cached
    /// prefix get its blocks in every group (a window group's real need)?
    #[pyo3(
        signature = (seq_id, *, num_lookahead_tokens = None, num_new_tokens = None),
        text_signature = "(self, seq_id, *, num_lookahead_tokens=0, num_new_tokens=None)"
    )]
    fn can_allocate(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        num_lookahead_tokens: Option<Count<names::NumLookaheadTokens>>,
        num_new_tokens: Option<Count<names::NumNewTokens>>,
    ) -> PyResult<AllocStatus> {
        let id = seq_id.0;
        let lookahead = num_lookahead_tokens.map_or(0, |n| n.0);
        let status = match num_new_tokens {
            None => self.read(py, |m| m.can_allocate(id, lookahead)),
            Some(new) => self.read(py, |m| m.can_allocate_step(id, new.0, lookahead)),
        }
        .py_err()?;
        Ok(status.into())
    }

    /// Reserve KV slots for ``computed + num_new_tokens + num_lookahead_tokens`` tokens.
    #[pyo3(
        signature = (seq_id, num_new_tokens, *, num_lookahead_tokens = None),
        text_signature = "(self, seq_id, num_new_tokens, *, num_lookahead_tokens=0)"
    )]
    fn allocate_slots<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqId,
        num_new_tokens: Count<names::NumNewTokens>,
        num_lookahead_tokens: Option<Count<names::NumLookaheadTokens>>,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let (id, new) = (seq_id.0, num_new_tokens.0);
        let lookahead = num_lookahead_tokens.map_or(0, |n| n.0);
        let taken = self
            .run(py, Work::Short, |m| m.allocate_slots(id, new, lookahead))
            .py_err()?;
        Ok(taken.map(|blocks| to_numpy(py, blocks)))
    }

    /// ``allocate_slots`` for many sequences in one call; reports what the served ones got.
    #[pyo3(
        signature = (seq_ids, num_new_tokens, *, num_lookahead_tokens = None),
        text_signature = "(self, seq_ids, num_new_tokens, *, num_lookahead_tokens=0)"
    )]
    fn allocate_slots_batch(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        num_new_tokens: PerSeqCounts<names::NumNewTokens>,
        num_lookahead_tokens: Option<Count<names::NumLookaheadTokens>>,
    ) -> PyResult<BatchAllocation> {
        let (ids, new) = (seq_ids.0, num_new_tokens.0);
        let lookahead = num_lookahead_tokens.map_or(0, |n| n.0);
        let done = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.allocate_slots_batch(&ids, new.as_batch_arg(), lookahead)
            })
            .py_err()?;
        Ok(BatchAllocation::new(py, done))
    }

    /// The model wrote KV for ``num_new_computed_tokens`` more tokens; append sampled tokens.
    #[pyo3(
        signature = (seq_id, num_new_computed_tokens, new_token_ids = None),
        text_signature = "(self, seq_id, num_new_computed_tokens, new_token_ids=())"
    )]
    fn commit(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        num_new_computed_tokens: Count<names::NumNewComputedTokens>,
        new_token_ids: Option<TokenIds<names::NewTokenIds>>,
    ) -> PyResult<()> {
        let (id, n) = (seq_id.0, num_new_computed_tokens.0);
        let tokens = new_token_ids.map(|t| t.0).unwrap_or_default();
        // Committing a long prefill chunk hashes its blocks: worth releasing the GIL.
        self.run(py, Work::for_tokens(n), |m| m.commit(id, n, &tokens))
            .py_err()
    }

    /// ``commit`` for many sequences: at most one new token each (``< 0`` means none).
    #[pyo3(signature = (seq_ids, num_new_computed_tokens, new_token_ids = None))]
    fn commit_batch(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        num_new_computed_tokens: PerSeqCounts<names::NumNewComputedTokens>,
        new_token_ids: Option<PerSeqTokens<names::NewTokenIds>>,
    ) -> PyResult<()> {
        let (ids, n) = (seq_ids.0, num_new_computed_tokens.0);
        let tokens = new_token_ids.map(|t| t.0);
        self.run(py, Work::for_batch(ids.len()), |m| {
            m.commit_batch(
                &ids,
                n.as_batch_arg(),
                tokens.as_ref().map(|t| t.as_batch_arg()),
            )
        })
        .py_err()
    }

    /// Make ``child_id`` share every block and token of ``parent_id`` (refcounts + 1).
    fn fork(
        &self,
        py: Python<'_>,
        parent_id: SeqId<names::ParentId>,
        child_id: SeqId<names::ChildId>,
    ) -> PyResult<()> {
        let (parent, child) = (parent_id.0, child_id.0);
        self.run(py, Work::Short, |m| m.fork(parent, child))
            .py_err()
    }

    /// The copy pairs of the memory-op journal, drained; see the stub.
    fn take_copy_on_writes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let pairs = self
            .run(py, Work::Short, |m| m.take_copy_on_writes())
            .py_err()?;
        pairs_to_py(py, pairs)
    }

    /// Drain every queued block move in issue order, as runs of one kind:
    /// ``[(kind, pairs int64 [n, 2]), ...]`` with kinds ``"swap_out"``, ``"swap_in"``,
    /// ``"copy"``, ``"offload"`` (gpu block, tier slot) and ``"load"`` (tier slot, gpu
    /// block). Host-tier slots stay pinned until ``confirm_memory_ops``.
    fn take_memory_ops<'py>(&self, py: Python<'py>) -> PyResult<Vec<OpRun<'py>>> {
        let ops = self.run(py, Work::Short, |m| m.take_memory_ops());
        let mut out = Vec::new();
        let mut i = 0;
        while i < ops.len() {
            let kind = ops[i].kind;
            let run: Vec<[i64; 2]> = ops[i..]
                .iter()
                .take_while(|o| o.kind == kind)
                .map(|o| [o.src, o.dst])
                .collect();
            i += run.len();
            out.push((kind.as_str(), pairs_to_py(py, run)?));
        }
        Ok(out)
    }

    /// The engine finished every op taken by ``take_memory_ops`` so far: unpin their
    /// host-tier slots. A no-op without a host tier.
    fn confirm_memory_ops(&self, py: Python<'_>) {
        self.run(py, Work::Short, |m| m.confirm_memory_ops())
    }

    /// The block hash each host-tier slot holds or is being written with (``None``: empty
    /// slot, id out of range, or no tier).
    fn tier_slot_hashes<'py>(
        &self,
        py: Python<'py>,
        slots: SlotIds,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let ids = slots.0;
        let hashes = self.read(py, |m| m.tier_slot_hashes(&ids));
        Ok(hashes
            .into_iter()
            .map(|h| h.map(|h| PyBytes::new(py, h.as_bytes())))
            .collect())
    }

    /// The KV cache group of the block each host-tier slot holds or is being written
    /// with (``None``: empty slot, id out of range, or no tier).
    fn tier_slot_groups(&self, py: Python<'_>, slots: SlotIds) -> Vec<Option<usize>> {
        let ids = slots.0;
        let keys = self.read(py, |m| m.tier_slot_keys(&ids));
        keys.into_iter().map(|k| k.map(|(g, _)| g)).collect()
    }

    /// Leading blocks of the hash chain a prompt would hit now (GPU prefix cache or
    /// written host-tier slots), without side effects.
    fn num_cached_prefix_blocks(&self, py: Python<'_>, block_hashes: BlockHashes) -> usize {
        let digests = block_hashes.0;
        self.read(py, |m| {
            let refs: Vec<&[u8]> = digests.iter().map(|d| d.as_slice()).collect();
            m.num_cached_prefix_blocks(&refs)
        })
    }

    /// Reserve host-tier slots for blocks fetched from a shared remote store: one int64
    /// per digest, the slot to write its KV into or -1 (already cached, or no slot free).
    /// Reserved slots become hits at the next ``confirm_memory_ops``.
    #[pyo3(
        signature = (block_hashes, *, retention_priority = None, group = None),
        text_signature = "(self, block_hashes, *, retention_priority=None, group=0)"
    )]
    fn import_tier_blocks<'py>(
        &self,
        py: Python<'py>,
        block_hashes: BlockHashes,
        retention_priority: Option<RetentionPriorityArg<names::RetentionPriority>>,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let digests = block_hashes.0;
        let priority = retention_priority.map_or(core::RetentionPriority::DEFAULT, |p| p.0);
        let group = group_of(group);
        let slots = self
            .run(py, Work::Short, |m| {
                let refs: Vec<&[u8]> = digests.iter().map(|d| d.as_slice()).collect();
                m.import_group_tier_blocks(&refs, priority, group)
            })
            .py_err()?;
        Ok(slots.into_pyarray(py))
    }

    /// Cap a waiting sequence's host-tier loads; see the stub.
    fn limit_tier_loads(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        max_loads: Count<names::MaxLoads>,
    ) -> PyResult<usize> {
        let max = max_loads.0;
        self.on_seq(py, seq_id, Work::Short, |m, id| m.limit_tier_loads(id, max))
    }

    /// Of the sequence's cached tokens, those loaded (or, before the first
    /// ``allocate_slots``, to be loaded) from the host tier.
    fn num_tier_tokens(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<usize> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.num_tier_tokens(id))
    }

    /// The host-tier blocks a waiting sequence's claim would load, over all groups.
    fn num_tier_loads(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<usize> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.num_tier_loads(id))
    }

    /// Release the sequence's blocks (last block first) and forget it.
    fn free(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<()> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.free(id))
    }

    // -- swap ----------------------------------------------------------------------

    /// Enough free CPU blocks for the sequences' distinct blocks.
    fn can_swap_out(&self, py: Python<'_>, seq_ids: SeqIds) -> PyResult<bool> {
        self.on_seqs(py, seq_ids, Work::short, |m, ids| m.can_swap_out(ids))
    }

    /// Enough free GPU blocks for the sequences' distinct blocks, keeping the watermark.
    fn can_swap_in(&self, py: Python<'_>, seq_ids: SeqIds) -> PyResult<bool> {
        self.on_seqs(py, seq_ids, Work::short, |m, ids| m.can_swap_in(ids))
    }

    /// Move the sequences' blocks to the CPU pool; return ``(gpu, cpu)`` rows ``[n, 2]``.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let pairs = self.on_seqs(py, seq_ids, Work::for_batch, |m, ids| m.swap_out(ids))?;
        pairs_to_py(py, pairs)
    }

    /// Move swapped sequences back; return ``(cpu, gpu)`` rows ``[n, 2]``, sharing kept.
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let pairs = self.on_seqs(py, seq_ids, Work::for_batch, |m, ids| m.swap_in(ids))?;
        pairs_to_py(py, pairs)
    }

    // -- step inputs ---------------------------------------------------------------

    /// The sequence's block table of ``group``.
    #[pyo3(signature = (seq_id, *, group = None), text_signature = "(self, seq_id, *, group=0)")]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqId,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let group = group_of(group);
        let table = self.on_seq(py, seq_id, Work::Short, |m, id| {
            m.group_block_table(id, group)
        })?;
        Ok(to_numpy(py, table))
    }

    /// 2-D block tables of ``group``, padded with the null block to the longest (or
    /// ``max_blocks``).
    #[pyo3(
        signature = (seq_ids, *, max_blocks = None, group = None),
        text_signature = "(self, seq_ids, *, max_blocks=None, group=0)"
    )]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        max_blocks: Option<Count<names::MaxBlocks>>,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = seq_ids.0;
        let max_blocks = max_blocks.map(|b| b.0);
        let group = group_of(group);
        let tables = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.group_block_tables(&ids, max_blocks, Some(group))
            })
            .py_err()?;
        matrix_to_numpy(py, tables.num_rows, tables.num_cols, tables.data)
    }

    /// Block tables of every group, ``[num_groups, len(seq_ids), max_blocks]``.
    #[pyo3(signature = (seq_ids, *, max_blocks = None))]
    fn group_block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        max_blocks: Option<Count<names::MaxBlocks>>,
    ) -> PyResult<Bound<'py, PyArray3<i32>>> {
        let ids = seq_ids.0;
        let max_blocks = max_blocks.map(|b| b.0);
        let tables = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.group_block_tables(&ids, max_blocks, None)
            })
            .py_err()?;
        let shape = (tables.num_groups, tables.num_rows, tables.num_cols);
        Array3::from_shape_vec(shape, tables.data)
            .map(|a| a.into_pyarray(py))
            .map_err(|e| invalid_argument(format!("internal error: {e}")))
    }

    /// Bring rows ``rows[i]`` of a persistent int32 ``[max_rows, max_blocks]`` table of
    /// ``group`` up to date with the block tables of ``seq_ids[i]``, in place; returns
    /// what was written.
    #[pyo3(
        signature = (block_table, seq_ids, rows, *, full = None, group = None),
        text_signature = "(self, block_table, seq_ids, rows, *, full=None, group=0)"
    )]
    fn update_block_table(
        &self,
        py: Python<'_>,
        block_table: WritableTable<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        full: Option<Flag<names::Full>>,
        group: GroupArg,
    ) -> PyResult<BlockTableDelta> {
        let table = block_table.0;
        let (num_rows, num_cols) = {
            let shape = table.shape();
            (shape[0], shape[1])
        };
        let delta = self.sync(py, group_of(group), seq_ids, rows, num_rows, num_cols, full)?;
        // SAFETY: `WritableTable` checked that the array is C-contiguous and writeable.
        // The GIL is held from here to the end of the write, so no Python code can touch
        // the buffer meanwhile, and no Rust view of it exists in this call.
        let data = unsafe { table.as_slice_mut() }
            .map_err(|e| invalid_argument(format!("block_table: {e}")))?;
        // The core checked every written entry against this shape.
        delta.apply(data, num_rows, num_cols).py_err()?;
        Ok(BlockTableDelta::new(py, delta))
    }

    /// ``update_block_table`` of every group: ``block_tables`` is int32 ``[num_groups,
    /// max_rows, max_blocks]``, one persistent table per group; one delta per group.
    #[pyo3(signature = (block_tables, seq_ids, rows, *, full = None))]
    fn update_group_block_tables(
        &self,
        py: Python<'_>,
        block_tables: WritableTables<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<Vec<BlockTableDelta>> {
        let tables = block_tables.0;
        let (num_groups, num_rows, num_cols) = {
            let shape = tables.shape();
            (shape[0], shape[1], shape[2])
        };
        let have = self.read(py, |m| m.num_groups());
        if num_groups != have {
            return Err(invalid_argument(format!(
                "block_tables has {num_groups} tables but the manager has {have} KV cache \
                 group(s); expected one table per group"
            )));
        }
        let deltas = self.sync_groups(py, seq_ids, rows, num_rows, num_cols, full)?;
        // SAFETY: `WritableTables` checked that the array is C-contiguous and writeable;
        // the GIL is held until the writes are done (see `update_block_table`).
        let data = unsafe { tables.as_slice_mut() }
            .map_err(|e| invalid_argument(format!("block_tables: {e}")))?;
        let matrix = num_rows * num_cols;
        for (g, delta) in deltas.iter().enumerate() {
            delta
                .apply(&mut data[g * matrix..(g + 1) * matrix], num_rows, num_cols)
                .py_err()?;
        }
        Ok(deltas
            .into_iter()
            .map(|d| BlockTableDelta::new(py, d))
            .collect())
    }

    /// The writes ``update_block_table`` would make to a ``[max_rows, max_blocks]`` table
    /// of ``group`` kept elsewhere (e.g. on a device); consumes the changes the same way.
    #[pyo3(
        signature = (seq_ids, rows, *, max_rows, max_blocks, full = None, group = None),
        text_signature = "(self, seq_ids, rows, *, max_rows, max_blocks, full=None, group=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn block_table_delta(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        max_rows: Count<names::MaxRows>,
        max_blocks: Count<names::MaxBlocks>,
        full: Option<Flag<names::Full>>,
        group: GroupArg,
    ) -> PyResult<BlockTableDelta> {
        let (num_rows, num_cols) = (max_rows.0, max_blocks.0);
        let delta = self.sync(py, group_of(group), seq_ids, rows, num_rows, num_cols, full)?;
        Ok(BlockTableDelta::new(py, delta))
    }

    /// ``block_table_delta`` of every group: one delta per group.
    #[pyo3(signature = (seq_ids, rows, *, max_rows, max_blocks, full = None))]
    fn group_block_table_deltas(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        rows: RowIndices<'_, '_>,
        max_rows: Count<names::MaxRows>,
        max_blocks: Count<names::MaxBlocks>,
        full: Option<Flag<names::Full>>,
    ) -> PyResult<Vec<BlockTableDelta>> {
        let (num_rows, num_cols) = (max_rows.0, max_blocks.0);
        let deltas = self.sync_groups(py, seq_ids, rows, num_rows, num_cols, full)?;
        Ok(deltas
            .into_iter()
            .map(|d| BlockTableDelta::new(py, d))
            .collect())
    }

    /// Cache slots (``block * block_size + offset``) of the tokens computed this step, in
    /// the tables of ``group``.
    #[pyo3(
        signature = (seq_ids, num_tokens = None, *, group = None),
        text_signature = "(self, seq_ids, num_tokens=None, *, group=0)"
    )]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        num_tokens: Option<PerSeqCounts<names::NumTokens>>,
        group: GroupArg,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ids = seq_ids.0;
        let counts = num_tokens.map(|n| n.0);
        let group = group_of(group);
        let slots = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.group_slot_mapping(&ids, counts.as_ref().map(|c| c.as_batch_arg()), Some(group))
            })
            .py_err()?;
        Ok(to_numpy(py, slots))
    }

    /// Where the pending step of each sequence reads and writes the states of recurrent
    /// group ``group``: the block holding its state after its computed tokens (``-1``:
    /// none yet, start from zeros), and for its pending reservation every state to save
    /// (each checkpoint boundary crossed, then the state after the reserved tokens).
    #[pyo3(signature = (seq_ids, *, group))]
    fn state_mapping(
        &self,
        py: Python<'_>,
        seq_ids: SeqIds,
        group: Count<names::Group>,
    ) -> PyResult<crate::state_mapping::StateMapping> {
        let ids = seq_ids.0;
        let mapping = self
            .run(py, Work::for_batch(ids.len()), |m| {
                m.state_mapping(&ids, group.0)
            })
            .py_err()?;
        Ok(crate::state_mapping::StateMapping::new(py, mapping))
    }

    /// ``slot_mapping`` of every group, ``[num_groups, num_tokens]``.
    #[pyo3(signature = (seq_ids, num_tokens = None))]
    fn group_slot_mappings<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds,
        num_tokens: Option<PerSeqCounts<names::NumTokens>>,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let ids = seq_ids.0;
        let counts = num_tokens.map(|n| n.0);
        let (groups, slots) = self
            .run(py, Work::for_batch(ids.len()), |m| {
                let slots =
                    m.group_slot_mapping(&ids, counts.as_ref().map(|c| c.as_batch_arg()), None)?;
                Ok((m.num_groups(), slots))
            })
            .py_err()?;
        let per_group = slots.len() / groups;
        matrix_to_numpy(py, groups, per_group, slots)
    }

    // -- prefix cache, events, stats -----------------------------------------------

    /// Forget every cached hash; only when no block is in use. Returns success.
    fn reset_prefix_cache(&self, py: Python<'_>) -> bool {
        self.run(py, Work::Long, |m| m.reset_prefix_cache())
    }

    /// Drain the KV cache events recorded since the last call.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let events = self.run(py, Work::Short, |m| m.take_events());
        events.into_iter().map(|e| event_to_py(py, e)).collect()
    }

    /// Counters: usage, free blocks, prefix-cache queries/hits, evictions, CoW, swaps.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.read(py, |m| m.stats());
        let d = PyDict::new(py);
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("num_used_blocks", s.num_used_blocks)?;
        d.set_item("usage", s.usage)?;
        d.set_item("num_cpu_blocks", s.num_cpu_blocks)?;
        d.set_item("num_free_cpu_blocks", s.num_free_cpu_blocks)?;
        d.set_item("num_sequences", s.num_sequences)?;
        d.set_item("num_swapped_sequences", s.num_swapped_sequences)?;
        d.set_item("num_cached_blocks", s.num_cached_blocks)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("prefix_cache_hit_rate", s.prefix_cache_hit_rate)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("cow_copies", s.cow_copies)?;
        d.set_item("blocks_swapped_out", s.blocks_swapped_out)?;
        d.set_item("blocks_swapped_in", s.blocks_swapped_in)?;
        if let Some(t) = s.host_tier {
            d.set_item("host_cache_blocks", t.capacity)?;
            d.set_item("num_host_cached_blocks", t.num_blocks)?;
            d.set_item("num_host_pinned_blocks", t.num_pinned)?;
            d.set_item("host_hits", t.hits)?;
            d.set_item("host_loads", t.loads)?;
            d.set_item("host_offloads", t.offloads)?;
            d.set_item("host_offloads_skipped", t.offloads_skipped)?;
            d.set_item("host_evictions", t.evictions)?;
            d.set_item("host_imports", t.imports)?;
        }
        Ok(d)
    }

    /// Per KV cache group: ``num_used_blocks`` (GPU blocks its tables reference) and
    /// ``num_cached_blocks`` (its prefix-cache entries), one int per group.
    fn group_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.read(py, |m| m.stats());
        let d = PyDict::new(py);
        d.set_item("num_used_blocks", s.num_used_blocks_per_group)?;
        d.set_item("num_cached_blocks", s.num_cached_blocks_per_group)?;
        Ok(d)
    }

    /// Free-queue order of the GPU and CPU pools, front (reused first) to back.
    ///
    /// A debugging aid (not part of the stable API): tests use it to check that a
    /// failing call left the eviction order untouched.
    fn _debug_free_queues<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray1<u32>>) {
        let (gpu, cpu) = self.read(py, |m| (m.free_block_ids(), m.free_cpu_block_ids()));
        (to_numpy(py, gpu), to_numpy(py, cpu))
    }

    /// Verify every structural invariant; raise ``InvariantViolationError`` if one fails.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, Work::Long, |m| m.check_invariants()).py_err()
    }
}
