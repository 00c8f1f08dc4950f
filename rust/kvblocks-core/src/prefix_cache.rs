//! The content-hash prefix cache: hash -> block map plus what each cached block holds.

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHash;

/// What a cached block carries: its hash and the inputs it was computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheEntry {
    /// The block's hash (its key in the map).
    pub hash: BlockHash,
    /// Hash of the previous block of the chain, `None` for a first block.
    pub parent: Option<BlockHash>,
    /// Digest of the extra keys the block was hashed under.
    pub namespace: BlockHash,
}

/// Map from content hash to GPU block, with per-block entries and token copies.
///
/// Invariant: `map[h] == b` iff `entries[b].hash == h`. A freed cached block keeps its
/// entry (it stays reusable by a later prompt) until it is popped from the free queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCache {
    map: FxHashMap<BlockHash, u32>,
    entries: Vec<Option<CacheEntry>>,
    tokens: Vec<u32>,
    block_size: usize,
}

impl PrefixCache {
    /// An empty cache over `num_blocks` GPU block ids.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        PrefixCache {
            map: FxHashMap::default(),
            entries: vec![None; num_blocks],
            // Zeroed allocation: pages are only touched for blocks that get cached.
            tokens: vec![0; num_blocks * block_size],
            block_size,
        }
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
        self.entries[block as usize].as_ref()
    }

    /// Whether `block` carries a hash.
    #[inline]
    pub fn is_cached(&self, block: u32) -> bool {
        self.entries[block as usize].is_some()
    }

    /// The tokens kept for `block` (meaningful only while cached).
    #[inline]
    pub fn tokens(&self, block: u32) -> &[u32] {
        let s = block as usize * self.block_size;
        &self.tokens[s..s + self.block_size]
    }

    /// Cache `block` under `entry.hash`; the hash must not be cached yet.
    pub fn insert(&mut self, block: u32, entry: CacheEntry, tokens: &[u32]) {
        debug_assert!(!self.map.contains_key(&entry.hash));
        debug_assert!(self.entries[block as usize].is_none());
        self.map.insert(entry.hash, block);
        self.entries[block as usize] = Some(entry);
        let s = block as usize * self.block_size;
        self.tokens[s..s + self.block_size].copy_from_slice(tokens);
    }

    /// Drop `block` from the cache; returns its hash if it was cached.
    #[inline]
    pub fn remove(&mut self, block: u32) -> Option<BlockHash> {
        let entry = self.entries[block as usize].take()?;
        if self.map.get(&entry.hash) == Some(&block) {
            self.map.remove(&entry.hash);
        }
        Some(entry.hash)
    }

    /// Forget every entry.
    pub fn clear(&mut self) {
        for (_, b) in self.map.drain() {
            self.entries[b as usize] = None;
        }
    }

    /// Iterate `(hash, block)` pairs of the map.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, u32)> + '_ {
        self.map.iter().map(|(h, b)| (h, *b))
    }

    /// Iterate `(block, entry)` for every block carrying a hash.
    pub fn entries(&self) -> impl Iterator<Item = (u32, &CacheEntry)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(b, e)| e.as_ref().map(|e| (b as u32, e)))
    }
}
