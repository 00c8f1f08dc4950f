//! The block manager: sequences, block tables, prefix cache, CoW and swap over two pools.

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHasher;
use crate::block_pool::BlockPool;
use crate::config::{HashAlgo, ManagerConfig};
use crate::error::Result;
use crate::events::KvCacheEvent;
use crate::prefix_cache::PrefixCache;
use crate::sequence::Sequence;

/// A 2-D block-table matrix, row-major, padded with the null block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTables {
    /// `num_rows * num_cols` block ids.
    pub data: Vec<i32>,
    /// One row per requested sequence.
    pub num_rows: usize,
    /// Longest table (or `max_blocks`).
    pub num_cols: usize,
}

/// Running counters (see [`Stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Counters {
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    evictions: u64,
    cow_copies: u64,
    blocks_swapped_out: u64,
    blocks_swapped_in: u64,
}

/// Paged KV-cache block manager (see the crate docs for the conventions).
///
/// `Clone` + `PartialEq` give tests a cheap way to check that a failing call left the
/// state unchanged: clone before, compare after.
#[derive(Debug, Clone, PartialEq)]
pub struct KVCacheManager {
    config: ManagerConfig,
    gpu: BlockPool,
    cpu: BlockPool,
    cache: PrefixCache,
    hasher: BlockHasher,
    seqs: FxHashMap<u64, Sequence>,
    num_swapped: usize,
    events: Vec<KvCacheEvent>,
    cow_queue: Vec<[i64; 2]>,
    counters: Counters,
    watermark_blocks: usize,
}

impl KVCacheManager {
    /// Build a manager; fails with `InvalidArgument` on a bad config.
    pub fn new(config: ManagerConfig) -> Result<Self> {
        config.validate()?;
        let watermark_blocks = (config.watermark * config.num_blocks as f64).floor() as usize;
        Ok(KVCacheManager {
            gpu: BlockPool::new(config.num_blocks, 1),
            cpu: BlockPool::new(config.num_cpu_blocks, 0),
            cache: PrefixCache::new(
                if config.enable_prefix_caching {
                    config.num_blocks
                } else {
                    0
                },
                config.block_size,
            ),
            hasher: BlockHasher::new(config.hash_algo),
            seqs: FxHashMap::default(),
            num_swapped: 0,
            events: Vec::new(),
            cow_queue: Vec::new(),
            counters: Counters::default(),
            watermark_blocks,
            config,
        })
    }

    // -- configuration -----------------------------------------------------------

    /// The construction parameters.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }
    /// GPU blocks, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }
    /// CPU pool size.
    pub fn num_cpu_blocks(&self) -> usize {
        self.config.num_cpu_blocks
    }
    /// Whether the prefix cache is on.
    pub fn enable_prefix_caching(&self) -> bool {
        self.config.enable_prefix_caching
    }
    /// The prefix-cache hash algorithm.
    pub fn hash_algo(&self) -> HashAlgo {
        self.config.hash_algo
    }
    /// Fraction of GPU blocks kept free at admission.
    pub fn watermark(&self) -> f64 {
        self.config.watermark
    }
    /// `floor(watermark * num_blocks)`.
    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }
    /// Attention window in tokens, if any.
    pub fn sliding_window(&self) -> Option<usize> {
        self.config.sliding_window
    }
    /// The reserved null block id (0).
    pub fn null_block(&self) -> u32 {
        crate::NULL_BLOCK
    }
}

// The operations live in submodules, one concern each, as further `impl` blocks.
mod allocate;
mod commit;
mod free;
mod invariants;
mod queries;
mod sequences;
mod step_inputs;
mod swap;
