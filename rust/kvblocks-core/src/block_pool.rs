//! A pool of blocks of one device: reference counts plus the free queue.

use crate::priority_lru::PriorityLru;

/// Blocks `0..num_blocks` of one device; ids below `first` are reserved (the null block).
///
/// Invariant kept by the manager: a usable block is in the free queue iff its
/// reference count is 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    free: PriorityLru,
    first: u32,
}

impl BlockPool {
    /// A pool of `num_blocks` ids whose usable ids start at `first` (1 on GPU, 0 on CPU).
    pub fn new(num_blocks: usize, first: u32) -> Self {
        BlockPool {
            ref_counts: vec![0; num_blocks],
            free: PriorityLru::new(num_blocks, first),
            first,
        }
    }

    /// Total ids, reserved ones included.
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Usable blocks (`num_blocks - first`).
    #[inline]
    pub fn num_usable(&self) -> usize {
        self.ref_counts.len() - self.first as usize
    }

    /// First usable id.
    #[inline]
    pub fn first(&self) -> u32 {
        self.first
    }

    /// Blocks in the free queue.
    #[inline]
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Reference count of `id`.
    #[inline]
    pub fn ref_count(&self, id: u32) -> u32 {
        self.ref_counts[id as usize]
    }

    /// Add a reference to a block already out of the free queue.
    #[inline]
    pub fn incref(&mut self, id: u32) {
        self.ref_counts[id as usize] += 1;
    }

    /// Drop a reference; returns the new count. The caller queues the block at 0.
    #[inline]
    pub fn decref(&mut self, id: u32) -> u32 {
        let rc = &mut self.ref_counts[id as usize];
        debug_assert!(*rc > 0, "decref of free block {id}");
        *rc -= 1;
        *rc
    }

    /// The free queue (read only).
    #[inline]
    pub fn free_queue(&self) -> &PriorityLru {
        &self.free
    }

    /// The free queue, for the manager's eviction-ordering rules.
    #[inline]
    pub fn free_queue_mut(&mut self) -> &mut PriorityLru {
        &mut self.free
    }

    /// Take the front free block and give it one reference.
    #[inline]
    pub fn pop_free(&mut self) -> Option<u32> {
        let id = self.free.pop_front()?;
        self.ref_counts[id as usize] = 1;
        Some(id)
    }

    /// Take a specific free block (a cache hit) and give it one reference.
    #[inline]
    pub fn take_free(&mut self, id: u32) {
        self.free.remove(id);
        self.ref_counts[id as usize] = 1;
    }

    /// Reference counts indexed by id.
    #[inline]
    pub fn ref_counts(&self) -> &[u32] {
        &self.ref_counts
    }
}
