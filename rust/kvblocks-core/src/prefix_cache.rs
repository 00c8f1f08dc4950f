//! The content-hash prefix cache: hash -> block map plus what each cached block holds.

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHash;

/// What a cached block carries: its hash and the inputs it was computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// The block's hash (its key in the map).
    pub hash: BlockHash,
    /// Hash of the previous block of the chain, `None` for a first block.
    pub parent: Option<BlockHash>,
    /// Digest of the extra keys the block was hashed under.
    pub namespace: BlockHash,
    /// The block's tokens, kept to re-check the hash in `check_invariants`.
    pub tokens: Box<[u32]>,
}

/// Map from content hash to GPU block, with the entry of every cached block.
///
/// Invariant: `map[h] == b` iff `entries[b].hash == h`. A freed cached block keeps its
/// entry (it stays reusable by a later prompt) until it is popped from the free queue.
/// Both maps are sparse, so memory follows the cached blocks, not the pool size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCache {
    map: FxHashMap<BlockHash, u32>,
    entries: FxHashMap<u32, CacheEntry>,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new() -> Self {
        PrefixCache::default()
    }

    /// Number of cached blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is cached.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The block holding content `hash`, if cached.
    #[inline]
    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.map.get(hash).copied()
    }

    /// The entry of `block`, if it is cached.
    #[inline]
    pub fn entry(&self, block: u32) -> Option<&CacheEntry> {
        self.entries.get(&block)
    }

    /// Whether `block` carries a hash.
    #[inline]
    pub fn is_cached(&self, block: u32) -> bool {
        !self.entries.is_empty() && self.entries.contains_key(&block)
    }

    /// Cache `block` under `entry.hash`; the hash must not be cached yet.
    pub fn insert(&mut self, block: u32, entry: CacheEntry) {
        debug_assert!(!self.map.contains_key(&entry.hash));
        debug_assert!(!self.entries.contains_key(&block));
        self.map.insert(entry.hash, block);
        self.entries.insert(block, entry);
    }

    /// Make room for `additional` more entries (one rehash instead of many while a long
    /// prompt's blocks are registered).
    pub fn reserve(&mut self, additional: usize) {
        self.map.reserve(additional);
        self.entries.reserve(additional);
    }

    /// Drop `block` from the cache; returns its hash if it was cached.
    #[inline]
    pub fn remove(&mut self, block: u32) -> Option<BlockHash> {
        if self.entries.is_empty() {
            return None;
        }
        let entry = self.entries.remove(&block)?;
        if self.map.get(&entry.hash) == Some(&block) {
            self.map.remove(&entry.hash);
        }
        Some(entry.hash)
    }

    /// Forget every entry.
    pub fn clear(&mut self) {
        self.map.clear();
        self.entries.clear();
    }

    /// Iterate `(hash, block)` pairs of the map.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, u32)> + '_ {
        self.map.iter().map(|(h, b)| (h, *b))
    }

    /// Iterate `(block, entry)` for every block carrying a hash.
    pub fn entries(&self) -> impl Iterator<Item = (u32, &CacheEntry)> + '_ {
        self.entries.iter().map(|(b, e)| (*b, e))
    }
}
