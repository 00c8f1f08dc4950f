//! [`TierStats`]: the host tier's counters.

/// Counters of the host tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Tier slots.
    pub capacity: usize,
    /// Slots holding a block (written or being written).
    pub num_blocks: usize,
    /// Slots pinned by unconfirmed ops.
    pub num_pinned: usize,
    /// Prompt tokens served by the tier at the claim (loaded instead of recomputed).
    pub hits: u64,
    /// Blocks loaded (tier slot -> GPU block).
    pub loads: u64,
    /// Blocks offloaded (GPU block -> tier slot).
    pub offloads: u64,
    /// Offloads skipped because every slot was pinned or held a block of higher
    /// retention priority.
    pub offloads_skipped: u64,
    /// Tier blocks evicted to make room for an offload or an import.
    pub evictions: u64,
    /// Slots reserved by `import_tier_blocks` (written by the engine from a remote store).
    pub imports: u64,
}
