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

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHash;
use crate::priority_lru::{cached_level, PriorityLru, EMPTY_LEVEL};
use crate::retention::RetentionPriority;

/// Kind of a memory op (see [`MemoryOp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryOpKind {
    /// GPU block -> CPU swap block (`swap_out`).
    SwapOut,
    /// CPU swap block -> GPU block (`swap_in`).
    SwapIn,
    /// GPU block -> GPU block (copy-on-write).
    Copy,
    /// GPU block -> host-tier slot.
    Offload,
    /// Host-tier slot -> GPU block.
    Load,
}

impl MemoryOpKind {
    /// The name used by the Python API and `SchedulerOutput.memory_ops`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryOpKind::SwapOut => "swap_out",
            MemoryOpKind::SwapIn => "swap_in",
            MemoryOpKind::Copy => "copy",
            MemoryOpKind::Offload => "offload",
            MemoryOpKind::Load => "load",
        }
    }
}

/// One block move, `src -> dst`, in the id spaces its kind names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryOp {
    /// What moves where.
    pub kind: MemoryOpKind,
    /// Source block (GPU id, CPU id or tier slot).
    pub src: i64,
    /// Destination block (GPU id, CPU id or tier slot).
    pub dst: i64,
}

/// When full GPU blocks are copied to the host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadPolicy {
    /// When a cached GPU block is evicted for reuse (before it is overwritten): only
    /// blocks that would otherwise be lost are copied.
    #[default]
    OnEvict,
    /// When a block enters the GPU prefix cache at `commit`: every cached block is
    /// copied once, and eviction needs no copy.
    WriteThrough,
}

impl OffloadPolicy {
    /// The Python name (`"evict"` / `"commit"`).
    pub fn as_str(self) -> &'static str {
        match self {
            OffloadPolicy::OnEvict => "evict",
            OffloadPolicy::WriteThrough => "commit",
        }
    }
}

impl std::str::FromStr for OffloadPolicy {
    type Err = crate::KvError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "evict" => Ok(OffloadPolicy::OnEvict),
            "commit" => Ok(OffloadPolicy::WriteThrough),
            other => Err(crate::KvError::InvalidArgument(format!(
                "host_offload must be \"evict\" or \"commit\", got {other:?}"
            ))),
        }
    }
}

/// Where a block lives, for the `medium` of KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Medium {
    /// The GPU pool's prefix cache.
    #[default]
    Gpu,
    /// The host tier.
    Cpu,
}

impl Medium {
    /// vLLM's medium names (`"GPU"`, `"CPU"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

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

/// Phase of a tier slot's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Empty,
    /// An offload into the slot is queued or in flight.
    Writing,
    /// The slot holds the block's KV.
    Ready,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    hash: BlockHash,
    /// The KV cache group whose block the slot holds (a block is one group's KV).
    group: u8,
    phase: Phase,
    /// Loads from the slot that are queued or in flight.
    readers: u32,
    /// Retention priority of the block (the highest one offered for it).
    priority: RetentionPriority,
}

impl Slot {
    /// The slot's level in the LRU lists.
    fn level(&self) -> u8 {
        if self.phase == Phase::Empty {
            EMPTY_LEVEL
        } else {
            cached_level(self.priority)
        }
    }
}

/// What an unconfirmed op pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pin {
    Write(u32),
    Read(u32),
}

/// A tier slot's key: the group and the content hash of the block it holds.
type Key = (u8, BlockHash);

