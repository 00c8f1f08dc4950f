//! The structural invariant checker.

use super::KVCacheManager;
use crate::block_pool::BlockPool;
use crate::error::{KvError, Result};
use crate::NULL_BLOCK;

fn violation(msg: String) -> KvError {
    KvError::InvariantViolation(msg)
}

/// Reference counts equal the counted table references; free iff unreferenced.
fn check_pool(pool: &BlockPool, refs: &[u32], name: &str) -> Result<()> {
    pool.free_queue()
        .check()
        .map_err(|e| violation(format!("{name} pool: {e}")))?;
    for id in 0..pool.num_blocks() as u32 {
        let rc = pool.ref_count(id);
        if rc != refs[id as usize] {
            return Err(violation(format!(
                "{name} block {id} has refcount {rc} but {} table references",
                refs[id as usize]
            )));
        }
        let queued = pool.free_queue().contains(id);
        if id < pool.first() {
            if queued || rc != 0 {
                return Err(violation(format!(
                    "{name} reserved block {id} is in use (refcount {rc}, queued {queued})"
                )));
            }
        } else if queued != (rc == 0) {
            return Err(violation(format!(
                "{name} block {id} has refcount {rc} but queued = {queued}; expected a block \
                 to be free iff unreferenced"
            )));
        }
    }
    let used = pool.ref_counts().iter().filter(|&&rc| rc > 0).count();
    if used + pool.num_free() != pool.num_usable() {
        return Err(violation(format!(
            "{name} pool: {used} used + {} free != {} usable blocks",
            pool.num_free(),
            pool.num_usable()
        )));
    }
    Ok(())
}

impl KVCacheManager {
    /// Verify every structural invariant; `InvariantViolation` names the first that fails.
    pub fn check_invariants(&self) -> Result<()> {
        let bs = self.config.block_size;
        let num_groups = self.pools.groups.len();
        let mut gpu_refs = vec![0u32; self.pools.gpu.num_blocks()];
        let mut cpu_refs = vec![0u32; self.pools.cpu.num_blocks()];
        // The group whose tables reference each GPU block (u8::MAX: none yet).
        let mut gpu_group = vec![u8::MAX; self.pools.gpu.num_blocks()];
        let mut swapped = 0;
        if self.index.len() != self.slots.len() {
            return Err(violation("sequence index and slots differ in size".into()));
        }
        for (slot, seq) in self.slots.iter().enumerate() {
            let id = seq.id;
            if self.index.get(&id) != Some(&(slot as u32)) {
                return Err(violation(format!(
                    "sequence {id} is not indexed at its slot"
                )));
            }
            if seq.num_computed > seq.tokens.len() {
                return Err(violation(format!(
                    "sequence {id}: {} computed > {} known tokens",
                    seq.num_computed,
                    seq.tokens.len()
                )));
            }
            if seq.tables.len() != num_groups {
                return Err(violation(format!(
                    "sequence {id} has {} block tables for {num_groups} groups",
                    seq.tables.len()
                )));
            }
            let len = seq.table_len();
            if seq.tables.iter().any(|t| t.blocks.len() != len) {
                return Err(violation(format!(
                    "sequence {id}: its groups' tables differ in length"
                )));
            }
            if !seq.allocated && (len != 0 || seq.num_computed != 0) {
                return Err(violation(format!(
                    "sequence {id} is not allocated but has blocks or computed tokens"
                )));
            }
            if seq.num_computed > len * bs {
                return Err(violation(format!(
                    "sequence {id}: {} computed tokens exceed its {} table slots",
                    seq.num_computed,
                    len * bs
                )));
            }
            if let Some(r) = seq.reserved {
                if r < seq.num_computed || r > len * bs {
                    return Err(violation(format!(
                        "sequence {id}: reservation {r} outside [computed, table slots]"
                    )));
                }
            }
            swapped += seq.swapped as usize;
            for (g, t) in seq.tables.iter().enumerate() {
                self.check_table(seq, g, t, &mut gpu_refs, &mut cpu_refs)?;
                if seq.swapped {
                    continue;
                }
                for &b in t.blocks[t.num_released..]
                    .iter()
                    .filter(|&&b| b != NULL_BLOCK)
                {
                    let owner = &mut gpu_group[b as usize];
                    if *owner == u8::MAX {
                        *owner = g as u8;
                    } else if *owner as usize != g {
                        return Err(violation(format!(
                            "block {b} is in tables of groups {owner} and {g}; a block holds \
                             one group's KV"
                        )));
                    }
                    if self.pools.cache.is_cached(b) && self.pools.cache.group_of(b) != g {
                        return Err(violation(format!(
                            "block {b} of group {g} is cached as group {}'s",
                            self.pools.cache.group_of(b)
                        )));
                    }
                }
            }
        }
        if swapped != self.num_swapped {
            return Err(violation(format!(
                "{swapped} swapped sequences but the counter says {}",
                self.num_swapped
            )));
        }
        check_pool(&self.pools.gpu, &gpu_refs, "GPU")?;
        check_pool(&self.pools.cpu, &cpu_refs, "CPU")?;
        self.check_writable_blocks()?;
        self.check_in_flight()?;
        self.check_cache()
    }

