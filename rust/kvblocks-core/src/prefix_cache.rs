//! The content-hash prefix cache: hash -> block map plus what each cached block holds.

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHash;

/// What a cached block carries: its hash (and, in debug builds, what it hashes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// The block's hash (its key in the map).
    pub hash: BlockHash,
    /// The inputs of the hash, so `check_invariants` can re-hash the block. Debug builds
    /// only: a block's tokens cost ~200 bytes per cached block and a copy on every
    /// commit, for a check no release path needs.
    #[cfg(debug_assertions)]
    pub origin: BlockOrigin,
}

impl CacheEntry {
    /// The entry of a block hashed from `parent`, `namespace` and `tokens`; the inputs are
    /// kept in debug builds only.
    #[cfg_attr(not(debug_assertions), allow(unused_variables))]
    pub fn new(
        hash: BlockHash,
        parent: Option<BlockHash>,
        namespace: BlockHash,
        tokens: &[u32],
    ) -> Self {
        CacheEntry {
            hash,
            #[cfg(debug_assertions)]
            origin: BlockOrigin {
                parent,
                namespace,
                tokens: tokens.into(),
            },
        }
    }
}

// Release builds keep nothing but the hash per cached block (the memory per block the
// README states); every release build, the wheel's included, checks it.
#[cfg(not(debug_assertions))]
const _: () = assert!(std::mem::size_of::<Option<CacheEntry>>() == 34);

/// The inputs a cached block's hash was computed from (debug builds only).
#[cfg(debug_assertions)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockOrigin {
    /// Hash of the previous block of the chain, `None` for a first block.
    pub parent: Option<BlockHash>,
    /// Digest of the extra keys the block was hashed under.
    pub namespace: BlockHash,
    /// The block's tokens.
    pub tokens: Box<[u32]>,
}

/// Map from content hash to GPU block, with the entry of every cached block.
///
/// Invariant: `map[h] == b` iff `entries[b].hash == h`. A freed cached block keeps its
/// entry (it stays reusable by a later prompt) until it is popped from the free queue.
/// The hash map is sparse; the entries are an arena indexed by block id that grows to
/// the highest block ever cached (registering a long prompt writes each entry in place
/// instead of hashing it into a second map), so memory follows the cached block ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCache {
    map: FxHashMap<BlockHash, u32>,
    entries: Vec<Option<CacheEntry>>,
}

impl PrefixCache {
    /// An empty cache over a pool of `num_blocks` blocks.
    ///
    /// The entry arena's capacity for the whole pool is reserved up front: address space
    /// only, pages are touched as blocks get cached, and a long prompt's registration
    /// never moves the arena. If the reservation is refused (a huge pool on a host that
    /// does not overcommit), the arena grows on demand instead.
    pub fn with_blocks(num_blocks: usize) -> Self {
        let mut entries = Vec::new();
        // A refused reservation only costs the growth copies later.
        let _ = entries.try_reserve_exact(num_blocks);
        PrefixCache {
            map: FxHashMap::default(),
            entries,
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
        self.entries.get(block as usize)?.as_ref()
    }

    /// Whether `block` carries a hash.
    #[inline]
    pub fn is_cached(&self, block: u32) -> bool {
        self.entry(block).is_some()
    }

    /// Cache `block` under `entry.hash`; the hash must not be cached yet.
    pub fn insert(&mut self, block: u32, entry: CacheEntry) {
        debug_assert!(!self.map.contains_key(&entry.hash));
        debug_assert!(!self.is_cached(block));
        self.map.insert(entry.hash, block);
        let i = block as usize;
        if i >= self.entries.len() {
            self.entries.resize_with(i + 1, || None);
        }
        self.entries[i] = Some(entry);
    }

    /// Make room for `additional` more hashes and for entries up to block `max_block`:
    /// one rehash and at most one arena growth while a long prompt's blocks are
    /// registered, instead of many.
    pub fn reserve(&mut self, additional: usize, max_block: u32) {
        self.map.reserve(additional);
        let needed = max_block as usize + 1;
        if needed > self.entries.len() {
            self.entries.resize_with(needed, || None);
        }
    }

    /// Drop `block` from the cache; returns its hash if it was cached.
    #[inline]
    pub fn remove(&mut self, block: u32) -> Option<BlockHash> {
        let entry = self.entries.get_mut(block as usize)?.take()?;
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
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(b, e)| Some((b as u32, e.as_ref()?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::BlockHasher;
    use crate::config::HashAlgo;

    fn entry(h: &mut BlockHasher, token: u32) -> CacheEntry {
        let ns = h.namespace(None, None).unwrap();
        CacheEntry {
            hash: h.block(None, &ns, &[token]),
            #[cfg(debug_assertions)]
            origin: BlockOrigin {
                parent: None,
                namespace: ns,
                tokens: vec![token].into(),
            },
        }
    }

    /// The hash-map entry the README's per-block figure counts.
    #[test]
    fn a_cache_map_entry_is_forty_bytes() {
        assert_eq!(std::mem::size_of::<(BlockHash, u32)>(), 40);
    }

    #[test]
    fn arena_grows_past_its_reservation() {
        // No reservation at all: the path taken when the up-front one is refused.
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let mut cache = PrefixCache::with_blocks(0);
        assert!(!cache.is_cached(7) && cache.remove(7).is_none());
        let (a, b) = (entry(&mut h, 1), entry(&mut h, 2));
        cache.insert(7, a.clone());
        cache.reserve(1, 3);
        cache.insert(3, b.clone());
        assert_eq!(
            (cache.len(), cache.lookup(&a.hash), cache.lookup(&b.hash)),
            (2, Some(7), Some(3))
        );
        let blocks: Vec<u32> = cache.entries().map(|(blk, _)| blk).collect();
        assert_eq!(blocks, vec![3, 7]);
        assert_eq!(cache.remove(7), Some(a.hash));
        assert!(!cache.is_cached(7) && cache.lookup(&a.hash).is_none());
        assert_eq!(cache.entry(3), Some(&b));
        cache.clear();
        assert!(cache.is_empty() && !cache.is_cached(3));
    }
}
