//! Sequences: adding, probing, allocating slots, committing, forking and freeing.

use kvblocks_core as core;
use numpy::{PyArray1, PyArray2};
use pyo3::prelude::*;

use crate::alloc_status::AllocStatus;
use crate::args::{
    names, CacheSalt, Count, LoraId, PerSeqCounts, PerSeqTokens, RetentionPriorityArg, SeqId,
    SeqIds, TokenIds,
};
use crate::batch_allocation::BatchAllocation;
use crate::errors::IntoPyResult;

use super::{pairs_to_py, to_numpy, KVCacheManager, Work};

#[pymethods]
impl KVCacheManager {
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

    /// Release the sequence's blocks (last block first) and forget it.
    fn free(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<()> {
        self.on_seq(py, seq_id, Work::Short, |m, id| m.free(id))
    }
}
