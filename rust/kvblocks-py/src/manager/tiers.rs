//! Memory ops, the host tier and swapping.

use kvblocks_core as core;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::{names, BlockHashes, Count, RetentionPriorityArg, SeqId, SeqIds, SlotIds};
use crate::errors::IntoPyResult;

use super::{group_of, pairs_to_py, GroupArg, KVCacheManager, OpRun, Work};

#[pymethods]
impl KVCacheManager {
    /// Drain every queued block move in issue order, as runs of one kind:
    /// ``[(kind, pairs int64 [n, 2]), ...]`` with kinds ``"swap_out"``, ``"swap_in"``,
    /// ``"copy"``, ``"offload"`` (gpu block, tier slot) and ``"load"`` (tier slot, gpu
    /// block); no ``"offload"`` or ``"load"`` run names a destination twice. Host-tier
    /// slots stay pinned until ``confirm_memory_ops``.
    fn take_memory_ops<'py>(&self, py: Python<'py>) -> PyResult<Vec<OpRun<'py>>> {
        let ops = self.run(py, Work::Short, |m| m.take_memory_ops());
        let mut out = Vec::new();
        let mut i = 0;
        while i < ops.len() {
            let kind = ops[i].kind;
            // A host-tier run is applied as one index copy: a destination written twice
            // (a block loaded into, freed and loaded into again before the ops were taken)
            // would race on CUDA, so a repeated destination starts the next run, which
            // applies after this one, in issue order.
            let tier = matches!(kind, core::MemoryOpKind::Offload | core::MemoryOpKind::Load);
            let mut seen = std::collections::HashSet::new();
            let run: Vec<[i64; 2]> = ops[i..]
                .iter()
                .take_while(|o| o.kind == kind && (!tier || seen.insert(o.dst)))
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

    /// The engine could not finish the ops taken by ``take_memory_ops`` so far: release
    /// their host-tier pins without trusting what they wrote (slots being written become
    /// empty, never hits nor announced). A no-op without a host tier.
    fn discard_memory_ops(&self, py: Python<'_>) {
        self.run(py, Work::Short, |m| m.discard_memory_ops())
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
}
