//! The block manager: sequences, block tables, prefix cache, CoW and swap over two pools.

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHasher;
use crate::block_pool::BlockPool;
use crate::config::{HashAlgo, ManagerConfig};
use crate::error::{KvError, Result};
use crate::group::GroupSpec;
use crate::host_tier::HostTier;
use crate::prefix_cache::PrefixCache;
use crate::sequence::Sequence;

use self::batch_scratch::BatchScratch;
pub use self::decode_step::DecodeStep;
use self::in_flight::InFlight;
use self::pools::{Counters, Pools};

/// Block-table matrices, row-major, padded with the null block: one `[num_rows,
/// num_cols]` matrix per group asked for, one after the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTables {
    /// `num_groups * num_rows * num_cols` block ids.
    pub data: Vec<i32>,
    /// Matrices (1 unless every group's tables were asked for).
    pub num_groups: usize,
    /// One row per requested sequence.
    pub num_rows: usize,
    /// Longest table (or `max_blocks`).
    pub num_cols: usize,
}

/// Paged KV-cache block manager (see the crate docs for the conventions).
///
/// `Clone` + `PartialEq` give tests a cheap way to check that a failing call left the
/// state unchanged: clone before, compare after (scratch buffers are not compared).
#[derive(Debug, Clone, PartialEq)]
pub struct KVCacheManager {
    config: ManagerConfig,
    pools: Pools,
    hasher: BlockHasher,
    /// Sequence id -> position in `slots` (dense; `free` swap-removes).
    index: FxHashMap<u64, u32>,
    slots: Vec<Sequence>,
    num_swapped: usize,
    watermark_blocks: usize,
    /// Prefix blocks reserved but not yet committed (see `in_flight`).
    in_flight: InFlight,
    scratch: BatchScratch,
    /// Per group, the sequence last written into each row of the caller's block table of
    /// that group (`sync_block_table`).
    row_owner: Vec<FxHashMap<u32, u64>>,
    /// LoRA id -> its registered name and path (`register_lora`), for events.
    loras: FxHashMap<u64, crate::events::LoraKey>,
    /// The extra keys of the last sequence added with `sha256_cbor`, shared by the next
    /// ones that have the same (most have none).
    recent_extra_keys: Option<std::sync::Arc<crate::events::SeqExtraKeys>>,
}

impl KVCacheManager {
    /// Build a manager; fails with `InvalidArgument` on a bad config.
    pub fn new(config: ManagerConfig) -> Result<Self> {
        config.validate()?;
        let watermark_blocks = (config.watermark * config.num_blocks as f64).floor() as usize;
        let caching = config.enable_prefix_caching;
        let groups = config.resolved_groups();
        let num_groups = groups.len();
        Ok(KVCacheManager {
            pools: Pools {
                gpu: BlockPool::new(config.num_blocks, 1),
                cpu: BlockPool::new(config.num_cpu_blocks, 0),
                cache: PrefixCache::with_blocks(
                    if caching { config.num_blocks } else { 0 },
                    num_groups,
                ),
                caching,
                record_events: config.record_events,
                events: Vec::new(),
                announce: Vec::new(),
                counters: Counters::default(),
                tier: (config.host_cache_blocks > 0)
                    .then(|| HostTier::new(config.host_cache_blocks, config.host_offload)),
                ops: Vec::new(),
                retention: if caching {
                    vec![Default::default(); config.num_blocks]
                } else {
                    Vec::new()
                },
                all_full: groups.iter().all(|g| g.is_full()),
                recurrent: groups.iter().any(|g| g.is_recurrent()),
                groups,
                block_size: config.block_size,
            },
            hasher: BlockHasher::with_seed(config.hash_algo, config.hash_seed.as_deref()),
            index: FxHashMap::default(),
            slots: Vec::new(),
            num_swapped: 0,
            watermark_blocks,
            in_flight: InFlight::default(),
            scratch: BatchScratch::default(),
            row_owner: vec![FxHashMap::default(); num_groups],
            loras: FxHashMap::default(),
            recent_extra_keys: None,
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
    /// Attention window in tokens given as `sliding_window`, if any.
    pub fn sliding_window(&self) -> Option<usize> {
        self.config.sliding_window
    }
    /// The KV cache groups, in order (one group unless built with several).
    pub fn groups(&self) -> &[GroupSpec] {
        &self.pools.groups
    }
    /// Number of KV cache groups.
    pub fn num_groups(&self) -> usize {
        self.pools.groups.len()
    }
    /// Slots of the host tier (0: none).
    pub fn host_cache_blocks(&self) -> usize {
        self.config.host_cache_blocks
    }
    /// When blocks are copied to the host tier.
    pub fn host_offload(&self) -> crate::host_tier::OffloadPolicy {
        self.config.host_offload
    }
    /// The reserved null block id (0).
    pub fn null_block(&self) -> u32 {
        crate::NULL_BLOCK
    }

    // -- lookups shared by the operations ----------------------------------------

    /// Slot of a held sequence.
    #[inline]
    fn slot_of(&self, seq_id: u64) -> Result<usize> {
        self.index
            .get(&seq_id)
            .map(|&i| i as usize)
            .ok_or(KvError::UnknownSequence(seq_id))
    }

    /// A held sequence.
    #[inline]
    fn seq(&self, seq_id: u64) -> Result<&Sequence> {
        Ok(&self.slots[self.slot_of(seq_id)?])
    }

    /// Fail with `SequenceState` if the sequence is swapped out.
    #[inline]
    fn require_resident(seq: &Sequence, op: &str) -> Result<()> {
        if seq.swapped {
            return Err(KvError::SequenceState(format!(
                "{op}: sequence {} is swapped out; swap it in first",
                seq.id
            )));
        }
        Ok(())
    }

    /// Computed tokens as `num_computed_tokens` reports them (the probe before the claim).
    #[inline]
    fn computed_of(&self, seq: &Sequence) -> usize {
        if seq.allocated {
            seq.num_computed
        } else {
            self.pools.probe(&seq.hashes, seq.probe_cap_blocks) * self.config.block_size
        }
    }

    /// `InvalidArgument` unless `group` names one of the manager's groups.
    #[inline]
    fn check_group(&self, group: usize) -> Result<()> {
        if group >= self.pools.groups.len() {
            return Err(KvError::InvalidArgument(format!(
                "group {group} is out of range: the manager has {} KV cache group(s)",
                self.pools.groups.len()
            )));
        }
        Ok(())
    }

    /// Slots of `seq_ids` in order; `InvalidArgument` if an id is listed twice.
    fn batch_slots(&mut self, seq_ids: &[u64]) -> Result<Vec<u32>> {
        if let Some(slots) = self.scratch.recall(seq_ids) {
            return Ok(slots.to_vec());
        }
        let mut out = Vec::with_capacity(seq_ids.len());
        let epoch = self.scratch.next_epoch(self.slots.len());
        for &id in seq_ids {
            let slot = *self.index.get(&id).ok_or(KvError::UnknownSequence(id))?;
            if !self.scratch.mark(slot, epoch) {
                return Err(KvError::InvalidArgument(format!(
                    "sequence id {id} is listed twice; expected distinct ids"
                )));
            }
            out.push(slot);
        }
        self.scratch.remember(seq_ids, &out);
        Ok(out)
    }
}

mod allocate;
mod batch_scratch;
mod commit;
mod decode_step;
mod free;
mod hit;
mod host_ops;
mod in_flight;
mod invariants;
mod lora_keys;
mod peak;
mod pools;
mod queries;
mod sequences;
mod state;
mod step_inputs;
mod swap;
mod table_sync;
