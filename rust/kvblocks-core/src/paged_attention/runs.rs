//! Walking an item's keys through its block table: the contiguous runs of cache rows,
//! their prefetch, and the per-thread buffers that hold them.

use super::plan::Plan;
use super::PagedShape;

impl Plan<'_> {
    /// The contiguous runs of cache rows holding keys `[first, len)` of sequence `seq`
    /// for KV head `head`, each as (first key, element offset in the cache, rows).
    pub(super) fn runs(&self, seq: usize, head: usize, first: usize, len: usize) -> Runs<'_> {
        Runs {
            plan: self,
            table: seq * self.max_blocks,
            head,
            next: first,
            end: len,
        }
    }
}

/// Per-thread buffers reused across items.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) scores: Vec<f32>,
    pub(super) denominators: Vec<f32>,
    /// The item's runs (first key, element offset, rows), walked by both passes.
    pub(super) runs: Vec<(usize, usize, usize)>,
}

/// Ask for row `r` of a run (`(cache, element offset, rows)`) to be brought into the cache
/// ahead of its use; nothing past the run's rows. A hint only: no value changes.
#[inline(always)]
pub(super) fn prefetch_row((cache, offset, rows): (&[f32], usize, usize), r: usize, d: usize) {
    if r >= rows {
        return;
    }
    let row = &cache[offset + r * d..offset + (r + 1) * d];
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // 16 f32 = one 64-byte cache line.
        // SAFETY: SSE (the intrinsic's feature) is part of the x86-64 baseline, and a
        // prefetch of an address inside a live slice changes no memory and cannot fault.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast::<i8>(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Iterator over the contiguous cache runs of one sequence's keys (see [`Plan::runs`]).
pub(super) struct Runs<'p> {
    plan: &'p Plan<'p>,
    table: usize,
    head: usize,
    next: usize,
    end: usize,
}

impl Iterator for Runs<'_> {
    type Item = (usize, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let PagedShape {
            num_kv_heads,
            head_size,
            block_size,
            ..
        } = self.plan.shape;
        let block = self.plan.batch.block_tables[self.table + self.next / block_size] as usize;
        let within = self.next % block_size;
        let rows = (block_size - within).min(self.end - self.next);
        let offset = ((block * num_kv_heads + self.head) * block_size + within) * head_size;
        let key = self.next;
        self.next += rows;
        Some((key, offset, rows))
    }
}