    /// One group's table of a sequence: its released entries are exactly the blocks no
    /// future query of the group sees, and its blocks are counted as references.
    fn check_table(
        &self,
        seq: &crate::sequence::Sequence,
        g: usize,
        t: &crate::sequence::GroupTable,
        gpu_refs: &mut [u32],
        cpu_refs: &mut [u32],
    ) -> Result<()> {
        let id = seq.id;
        let bs = self.config.block_size;
        if t.dirty_from > t.blocks.len() {
            return Err(violation(format!(
                "sequence {id} group {g}: first changed table entry {} is past its {} entries",
                t.dirty_from,
                t.blocks.len()
            )));
        }
        let release = self.pools.groups[g].released_blocks(seq.num_computed, bs);
        if t.num_released != release {
            return Err(violation(format!(
                "sequence {id} group {g}: {} leading entries released, but {release} blocks \
                 hold only tokens no query at {} or later sees",
                t.num_released, seq.num_computed
            )));
        }
        let (refs, pool) = if seq.swapped {
            (cpu_refs, &self.pools.cpu)
        } else {
            (gpu_refs, &self.pools.gpu)
        };
        let spec = self.pools.groups[g];
        let states = spec.is_recurrent().then(|| self.state_entries(seq, spec));
        if let Some(j) = states
            .as_ref()
            .and_then(|(must, _)| must.iter().find(|&&j| j >= t.blocks.len()))
        {
            return Err(violation(format!(
                "sequence {id} group {g}: entry {j} must hold a state but the table has {} \
                 entries",
                t.blocks.len()
            )));
        }
        for (i, &b) in t.blocks.iter().enumerate() {
            if let Some((must, may_from)) = &states {
                // A recurrent group holds the state after its computed tokens and the
                // states a pending step writes; nothing else but spares a re-allocation
                // left past them.
                let holds = if seq.swapped {
                    t.held_range(spec, seq.num_computed).contains(&i)
                } else {
                    b != NULL_BLOCK
                };
                if !holds && must.contains(&i) {
                    return Err(violation(format!(
                        "sequence {id} group {g}: entry {i} is the null block, but it must \
                         hold a state ({} computed tokens, reservation {:?})",
                        seq.num_computed, seq.reserved
                    )));
                }
                if holds && !must.contains(&i) && !may_from.is_some_and(|f| i >= f) {
                    return Err(violation(format!(
                        "sequence {id} group {g}: entry {i} holds block {b}, but no state is \
                         kept there ({} computed tokens, reservation {:?})",
                        seq.num_computed, seq.reserved
                    )));
                }
                if !holds {
                    continue;
                }
            } else if i < t.num_released {
                if b != NULL_BLOCK {
                    return Err(violation(format!(
                        "sequence {id} group {g}: released entry {i} holds block {b}, not the \
                         null block"
                    )));
                }
                continue;
            }
            if b < pool.first() || b as usize >= pool.num_blocks() {
                return Err(violation(format!(
                    "sequence {id} group {g}: entry {i} holds invalid block {b}"
                )));
            }
            refs[b as usize] += 1;
        }
        Ok(())
    }

