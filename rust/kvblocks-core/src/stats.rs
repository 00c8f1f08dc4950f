//! Counters reported by `stats()`.

/// Snapshot of the manager's counters (the Python `stats()` dict, field for field).
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// GPU blocks, the null block included.
    pub num_blocks: usize,
    /// Free GPU blocks (cached-but-unreferenced included).
    pub num_free_blocks: usize,
    /// GPU blocks referenced by some sequence.
    pub num_used_blocks: usize,
    /// `num_used_blocks / (num_blocks - 1)`.
    pub usage: f64,
    /// CPU pool size.
    pub num_cpu_blocks: usize,
    /// Free CPU blocks.
    pub num_free_cpu_blocks: usize,
    /// Sequences held (running and swapped).
    pub num_sequences: usize,
    /// Sequences currently swapped out.
    pub num_swapped_sequences: usize,
    /// Entries of the prefix cache (blocks carrying a hash).
    pub num_cached_blocks: usize,
    /// Prompt tokens looked up in the prefix cache (counted at claim time).
    pub prefix_cache_queries: u64,
    /// Prompt tokens served by the prefix cache (counted at claim time).
    pub prefix_cache_hits: u64,
    /// `hits / queries` (0 when no query).
    pub prefix_cache_hit_rate: f64,
    /// Cached blocks evicted to be reused.
    pub evictions: u64,
    /// Copy-on-write block copies queued.
    pub cow_copies: u64,
    /// GPU blocks copied to the CPU pool.
    pub blocks_swapped_out: u64,
    /// CPU blocks copied back to the GPU pool.
    pub blocks_swapped_in: u64,
    /// GPU blocks referenced by the tables of each KV cache group.
    pub num_used_blocks_per_group: Vec<usize>,
    /// Prefix-cache entries of each KV cache group.
    pub num_cached_blocks_per_group: Vec<usize>,
    /// Host-tier counters, `None` without a host tier.
    pub host_tier: Option<crate::host_tier::TierStats>,
}
