//! The result of `allocate_slots_batch`: who was served, what each claimed and got.

/// What one `allocate_slots_batch` call did for the sequences it served.
///
/// Serving an earlier entry can evict blocks of a later entry's cached prefix, so the
/// claim of every sequence is reported as made, not as probed before the call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchAllocation {
    /// Sequences served: the first `num_served` of the batch, in order.
    pub num_served: usize,
    /// Per served sequence: cached prompt tokens claimed by this call (only a
    /// sequence's first allocation claims; later ones report 0).
    pub num_cached_tokens: Vec<i64>,
    /// Block ids taken from the free pool, sequence after sequence; within a sequence
    /// as `allocate_slots` returns them (a copy-on-write replacement first, then the
    /// appended blocks in table order).
    pub block_ids: Vec<i32>,
    /// `num_served + 1` offsets: sequence `i` got `block_ids[block_indptr[i]..block_indptr[i + 1]]`.
    pub block_indptr: Vec<i64>,
}
