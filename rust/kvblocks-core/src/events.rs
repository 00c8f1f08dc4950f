//! KV cache events for routers (one-to-one with prefix-cache entries).

use crate::block_hash::BlockHash;
use crate::host_tier::Medium;

/// Full blocks entered the prefix cache (one event per run of consecutive blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the block before the first stored one; `None` for a prompt's first block.
    pub parent_block_hash: Option<BlockHash>,
    /// Tokens of all stored blocks, concatenated (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapter of the sequence that stored the blocks.
    pub lora_id: Option<u64>,
    /// Where the blocks were stored. Host-tier events of blocks offloaded at eviction
    /// carry the hashes only (no parent, no tokens): the GPU cache keeps no tokens.
    pub medium: Medium,
}

/// Blocks left the prefix cache (evicted to be reused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Where the blocks were removed from.
    pub medium: Medium,
}

/// One KV cache event, drained by [`crate::KVCacheManager::take_events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// See [`BlockStored`].
    BlockStored(BlockStored),
    /// See [`BlockRemoved`].
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was cleared by `reset_prefix_cache`.
    AllBlocksCleared,
}
