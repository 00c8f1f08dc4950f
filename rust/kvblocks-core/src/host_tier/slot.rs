//! A host-tier slot: the block it holds, its phase, its readers, and what an unconfirmed
//! op pins.

use crate::block_hash::BlockHash;
use crate::priority_lru::{cached_level, EMPTY_LEVEL};
use crate::retention::RetentionPriority;

/// Phase of a tier slot's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Empty,
    /// An offload into the slot is queued or in flight.
    Writing,
    /// The slot holds the block's KV.
    Ready,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) hash: BlockHash,
    /// The KV cache group whose block the slot holds (a block is one group's KV).
    pub(super) group: u8,
    pub(super) phase: Phase,
    /// Loads from the slot that are queued or in flight.
    pub(super) readers: u32,
    /// Retention priority of the block (the highest one offered for it).
    pub(super) priority: RetentionPriority,
}

impl Slot {
    /// The slot's level in the LRU lists.
    pub(super) fn level(&self) -> u8 {
        if self.phase == Phase::Empty {
            EMPTY_LEVEL
        } else {
            cached_level(self.priority)
        }
    }
}

/// What an unconfirmed op pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pin {
    Write(u32),
    Read(u32),
}

/// A tier slot's key: the group and the content hash of the block it holds.
pub(super) type Key = (u8, BlockHash);

/// A group index as stored in a slot (groups are fewer than `MAX_GROUPS`, 64).
#[inline]
pub(super) fn key(group: usize, hash: BlockHash) -> Key {
    (group as u8, hash)
}