/// A group index as stored in a slot (groups are fewer than `MAX_GROUPS`, 64).
#[inline]
fn key(group: usize, hash: BlockHash) -> Key {
    (group as u8, hash)
}

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
                Pin::Read(s) => {
                    let slot = &mut self.slots[s as usize];
                    slot.readers -= 1;
                    if slot.readers == 0 && slot.phase == Phase::Ready {
                        self.lru.push_back(s, slot.level());
                    }
                }
            }
        }
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

    /// `(group, hash)` of the blocks held (written or being written), in slot order.
    pub fn held_hashes(&self) -> Vec<(usize, BlockHash)> {
        self.slots
            .iter()
            .filter(|slot| slot.phase != Phase::Empty)
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

    /// Verify the slot states, the map, the LRU list and the pins.
    pub fn check(&self) -> Result<(), String> {
        self.lru
            .check()
            .map_err(|e| format!("host tier LRU: {e}"))?;
        let mut readers = vec![0u32; self.slots.len()];
        let mut writes = vec![0u32; self.slots.len()];
        for pin in self.queued.iter().chain(&self.in_flight) {
            match *pin {
                Pin::Read(s) => readers[s as usize] += 1,
                Pin::Write(s) => writes[s as usize] += 1,
            }
        }
        let mut held = 0;
        for (s, slot) in self.slots.iter().enumerate() {
            let id = s as u32;
            if slot.readers != readers[s] {
                return Err(format!(
                    "host tier slot {s} has {} readers but {} load pins",
                    slot.readers, readers[s]
                ));
            }
            let writing = slot.phase == Phase::Writing;
            if writes[s] != writing as u32 {
                return Err(format!(
                    "host tier slot {s} is {:?} with {} write pins",
                    slot.phase, writes[s]
                ));
            }
            if slot.phase == Phase::Empty {
                if slot.readers != 0 {
                    return Err(format!("empty host tier slot {s} has readers"));
                }
            } else {
                held += 1;
                if self.map.get(&(slot.group, slot.hash)) != Some(&id) {
                    return Err(format!("host tier slot {s} is not mapped by its hash"));
                }
            }
            let pinned = writing || slot.readers > 0;
            if self.lru.contains(id) == pinned {
                return Err(format!(
                    "host tier slot {s}: pinned = {pinned} but in the LRU list = {}",
                    self.lru.contains(id)
                ));
            }
            if let Some(level) = self.lru.level_of(id) {
                if level != slot.level() {
                    return Err(format!(
                        "host tier slot {s} is queued at level {level}, not {}",
                        slot.level()
                    ));
                }
            }
        }
        if held != self.map.len() {
            return Err(format!(
                "host tier maps {} hashes but holds {held} blocks",
                self.map.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::BlockHasher;
    use crate::config::HashAlgo;

    fn hash(token: u32) -> BlockHash {
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let ns = h.namespace(None, None).expect("no salt, no LoRA");
        h.block(None, &ns, &[token])
    }

    const P: RetentionPriority = RetentionPriority::DEFAULT;

    #[test]
    fn lru_eviction_and_pins() {
        let mut t = HostTier::new(2, OffloadPolicy::OnEvict);
        let mut ops = Vec::new();
        assert_eq!(t.offload(0, 5, hash(1), P, &mut ops), (None, true));
        assert_eq!(t.offload(0, 6, hash(2), P, &mut ops), (None, true));
        // Both slots are being written: pinned, no hit, no room.
        assert!(t.lookup_ready(0, &hash(1)).is_none());
        assert_eq!(t.offload(0, 7, hash(3), P, &mut ops), (None, false));
        assert_eq!(t.stats().offloads_skipped, 1);
        t.check().unwrap();
        // Confirm without taking: still pinned.
        t.confirm();
        assert!(t.lookup_ready(0, &hash(1)).is_none());
        t.mark_taken();
        t.confirm();
        let s1 = t.lookup_ready(0, &hash(1)).unwrap();
        assert!(t.lookup_ready(0, &hash(2)).is_some());
        // A load pins slot 1: the next offload evicts hash(2) instead.
        t.pin_read(s1);
        assert_eq!(
            t.offload(0, 8, hash(3), P, &mut ops),
            (Some((0, hash(2))), true)
        );
        assert_eq!(t.offload(0, 9, hash(4), P, &mut ops), (None, false));
        t.check().unwrap();
        t.mark_taken();
        t.confirm();
        assert!(t.lookup_ready(0, &hash(1)).is_some() && t.lookup_ready(0, &hash(3)).is_some());
        assert_eq!(
            ops.iter().map(|o| (o.src, o.dst)).collect::<Vec<_>>(),
            vec![(5, 0), (6, 1), (8, 1)]
        );
        assert_eq!(t.stats().evictions, 1);
        assert_eq!(t.clear_unpinned().len(), 2);
        t.check().unwrap();
        assert_eq!(t.stats().num_blocks, 0);
    }
}

#[cfg(test)]
mod priority_tests {
    use super::*;
    use crate::block_hash::BlockHasher;
    use crate::config::HashAlgo;

    fn hash(token: u32) -> BlockHash {
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let ns = h.namespace(None, None).expect("no salt, no LoRA");
        h.block(None, &ns, &[token])
    }

    fn prio(p: i64) -> RetentionPriority {
        RetentionPriority::new(p).unwrap()
    }

    fn settle(t: &mut HostTier) {
        t.mark_taken();
        t.confirm();
    }

    #[test]
    fn lowest_priority_is_evicted_first_and_low_offers_are_skipped() {
        let mut t = HostTier::new(3, OffloadPolicy::OnEvict);
        let mut ops = Vec::new();
        t.offload(0, 1, hash(1), prio(90), &mut ops);
        t.offload(0, 2, hash(2), prio(10), &mut ops);
        t.offload(0, 3, hash(3), prio(50), &mut ops);
        settle(&mut t);
        // Full: a priority-50 offer evicts the priority-10 block, though hash(1) is older.
        assert_eq!(
            t.offload(0, 4, hash(4), prio(50), &mut ops),
            (Some((0, hash(2))), true)
        );
        settle(&mut t);
        // Among equals (3 and 4 at 50) the least recently used goes.
        assert_eq!(
            t.offload(0, 5, hash(5), prio(60), &mut ops),
            (Some((0, hash(3))), true)
        );
        settle(&mut t);
        // An offer below everything held is skipped, nothing evicted.
        assert_eq!(t.offload(0, 6, hash(6), prio(10), &mut ops), (None, false));
        assert_eq!(t.stats().offloads_skipped, 1);
        assert!(t.lookup_ready(0, &hash(1)).is_some());
        // Re-offering a held block raises its priority: hash(4) now outranks hash(5).
        t.raise_priority(0, &hash(4), prio(95));
        assert_eq!(
            t.offload(0, 7, hash(7), prio(60), &mut ops),
            (Some((0, hash(5))), true)
        );
        settle(&mut t);
        assert_eq!(
            t.slot_priority(t.lookup_ready(0, &hash(4)).unwrap()),
            prio(95)
        );
        t.check().unwrap();
    }
}
