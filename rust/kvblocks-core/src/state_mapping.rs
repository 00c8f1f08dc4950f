//! Where a step reads and writes the recurrent states of a state group.

/// One recurrent-state group's states for a step: where each sequence's state is read
/// from and where the step saves the states it must leave, in CSR form (see
/// [`crate::KVCacheManager::state_mapping`]).
///
/// A state "after `p` tokens" is the layers' state (a Mamba layer's conv and SSM state)
/// once tokens `[0, p)` were fed through them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateMapping {
    /// Per sequence: the block holding its state after its computed tokens, or `-1`
    /// before any token is computed (the initial state: zeros).
    pub read_blocks: Vec<i64>,
    /// Per sequence `i`, its writes are `[write_indptr[i], write_indptr[i + 1])`.
    pub write_indptr: Vec<i64>,
    /// Tokens each written state covers (ascending per sequence; the last one is the
    /// end of the step's reserved tokens).
    pub write_positions: Vec<i64>,
    /// The block each state is written to.
    pub write_blocks: Vec<i64>,
}
