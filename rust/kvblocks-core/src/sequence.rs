//! Per-sequence state held by the manager.

use std::sync::Arc;

use crate::block_hash::BlockHash;
use crate::events::{BlockStored, SeqExtraKeys};
use crate::group::GroupSpec;
use crate::host_tier::Medium;
use crate::retention::RetentionPriority;

/// One KV cache group's block table of a sequence.
///
/// Every group's table of a sequence has the same length (one entry per block of
/// reserved slots, positions never shift); a window or chunked group's leading entries
/// are the null block once no future query sees their tokens. A recurrent-state group's
/// entries are null except the one holding the state after the computed tokens (and,
/// while a step is reserved, the states that step writes; see `GroupSpec::state_writes`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupTable {
    /// Block ids, in the GPU pool, or in the CPU pool while swapped; 0 = null block.
    pub blocks: Vec<u32>,
    /// Leading entries released (all null): no future query of the group sees them.
    pub num_released: usize,
    /// Entries `[dirty_from, len)` changed since the last `sync_block_table` of this
    /// group (appends fall in the range without touching it; in-place replacements
    /// lower it).
    pub dirty_from: usize,
    /// Row of the caller's table of this group the sequence was last synced to.
    pub synced_row: Option<u32>,
}

impl GroupTable {
    /// The entries holding blocks when the sequence has no pending reservation (as
    /// every swapped sequence): every entry from `num_released` on for attention; for a
    /// recurrent group the one holding the state after `num_computed` tokens (none
    /// before any token is computed). What a swapped table's CPU ids are read by: CPU
    /// block 0 is a real block, so its other entries are skipped by position.
    #[inline]
    pub fn held_range(&self, spec: GroupSpec, num_computed: usize) -> std::ops::Range<usize> {
        if !spec.is_recurrent() {
            return self.num_released..self.blocks.len();
        }
        if num_computed == 0 {
            return 0..0;
        }
        self.num_released..(self.num_released + 1).min(self.blocks.len())
    }
}

/// One sequence: its tokens, computed count, block tables and prefix-cache bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// The sequence id.
    pub id: u64,
    /// Known tokens: prompt plus committed sampled tokens.
    pub tokens: Vec<u32>,
    /// Prompt length at `add_sequence` (prefix-cache queries are counted in these).
    pub prompt_len: usize,
    /// Tokens whose KV is in the cache (valid once `allocated`).
    pub num_computed: usize,
    /// One block table per KV cache group, in group order.
    pub tables: Vec<GroupTable>,
    /// Slots reserved by the last `allocate_slots` (computed + new + lookahead), until commit.
    pub reserved: Option<usize>,
    /// Whether the first `allocate_slots` (which claims the cached prefix) happened.
    pub allocated: bool,
    /// Digest of the extra keys (salt, LoRA id).
    pub namespace: BlockHash,
    /// LoRA id, reported in `BlockStored` events.
    pub lora_id: Option<u64>,
    /// The LoRA's registered name, reported in `BlockStored` events.
    pub lora_name: Option<Arc<str>>,
    /// vLLM's extra hash keys (`sha256_cbor` only), reported in `BlockStored` events.
    pub extra_keys: Option<Arc<SeqExtraKeys>>,
    /// Retention priority of the blocks it commits or claims (host-tier eviction order).
    pub retention: RetentionPriority,
    /// Hashes of the leading full blocks (the prompt's at add, extended as blocks fill).
    pub hashes: Vec<BlockHash>,
    /// Cached-prefix blocks found at `add_sequence`: the claim never exceeds this.
    pub probe_cap_blocks: usize,
    /// Prompt tokens served from the prefix cache at the claim (host-tier loads included).
    pub num_cached_tokens: usize,
    /// Of `num_cached_tokens`, the tokens loaded from the host tier.
    pub num_tier_tokens: usize,
    /// Leading blocks already offered to the prefix cache (cached or claimed),
    /// in every group (all groups register at the same commit).
    pub num_registered_blocks: usize,
    /// Whether the blocks live in the CPU pool.
    pub swapped: bool,
    /// Table range the pending reservation fills with known-hash blocks (see
    /// `manager::in_flight`); empty without a reservation.
    pub in_flight: std::ops::Range<usize>,
}

impl Sequence {
    /// Entries per table (the same in every group).
    #[inline]
    pub fn table_len(&self) -> usize {
        self.tables[0].blocks.len()
    }

    /// An empty `BlockStored` run of this sequence's blocks of group `group`, sized for
    /// `capacity` blocks.
    pub fn stored_event(
        &self,
        group: u32,
        parent: Option<BlockHash>,
        capacity: usize,
        block_size: usize,
        medium: Medium,
    ) -> BlockStored {
        BlockStored {
            block_hashes: Vec::with_capacity(capacity),
            parent_block_hash: parent,
            token_ids: Vec::with_capacity(capacity * block_size),
            block_size,
            lora_id: self.lora_id,
            lora_name: self.lora_name.clone(),
            extra_keys: self.extra_keys.clone(),
            medium,
            group_idx: group,
            kv_cache_spec: GroupSpec::default(),
        }
    }
}
