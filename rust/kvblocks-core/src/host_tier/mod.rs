//! The host tier: prefix blocks kept in host memory below the GPU pool.
//!
//! The core only decides: it keys `capacity` tier slots by block hash, evicts the block of
//! the lowest retention priority ([`RetentionPriority`]; the least recently used one among
//! equals), and issues memory ops ([`MemoryOp`]) that the engine applies to the
//! bytes (`offload`: GPU block -> tier slot, `load`: tier slot -> GPU block).
//!
//! Transfers on the tier side may be asynchronous, so a slot is *pinned* from the moment
//! an op naming it is queued until the engine confirms the op
//! ([`crate::KVCacheManager::confirm_memory_ops`]):
//!
//! * the destination slot of an offload is `Writing`: its hash is known (no second
//!   offload of the same content) but it is no prefix hit, so nothing loads it before it
//!   is written;
//! * the source slot of a load has a reader: it leaves the LRU list, so no offload
//!   overwrites it while the copy may still read it.
//!
//! Pinned slots are never evicted; when every slot is pinned, or every unpinned one holds a
//! block of higher priority than the one offered, the offload is skipped (the block is
//! simply evicted, as without a tier) and counted, so a full tier never fails a request
//! and a flood of low-priority blocks never pushes out high-priority ones.
//!
//! Here is the tier itself ([`HostTier`]); its slots' states are in `slot`, its
//! invariant check in `invariants`, and the public types the manager's API shares with
//! it (memory ops, the offload policy, the event medium, the counters) in their own
//! modules.

mod invariants;
mod medium;
mod memory_op;
mod offload_policy;
#[cfg(test)]
mod priority_tests;
mod slot;
#[cfg(test)]
mod tests;
mod tier_stats;

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHash;
use crate::priority_lru::{cached_level, PriorityLru, EMPTY_LEVEL};
use crate::retention::RetentionPriority;
use slot::{key, Key, Phase, Pin, Slot};

pub use medium::Medium;
pub use memory_op::{MemoryOp, MemoryOpKind};
pub use offload_policy::OffloadPolicy;
pub use tier_stats::TierStats;

/// The host tier's slots, hash map and LRU order (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTier {
    map: FxHashMap<Key, u32>,
    slots: Vec<Slot>,
    /// Unpinned slots in reuse order: empty slots first, then written ones by retention
    /// priority, lowest first, and from least to most recently used among equals.
    lru: PriorityLru,
    /// Pins of ops not yet taken by the engine.
    queued: Vec<Pin>,
    /// Pins of ops taken and not yet confirmed.
    in_flight: Vec<Pin>,
    pub(crate) policy: OffloadPolicy,
    pub(crate) stats: TierStats,
}

impl HostTier {
    /// A tier of `capacity` empty slots.
    pub fn new(capacity: usize, policy: OffloadPolicy) -> Self {
        HostTier {
            map: FxHashMap::default(),
            slots: vec![
                Slot {
                    hash: BlockHash::default(),
                    group: 0,
                    phase: Phase::Empty,
                    readers: 0,
                    priority: RetentionPriority::DEFAULT,
                };
                capacity
            ],
            lru: PriorityLru::new(capacity, 0),
            queued: Vec::new(),
            in_flight: Vec::new(),
            policy,
            stats: TierStats {
                capacity,
                ..TierStats::default()
            },
        }
    }

    /// The slot holding `hash` of `group`, if its KV is written (a prefix hit).
    #[inline]
    pub fn lookup_ready(&self, group: usize, hash: &BlockHash) -> Option<u32> {
        let s = *self.map.get(&key(group, *hash))?;
        (self.slots[s as usize].phase == Phase::Ready).then_some(s)
    }

