//! The prefix cache's reset, events, statistics and invariant checks.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPyResult;
use crate::events::event_to_py;

use super::{to_numpy, KVCacheManager, Work};

#[pymethods]
impl KVCacheManager {
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
