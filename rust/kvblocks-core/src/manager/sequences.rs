//! Adding, forking and reading sequences.

use super::KVCacheManager;
use crate::error::{KvError, Result};
use crate::retention::RetentionPriority;
use crate::sequence::Sequence;

impl KVCacheManager {
    /// Register a sequence and its prompt; return how many leading tokens are cached.
    ///
    /// Hashes the prompt's full blocks once and probes the prefix cache without claiming
    /// anything. The hit is whole blocks and never the whole prompt: at most
    /// `floor((len - 1) / block_size)` blocks. Errors: `DuplicateSequence`.
    pub fn add_sequence(
        &mut self,
        seq_id: u64,
        token_ids: &[u32],
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<usize> {
        if self.index.contains_key(&seq_id) {
            return Err(KvError::DuplicateSequence(seq_id));
        }
        if self.slots.len() >= u32::MAX as usize {
            return Err(KvError::InvalidArgument(format!(
                "too many sequences (at most {} can be held)",
                u32::MAX
            )));
        }
        let bs = self.config.block_size;
        let mut hashes = Vec::new();
        let namespace;
        let mut cap = 0;
        if self.pools.caching {
            namespace = self.hasher.namespace(cache_salt, lora_id)?;
            self.hasher
                .extend_chain(&mut hashes, &namespace, token_ids, bs);
            let max_hit = token_ids.len().saturating_sub(1) / bs;
            cap = self.pools.probe(&hashes, max_hit);
        } else {
            namespace = Default::default();
        }
        let extra_keys = if self.pools.caching {
            self.extra_keys(cache_salt, lora_id)
        } else {
            None
        };
        let seq = Sequence {
            id: seq_id,
            tokens: token_ids.to_vec(),
            prompt_len: token_ids.len(),
            num_computed: 0,
            tables: vec![Default::default(); self.pools.groups.len()],
            reserved: None,
            allocated: false,
            namespace,
            lora_id,
            lora_name: self.lora_name(lora_id),
            extra_keys,
            retention: RetentionPriority::DEFAULT,
            hashes,
            probe_cap_blocks: cap,
            num_cached_tokens: 0,
            num_tier_tokens: 0,
            num_registered_blocks: 0,
            swapped: false,
            in_flight: 0..0,
        };
        self.index.insert(seq_id, self.slots.len() as u32);
        self.slots.push(seq);
        Ok(cap * bs)
    }

    /// Make `child_id` share the parent's tokens and the blocks holding its computed
    /// tokens (refcounts + 1).
    ///
    /// The child gets only the first `ceil(num_computed / block_size)` table entries:
    /// spare blocks past the computed tokens (left by lookahead, or by a commit smaller
    /// than its reservation) stay the parent's alone, so the only block the two can both
    /// write next is the partially filled last one, which the next `allocate_slots` of
    /// either side copies first (copy-on-write). Errors: `UnknownSequence(parent)`,
    /// `DuplicateSequence(child)`, `SequenceState` if the parent is swapped or has an
    /// allocated-but-uncommitted reservation.
    pub fn fork(&mut self, parent_id: u64, child_id: u64) -> Result<()> {
        let parent = self.seq(parent_id)?;
        if self.index.contains_key(&child_id) {
            return Err(KvError::DuplicateSequence(child_id));
        }
        Self::require_resident(parent, "fork")?;
        if parent.reserved.is_some() {
            return Err(KvError::SequenceState(format!(
                "fork: sequence {parent_id} has allocated but uncommitted slots; \
                 commit its KV before forking"
            )));
        }
        let mut child = parent.clone();
        child.id = child_id;
        // Without a reservation (checked above) the parent has nothing in flight.
        debug_assert!(child.in_flight.is_empty());
        let len = parent.num_computed.div_ceil(self.config.block_size);
        for t in &mut child.tables {
            // A new table: it reaches a caller's table only through a whole-row write.
            t.dirty_from = 0;
            t.synced_row = None;
            // Spare blocks hold no computed KV; sharing them would let both sides write
            // them.
            t.blocks.truncate(len);
            t.num_released = t.num_released.min(len);
            for &b in &t.blocks {
                if b != crate::NULL_BLOCK {
                    self.pools.gpu.incref(b);
                }
            }
        }
        self.index.insert(child_id, self.slots.len() as u32);
        self.slots.push(child);
        Ok(())
    }

    /// Set the sequence's retention priority (default [`RetentionPriority::DEFAULT`]): the
    /// blocks it commits or claims from now on carry it, in the GPU free queue and into
    /// the host tier, where the lowest priority is evicted first (see
    /// [`RetentionPriority`]). Forks inherit it.
    /// Errors: `UnknownSequence`.
    pub fn set_retention_priority(
        &mut self,
        seq_id: u64,
        priority: RetentionPriority,
    ) -> Result<()> {
        let slot = self.slot_of(seq_id)?;
        self.slots[slot].retention = priority;
        Ok(())
    }

    /// The sequence's retention priority.
    pub fn retention_priority(&self, seq_id: u64) -> Result<RetentionPriority> {
        Ok(self.seq(seq_id)?.retention)
    }

    /// Whether the sequence is held.
    pub fn has_sequence(&self, seq_id: u64) -> bool {
        self.index.contains_key(&seq_id)
    }

    /// Known tokens: prompt plus committed sampled tokens.
    pub fn num_tokens(&self, seq_id: u64) -> Result<usize> {
        Ok(self.seq(seq_id)?.tokens.len())
    }

    /// Tokens whose KV is in the cache; before the first `allocate_slots`, the cached
    /// prefix the sequence would claim now (can shrink through eviction; grows only
    /// through `refresh_prefixes`).
    pub fn num_computed_tokens(&self, seq_id: u64) -> Result<usize> {
        let seq = self.seq(seq_id)?;
        Ok(self.computed_of(seq))
    }

    /// Prompt tokens served from the prefix cache (claimed, or the probe before the claim).
    pub fn num_cached_tokens(&self, seq_id: u64) -> Result<usize> {
        let seq = self.seq(seq_id)?;
        Ok(if seq.allocated {
            seq.num_cached_tokens
        } else {
            self.computed_of(seq)
        })
    }

    /// The known tokens.
    pub fn token_ids(&self, seq_id: u64) -> Result<&[u32]> {
        Ok(&self.seq(seq_id)?.tokens)
    }

    /// Whether the sequence's blocks are in the CPU pool.
    pub fn is_swapped(&self, seq_id: u64) -> Result<bool> {
        Ok(self.seq(seq_id)?.swapped)
    }

    /// `num_computed_tokens` for many sequences (for longest-prefix-match ordering).
    pub fn probe_prefixes(&self, seq_ids: &[u64]) -> Result<Vec<i64>> {
        seq_ids
            .iter()
            .map(|&id| self.num_computed_tokens(id).map(|n| n as i64))
            .collect()
    }

    /// Re-probe the prefix cache for sequences not yet allocated; return the new hits.
    ///
    /// Each sequence's cap on its cached prefix (set at `add_sequence`, shrinking with
    /// eviction) is reset to what its stored block hashes hit in the cache now, so it can
    /// grow when another sequence cached the same prefix meanwhile. Still whole blocks and
    /// never the whole prompt. Nothing is claimed (refcounts and free queue unchanged).
    /// Ids may repeat. Errors, checked for every id before any cap changes:
    /// `UnknownSequence`, `SequenceState` (already allocated, or swapped).
    pub fn refresh_prefixes(&mut self, seq_ids: &[u64]) -> Result<Vec<i64>> {
        let bs = self.config.block_size;
        let mut out = Vec::with_capacity(seq_ids.len());
        // One read-only pass validates and probes (a long waiting queue is read once);
        // only the caps that change are written afterwards.
        let mut changed = Vec::new();
        for &id in seq_ids {
            let slot = self.slot_of(id)?;
            let seq = &self.slots[slot];
            Self::require_resident(seq, "refresh_prefixes")?;
            if seq.allocated {
                return Err(KvError::SequenceState(format!(
                    "refresh_prefixes: sequence {id} already has slots (its cached prefix was \
                     claimed); only waiting sequences can be refreshed"
                )));
            }
            let max_hit = seq.prompt_len.saturating_sub(1) / bs;
            let cap = self.pools.probe(&seq.hashes, max_hit);
            if cap != seq.probe_cap_blocks {
                changed.push((slot, cap));
            }
            out.push((cap * bs) as i64);
        }
        for (slot, cap) in changed {
            self.slots[slot].probe_cap_blocks = cap;
        }
        Ok(out)
    }

    /// Ids of every held sequence (running and swapped), ascending.
    pub fn seq_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.slots.iter().map(|s| s.id).collect();
        ids.sort_unstable();
        ids
    }

    /// Number of sequences held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}