    /// Copy GPU block `gpu` holding `hash` of `group` (of retention `priority`) into a
    /// slot: queues the op and returns the evicted tier block's group and hash (if any)
    /// and whether the block was stored. Already held: only refreshes its LRU position
    /// and raises its priority.
    pub fn offload(
        &mut self,
        group: usize,
        gpu: u32,
        hash: BlockHash,
        priority: RetentionPriority,
        ops: &mut Vec<MemoryOp>,
    ) -> (Option<(usize, BlockHash)>, bool) {
        if let Some(&s) = self.map.get(&key(group, hash)) {
            self.retain(s, priority);
            if self.lru.contains(s) {
                self.lru.remove(s);
                self.lru.push_back(s, self.slots[s as usize].level());
            }
            return (None, false);
        }
        let Some((s, evicted)) = self.claim_lru_slot(group, hash, priority) else {
            self.stats.offloads_skipped += 1;
            return (None, false);
        };
        self.queued.push(Pin::Write(s));
        ops.push(MemoryOp {
            kind: MemoryOpKind::Offload,
            src: gpu as i64,
            dst: s as i64,
        });
        self.stats.offloads += 1;
        (evicted, true)
    }

    /// Raise the retention of the block `hash` of `group` if the tier holds it (a
    /// sequence of higher priority shares it); its LRU position is unchanged.
    pub fn raise_priority(&mut self, group: usize, hash: &BlockHash, priority: RetentionPriority) {
        if let Some(&s) = self.map.get(&key(group, *hash)) {
            if priority > self.slots[s as usize].priority {
                self.retain(s, priority);
                if self.lru.contains(s) {
                    // Same recency rank as a fresh use: it moves to its new level's back.
                    self.lru.remove(s);
                    self.lru.push_back(s, self.slots[s as usize].level());
                }
            }
        }
    }

    /// Priority of the block a ready slot holds.
    pub fn slot_priority(&self, s: u32) -> RetentionPriority {
        self.slots[s as usize].priority
    }

    fn retain(&mut self, s: u32, priority: RetentionPriority) {
        let slot = &mut self.slots[s as usize];
        slot.priority = slot.priority.max(priority);
    }

    /// Take the next unpinned slot for `hash` (of retention `priority`), to be written,
    /// evicting the block it held, if any: an empty slot, else the least recently used
    /// of the lowest priority, if that priority is not above `priority`. The slot and the
    /// evicted hash; `None` when no slot qualifies. The caller records the write's pin.
    fn claim_lru_slot(
        &mut self,
        group: usize,
        hash: BlockHash,
        priority: RetentionPriority,
    ) -> Option<(u32, Option<(usize, BlockHash)>)> {
        let lowest = self.lru.lowest_level()?;
        if lowest != EMPTY_LEVEL && lowest > cached_level(priority) {
            // Everything evictable is worth more than the block offered.
            return None;
        }
        let s = self.lru.pop_front()?;
        let slot = &mut self.slots[s as usize];
        let evicted = if slot.phase == Phase::Ready {
            self.map.remove(&(slot.group, slot.hash));
            self.stats.evictions += 1;
            Some((slot.group as usize, slot.hash))
        } else {
            None
        };
        *slot = Slot {
            hash,
            group: group as u8,
            phase: Phase::Writing,
            readers: 0,
            priority,
        };
        self.map.insert(key(group, hash), s);
        Some((s, evicted))
    }

    /// The slot holding (or being written with) block `hash` of `group`, if any.
    pub fn slot_of(&self, group: usize, hash: &BlockHash) -> Option<u32> {
        self.map.get(&key(group, *hash)).copied()
    }

    /// Whether slot `s` holds a written block (a prefix hit unless pinned by a load).
    pub fn is_ready(&self, s: u32) -> bool {
        self.slots
            .get(s as usize)
            .is_some_and(|slot| slot.phase == Phase::Ready)
    }

    /// The group and hash slot `s` holds or is being written with (`None`: empty or out
    /// of range).
    pub fn slot_key(&self, s: usize) -> Option<(usize, BlockHash)> {
        let slot = self.slots.get(s)?;
        (slot.phase != Phase::Empty).then_some((slot.group as usize, slot.hash))
    }

    /// Reserve a slot for `hash`, whose KV the engine writes from outside (an import from
    /// a remote store): the slot is `Writing` and its pin already counts as taken, so the
    /// next `confirm` makes it a hit. `None` when the hash is held already or no slot
    /// qualifies (see `claim_lru_slot`); else the slot and the evicted tier hash, if any.
    pub fn reserve(
        &mut self,
        group: usize,
        hash: BlockHash,
        priority: RetentionPriority,
    ) -> Option<(u32, Option<(usize, BlockHash)>)> {
        if self.map.contains_key(&key(group, hash)) {
            return None;
        }
        let (s, evicted) = self.claim_lru_slot(group, hash, priority)?;
        self.in_flight.push(Pin::Write(s));
        self.stats.imports += 1;
        Some((s, evicted))
    }

