//! KV cache events for routers (one-to-one with prefix-cache entries).

use std::sync::Arc;

use crate::block_hash::BlockHash;
use crate::group::GroupSpec;
use crate::host_tier::Medium;

/// vLLM's LoRA hash key, `("lora", name, path)` (the fields of its `LoRARequest`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraKey {
    /// `lora_name`.
    pub name: Arc<str>,
    /// `lora_path` (`""` when not given).
    pub path: Arc<str>,
}

/// The extra keys `hash_algo="sha256_cbor"` hashed a sequence's blocks with, as vLLM's
/// `generate_block_hash_extra_keys` builds them: the LoRA key on every block, the cache
/// salt on the first block of the chain only (see [`crate::BlockHasher`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SeqExtraKeys {
    /// The LoRA's key, if the sequence has a LoRA.
    pub lora: Option<LoraKey>,
    /// The cache salt (a non-empty UTF-8 salt; vLLM ignores an empty one).
    pub cache_salt: Option<Arc<str>>,
}

impl SeqExtraKeys {
    /// Whether no block carries a key (vLLM's `extra_keys` entry is then `None`).
    pub fn is_empty(&self) -> bool {
        self.lora.is_none() && self.cache_salt.is_none()
    }
}

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
    /// Name of that LoRA, when its id was registered (`register_lora`).
    pub lora_name: Option<Arc<str>>,
    /// The extra keys the blocks were hashed with (`sha256_cbor` only, else `None`): the
    /// cache salt applies to the event's first block when it starts the chain
    /// (`parent_block_hash` is `None` and `token_ids` are given), the LoRA key to every
    /// block. Events of blocks offloaded at eviction carry none (see `medium`).
    pub extra_keys: Option<Arc<SeqExtraKeys>>,
    /// Where the blocks were stored. Host-tier events of blocks offloaded at eviction
    /// carry the hashes only (no parent, no tokens): the GPU cache keeps no tokens. A
    /// host-tier block is announced when its write is confirmed (`confirm_memory_ops`),
    /// from which it is a prefix hit, not when its offload or import is queued.
    pub medium: Medium,
    /// The KV cache group the blocks belong to (vLLM's `group_idx`).
    pub group_idx: u32,
    /// What that group's layers attend to (vLLM's `kv_cache_spec_kind` and
    /// `kv_cache_spec_sliding_window`, from [`GroupSpec::kind`] and
    /// [`GroupSpec::sliding_window`]): the pools record structure only, and
    /// `KVCacheManager::take_events` stamps each event's spec from its group, as vLLM's
    /// `KVCacheManager.take_events` does.
    pub kv_cache_spec: GroupSpec,
}

impl BlockStored {
    /// The LoRA key and the cache salt hashed into the event's block `j`, `None` when it
    /// has neither or the event carries no extra keys. vLLM publishes them untagged
    /// (`to_event_extra_keys`): the LoRA's bare name, then the bare salt.
    pub fn block_extra_keys(&self, j: usize) -> Option<(Option<&LoraKey>, Option<&str>)> {
        let keys = self.extra_keys.as_deref()?;
        let chain_start = j == 0 && self.parent_block_hash.is_none();
        let salt = keys.cache_salt.as_deref().filter(|_| chain_start);
        let lora = keys.lora.as_ref();
        (lora.is_some() || salt.is_some()).then_some((lora, salt))
    }
}

/// Blocks left the prefix cache (evicted to be reused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Where the blocks were removed from.
    pub medium: Medium,
    /// The KV cache group whose blocks these are (vLLM's `group_idx`; 0 with one group).
    pub group_idx: u32,
}

/// One KV cache event, drained by [`crate::KVCacheManager::take_events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// See [`BlockStored`].
    BlockStored(BlockStored),
    /// See [`BlockRemoved`].
    BlockRemoved(BlockRemoved),
    /// `reset_prefix_cache` dropped every cached block, on every medium (vLLM's event has
    /// no medium, and its consumers clear all tiers of the instance): no `BlockRemoved`
    /// follows for the dropped blocks. Written host-tier blocks the reset had to keep
    /// (pinned by unconfirmed loads) are announced again right after it, by one
    /// `BlockStored` with medium CPU (hashes only); kept blocks still being written are
    /// announced when their write is confirmed, as every host-tier block is.
    AllBlocksCleared,
}