    /// A recurrent group's entries of a sequence that must hold a state (the one after
    /// its computed tokens, and those its pending step writes), and the first entry from
    /// which a pending reservation may also hold spare blocks (`None` at rest).
    fn state_entries(
        &self,
        seq: &crate::sequence::Sequence,
        spec: crate::group::GroupSpec,
    ) -> (Vec<usize>, Option<usize>) {
        let bs = self.config.block_size;
        let current = crate::group::GroupSpec::state_entry(seq.num_computed, bs);
        let mut must: Vec<usize> = current.into_iter().collect();
        let mut may_from = None;
        if let Some(r) = seq.reserved {
            must.extend(spec.state_writes(seq.num_computed, r, bs).map(|(j, _)| j));
            may_from = Some(current.map_or(0, |e| e + 1));
        }
        (must, may_from)
    }

    /// Blocks a sequence may write next are its own: every block past its computed
    /// tokens, and with a pending reservation every block that reservation covers, has
    /// one reference and no cache entry, in every group. (The partially filled last block
    /// may be shared until the next `allocate_slots` copies it.)
    fn check_writable_blocks(&self) -> Result<()> {
        let bs = self.config.block_size;
        for seq in &self.slots {
            let first = match seq.reserved {
                Some(r) if r > seq.num_computed => seq.num_computed / bs,
                _ => seq.num_computed.div_ceil(bs),
            };
            let pool = if seq.swapped {
                &self.pools.cpu
            } else {
                &self.pools.gpu
            };
            for (g, t) in seq.tables.iter().enumerate() {
                let spec = self.pools.groups[g];
                let held = t.held_range(spec, seq.num_computed);
                for (i, &b) in t.blocks.iter().enumerate().skip(first) {
                    if i < t.num_released {
                        continue;
                    }
                    // A recurrent group's entries without a state hold no block.
                    let stateless = if seq.swapped {
                        !held.contains(&i)
                    } else {
                        b == NULL_BLOCK
                    };
                    if spec.is_recurrent() && stateless {
                        continue;
                    }
                    let rc = pool.ref_count(b);
                    let cached = !seq.swapped && self.pools.cache.is_cached(b);
                    if rc != 1 || cached {
                        return Err(violation(format!(
                            "sequence {} group {g}: entry {i} (block {b}) may be written next \
                             but has refcount {rc} and cached = {cached}; expected a private \
                             block",
                            seq.id
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Map and per-block entries agree (every cached block is on its group and hash's
    /// list of copies, and only those are), and every entry hashes to its key.
    fn check_cache(&self) -> Result<()> {
        let cache = &self.pools.cache;
        if !self.pools.caching {
            if !cache.is_empty() {
                return Err(violation(
                    "prefix cache holds entries while disabled".into(),
                ));
            }
            return Ok(());
        }
        #[cfg(debug_assertions)]
        let mut hasher = self.hasher.clone();
        // Every copy on each hash's list, once: together they must be every entry.
        let mut on_list: Vec<bool> = vec![false; self.config.num_blocks];
        let mut listed = 0usize;
        for (g, hash, head) in cache.iter() {
            for b in cache.copies(g, hash) {
                if on_list.get(b as usize).copied().unwrap_or(true) {
                    return Err(violation(format!(
                        "block {b} is on the copies of {hash:?} (head {head}) twice, or on \
                         two lists, or is no pool block"
                    )));
                }
                on_list[b as usize] = true;
                listed += 1;
                if cache.group_of(b) != g {
                    return Err(violation(format!(
                        "group {g}'s cache maps {hash:?} to block {b}, of group {}",
                        cache.group_of(b)
                    )));
                }
                if b == NULL_BLOCK {
                    return Err(violation("the null block is in the prefix cache".into()));
                }
                let Some(entry) = cache.entry(b) else {
                    return Err(violation(format!(
                        "cache maps {hash:?} to block {b}, which carries no hash"
                    )));
                };
                if entry.hash != *hash {
                    return Err(violation(format!(
                        "cache maps {hash:?} to block {b}, which carries {:?}",
                        entry.hash
                    )));
                }
                // Release builds do not keep what a block hashes (see `CacheEntry`).
                #[cfg(debug_assertions)]
                {
                    let o = &entry.origin;
                    let recomputed = hasher.block(o.parent.as_ref(), &o.namespace, &o.tokens);
                    if recomputed != *hash {
                        return Err(violation(format!(
                            "block {b}: stored content hashes to {recomputed:?}, not its key {hash:?}"
                        )));
                    }
                }
            }
        }
        if listed != cache.len() {
            return Err(violation(format!(
                "the cache lists {listed} cached blocks but counts {}",
                cache.len()
            )));
        }
        let queue = self.pools.gpu.free_queue();
        for (b, entry) in cache.entries() {
            if on_list.get(b as usize) != Some(&true) {
                return Err(violation(format!(
                    "block {b} carries {:?} but the cache does not map it there",
                    entry.hash
                )));
            }
            // A free cached block waits at its retention priority's level.
            let want = crate::priority_lru::cached_level(self.pools.retention_of(b));
            if let Some(level) = queue.level_of(b).filter(|&l| l != want) {
                return Err(violation(format!(
                    "free cached block {b} is queued at level {level}, not {want} (its \
                     retention priority + 1)"
                )));
            }
        }
        if let Some(tier) = &self.pools.tier {
            tier.check().map_err(violation)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::{KVCacheManager, KvError, ManagerConfig};

    fn busy() -> KVCacheManager {
        let mut c = ManagerConfig::new(16, 4);
        c.num_cpu_blocks = 4;
        let mut m = KVCacheManager::new(c).unwrap();
        let t: Vec<u32> = (0..10).collect();
        m.add_sequence(1, &t, None, None).unwrap();
        m.allocate_slots(1, 10, 0).unwrap().unwrap();
        m.commit(1, 10, &[]).unwrap();
        m.check_invariants().unwrap();
        m
    }

    fn assert_violation(m: &KVCacheManager) {
        assert!(matches!(
            m.check_invariants(),
            Err(KvError::InvariantViolation(_))
        ));
    }

    #[test]
    fn detects_a_refcount_without_a_table_reference() {
        let mut m = busy();
        m.pools.gpu.incref(1);
        assert_violation(&m);
    }

    #[test]
    fn detects_a_referenced_block_in_the_free_queue() {
        let mut m = busy();
        m.pools.gpu.free_queue_mut().push_back(1, 0);
        assert_violation(&m);
    }

    #[test]
    fn detects_a_free_block_missing_from_the_queue() {
        let mut m = busy();
        let b = m.pools.gpu.free_queue().front().unwrap();
        m.pools.gpu.free_queue_mut().remove(b);
        assert_violation(&m);
    }

    #[cfg(debug_assertions)]
    #[test]
    fn detects_a_cache_entry_whose_content_does_not_hash_to_its_key() {
        let mut m = busy();
        let (b, mut entry) = m
            .pools
            .cache
            .entries()
            .next()
            .map(|(b, e)| (b, e.clone()))
            .unwrap();
        m.pools.cache.remove(b);
        entry.origin.tokens = vec![9, 9, 9, 9].into();
        m.pools.cache.insert(0, b, entry);
        assert_violation(&m);
    }

    #[test]
    fn detects_a_computed_count_past_the_table() {
        let mut m = busy();
        m.slots[0].num_computed = 13;
        m.slots[0].tokens.extend([1, 2, 3]);
        assert_violation(&m);
    }

    #[test]
    fn detects_a_wrong_swapped_counter() {
        let mut m = busy();
        m.num_swapped = 1;
        assert_violation(&m);
    }
}