    /// Pin a ready slot as the source of a load (before the GPU blocks are popped, so the
    /// offloads those pops trigger cannot evict it).
    pub fn pin_read(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.phase, Phase::Ready);
        if slot.readers == 0 {
            self.lru.remove(s);
        }
        slot.readers += 1;
        self.queued.push(Pin::Read(s));
    }

    /// Queue the load of a pinned slot into GPU block `gpu`.
    pub fn load(&mut self, s: u32, gpu: u32, ops: &mut Vec<MemoryOp>) {
        ops.push(MemoryOp {
            kind: MemoryOpKind::Load,
            src: s as i64,
            dst: gpu as i64,
        });
        self.stats.loads += 1;
    }

    /// The engine took the queued ops: their pins wait for confirmation now.
    pub fn mark_taken(&mut self) {
        self.in_flight.append(&mut self.queued);
    }

    /// The engine finished every taken op: release their pins (a written slot becomes a
    /// hit; a slot with no reader left returns to the LRU list as most recently used).
    pub fn confirm(&mut self) {
        for pin in std::mem::take(&mut self.in_flight) {
            match pin {
                Pin::Write(s) => {
                    let slot = &mut self.slots[s as usize];
                    slot.phase = Phase::Ready;
                    if slot.readers == 0 {
                        self.lru.push_back(s, slot.level());
                    }
                }
                Pin::Read(s) => self.release_read(s),
            }
        }
    }

    /// A load from slot `s` ended: with no reader left, a written slot returns to the LRU
    /// list as most recently used.
    fn release_read(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        slot.readers -= 1;
        if slot.readers == 0 && slot.phase == Phase::Ready {
            self.lru.push_back(s, slot.level());
        }
    }

    /// The engine could not finish the taken ops: release their pins trusting nothing
    /// they wrote. A slot an offload or import was writing becomes empty (never a hit; it
    /// is reused first); a load's source keeps its block (a load only read it). Returns
    /// the emptied slots.
    pub fn discard(&mut self) -> Vec<u32> {
        let mut emptied = Vec::new();
        for pin in std::mem::take(&mut self.in_flight) {
            match pin {
                Pin::Write(s) => {
                    let slot = &mut self.slots[s as usize];
                    // A slot being written was taken from the LRU list with no reader,
                    // and loads pin only written slots: nothing else pins it.
                    debug_assert_eq!(slot.readers, 0);
                    self.map.remove(&(slot.group, slot.hash));
                    slot.phase = Phase::Empty;
                    self.lru.push_front(s, EMPTY_LEVEL);
                    emptied.push(s);
                }
                Pin::Read(s) => self.release_read(s),
            }
        }
        emptied
    }

    /// Drop every written, unpinned block; returns their groups and hashes.
    pub fn clear_unpinned(&mut self) -> Vec<(usize, BlockHash)> {
        let mut removed = Vec::new();
        let queued: Vec<u32> = self.lru.iter().collect();
        for s in queued {
            let slot = &mut self.slots[s as usize];
            if slot.phase == Phase::Ready {
                self.map.remove(&(slot.group, slot.hash));
                removed.push((slot.group as usize, slot.hash));
                slot.phase = Phase::Empty;
                // Empty slots are reused first.
                self.lru.remove(s);
                self.lru.push_front(s, EMPTY_LEVEL);
            }
        }
        removed
    }

    /// `(group, hash)` of the written blocks, in slot order.
    pub fn ready_hashes(&self) -> Vec<(usize, BlockHash)> {
        self.slots
            .iter()
            .filter(|slot| slot.phase == Phase::Ready)
            .map(|slot| (slot.group as usize, slot.hash))
            .collect()
    }

    /// Counters with the current occupancy.
    pub fn stats(&self) -> TierStats {
        TierStats {
            num_blocks: self.map.len(),
            num_pinned: self.slots.len() - self.lru.len(),
            ..self.stats
        }
    }
}
