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

/// The end of a hash's list of copies.
const NO_COPY: u32 = u32::MAX;

/// A cached block dropped from the cache ([`PrefixCache::remove`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uncached {
    /// The group whose KV the block held.
    pub group: usize,
    /// The block's hash.
    pub hash: BlockHash,
    /// Whether it was the last cached copy of `hash` in `group` (the hash is no longer
    /// hittable from the GPU cache).
    pub last_copy: bool,
}

/// Maps from content hash to GPU blocks, one per KV cache group, with the entry of every
/// cached block.
///
/// A block holds one group's KV, so the cache is keyed by group and hash: the same
/// tokens have one block per group. Several blocks of one group may hold the same
/// content (a prefix computed again because it was not a whole hit, or by two sequences
/// at once): every one of them is cached, so the hash stays hittable while any copy is.
/// The map holds one copy of each (group, hash), the head of an intrusive list of all
/// copies threaded through `next`, an arena indexed by block id (4 bytes per block, no
/// allocation per copy). Invariant: `b` is on the list of `maps[g][h]` iff
/// `entries[b].hash == h` and `group_of(b) == g`. A freed cached block keeps its entry
/// (it stays reusable by a later prompt) until it is popped from the free queue. The hash
/// maps are sparse; the entries are an arena indexed by block id that grows to the
/// highest block ever cached (registering a long prompt writes each entry in place
/// instead of hashing it into a second map), so memory follows the cached block ids.
/// With one group no block's group is stored (it is 0); with several, one byte per block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCache {
    maps: Vec<FxHashMap<BlockHash, u32>>,
    entries: Vec<Option<CacheEntry>>,
    /// The next cached copy of a block's (group, hash), `NO_COPY` at the list's end.
    next: Vec<u32>,
    groups: Vec<u8>,
    /// Cached blocks per group (copies included).
    counts: Vec<usize>,
}

impl PrefixCache {
    /// An empty cache over a pool of `num_blocks` blocks.
    ///
    /// The arenas' capacity for the whole pool is reserved up front: address space
    /// only, pages are touched as blocks get cached, and a long prompt's registration
    /// never moves the arenas. If the reservation is refused (a huge pool on a host that
    /// does not overcommit), the arenas grow on demand instead.
    pub fn with_blocks(num_blocks: usize, num_groups: usize) -> Self {
        let mut entries = Vec::new();
        let mut next = Vec::new();
        // A refused reservation only costs the growth copies later.
        let _ = entries.try_reserve_exact(num_blocks);
        let _ = next.try_reserve_exact(num_blocks);
        PrefixCache {
            maps: vec![FxHashMap::default(); num_groups.max(1)],
            entries,
            next,
            groups: if num_groups > 1 {
                vec![0; num_blocks]
            } else {
                Vec::new()
            },
            counts: vec![0; num_groups.max(1)],
        }
    }

    /// Number of cached blocks (all groups, copies of one content included).
    #[inline]
    pub fn len(&self) -> usize {
        self.counts.iter().sum()
    }

    /// Number of cached blocks of `group` (copies included).
    #[inline]
    pub fn group_len(&self, group: usize) -> usize {
        self.counts[group]
    }

    /// True when nothing is cached.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.maps.iter().all(|m| m.is_empty())
    }

    /// A block of `group` holding content `hash`, if cached: the head of its copies.
    #[inline]
    pub fn lookup(&self, group: usize, hash: &BlockHash) -> Option<u32> {
        self.maps[group].get(hash).copied()
    }

    /// Whether cached `block` has a later copy on its hash's list (a head without one is
    /// the only copy).
    #[inline]
    pub fn has_next_copy(&self, block: u32) -> bool {
        self.next.get(block as usize).is_some_and(|&n| n != NO_COPY)
    }

    /// Every cached copy of `group`'s `hash`, the head first.
    pub fn copies(&self, group: usize, hash: &BlockHash) -> impl Iterator<Item = u32> + '_ {
        let mut at = self.lookup(group, hash).unwrap_or(NO_COPY);
        std::iter::from_fn(move || {
            let b = at;
            if b == NO_COPY {
                return None;
            }
            at = self.next.get(b as usize).copied().unwrap_or(NO_COPY);
            Some(b)
        })
    }

    /// The group a cached block's KV belongs to (0 for an uncached block).
    #[inline]
    pub fn group_of(&self, block: u32) -> usize {
        self.groups.get(block as usize).map_or(0, |&g| g as usize)
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

    /// Cache `block` of `group` under `entry.hash`: the hash's only copy, or one more
    /// (after the head, so a lookup keeps answering the block it answered). The block
    /// must not be cached yet.
    pub fn insert(&mut self, group: usize, block: u32, entry: CacheEntry) {
        debug_assert!(!self.is_cached(block));
        let i = block as usize;
        if i >= self.entries.len() {
            self.grow(i + 1);
        }
        match self.maps[group].entry(entry.hash) {
            std::collections::hash_map::Entry::Occupied(head) => {
                let head = *head.get() as usize;
                self.next[i] = self.next[head];
                self.next[head] = block;
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(block);
                self.next[i] = NO_COPY;
            }
        }
        if let Some(g) = self.groups.get_mut(i) {
            // Fewer than MAX_GROUPS (64) groups: fits a byte.
            *g = group as u8;
        }
        self.counts[group] += 1;
        self.entries[i] = Some(entry);
    }

    /// Grow the arenas to `len` blocks.
    fn grow(&mut self, len: usize) {
        self.entries.resize_with(len, || None);
        self.next.resize(len, NO_COPY);
    }

    /// Make room for `additional` more hashes and for entries up to block `max_block`:
    /// one rehash and at most one arena growth while a long prompt's blocks are
    /// registered, instead of many.
    pub fn reserve(&mut self, group: usize, additional: usize, max_block: u32) {
        self.maps[group].reserve(additional);
        let needed = max_block as usize + 1;
        if needed > self.entries.len() {
            self.grow(needed);
        }
    }

    /// Drop `block` from the cache (the other copies of its content stay); returns what
    /// it held if it was cached.
    #[inline]
    pub fn remove(&mut self, block: u32) -> Option<Uncached> {
        let i = block as usize;
        let entry = self.entries.get_mut(i)?.take()?;
        let group = self.group_of(block);
        let after = std::mem::replace(&mut self.next[i], NO_COPY);
        self.counts[group] -= 1;
        let map = &mut self.maps[group];
        let mut last_copy = false;
        match map.get_mut(&entry.hash) {
            Some(head) if *head == block => {
                if after == NO_COPY {
                    map.remove(&entry.hash);
                    last_copy = true;
                } else {
                    *head = after;
                }
            }
            Some(head) => {
                // Lists are short (copies of one content live at once only while
                // prefixes are recomputed): a walk to the predecessor beats a
                // back link per block.
                let mut p = *head;
                while p != NO_COPY && self.next[p as usize] != block {
                    p = self.next[p as usize];
                }
                if p != NO_COPY {
                    self.next[p as usize] = after;
                }
            }
            None => last_copy = true,
        }
        Some(Uncached {
            group,
            hash: entry.hash,
            last_copy,
        })
    }

    /// Forget every entry.
    pub fn clear(&mut self) {
        for m in &mut self.maps {
            m.clear();
        }
        self.entries.clear();
        self.next.clear();
        self.counts.iter_mut().for_each(|c| *c = 0);
    }

    /// Iterate `(group, hash, head block)` of every map.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &BlockHash, u32)> + '_ {
        self.maps
            .iter()
            .enumerate()
            .flat_map(|(g, m)| m.iter().map(move |(h, b)| (g, h, *b)))
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
        let mut cache = PrefixCache::with_blocks(0, 1);
        assert!(!cache.is_cached(7) && cache.remove(7).is_none());
        let (a, b) = (entry(&mut h, 1), entry(&mut h, 2));
        cache.insert(0, 7, a.clone());
        cache.reserve(0, 1, 3);
        cache.insert(0, 3, b.clone());
        assert_eq!(
            (
                cache.len(),
                cache.lookup(0, &a.hash),
                cache.lookup(0, &b.hash)
            ),
            (2, Some(7), Some(3))
        );
        let blocks: Vec<u32> = cache.entries().map(|(blk, _)| blk).collect();
        assert_eq!(blocks, vec![3, 7]);
        assert_eq!(
            cache.remove(7),
            Some(Uncached {
                group: 0,
                hash: a.hash,
                last_copy: true
            })
        );
        assert!(!cache.is_cached(7) && cache.lookup(0, &a.hash).is_none());
        assert_eq!(cache.entry(3), Some(&b));
        cache.clear();
        assert!(cache.is_empty() && !cache.is_cached(3));
    }

    #[test]
    fn groups_cache_the_same_content_in_different_blocks() {
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let mut cache = PrefixCache::with_blocks(8, 2);
        let a = entry(&mut h, 1);
        cache.insert(0, 2, a.clone());
        cache.insert(1, 5, a.clone());
        assert_eq!(
            (cache.lookup(0, &a.hash), cache.lookup(1, &a.hash)),
            (Some(2), Some(5))
        );
        assert_eq!(
            (cache.group_of(2), cache.group_of(5), cache.group_len(1)),
            (0, 1, 1)
        );
        assert_eq!(
            cache.remove(5).map(|u| (u.group, u.last_copy)),
            Some((1, true))
        );
        assert_eq!(
            (cache.lookup(0, &a.hash), cache.lookup(1, &a.hash)),
            (Some(2), None)
        );
    }

    /// Every copy of a content is cached; removing one (head, middle, last) keeps the
    /// others reachable, and the hash leaves the map with its last copy only.
    #[test]
    fn copies_of_one_content_are_all_cached_until_the_last_goes() {
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let mut cache = PrefixCache::with_blocks(8, 2);
        let a = entry(&mut h, 1);
        for b in [2, 4, 6, 7] {
            cache.insert(0, b, a.clone());
        }
        cache.insert(1, 5, a.clone());
        let copies = |c: &PrefixCache| {
            let mut v: Vec<u32> = c.copies(0, &a.hash).collect();
            v.sort_unstable();
            v
        };
        assert_eq!(copies(&cache), vec![2, 4, 6, 7]);
        assert_eq!((cache.len(), cache.group_len(0)), (5, 4));
        assert_eq!(cache.lookup(0, &a.hash), Some(2));
        assert!(cache.has_next_copy(2));
        let gone = |c: &mut PrefixCache, b| c.remove(b).map(|u| (u.group, u.last_copy));
        assert_eq!(gone(&mut cache, 6), Some((0, false))); // a middle copy
        assert_eq!(copies(&cache), vec![2, 4, 7]);
        assert_eq!(gone(&mut cache, 2), Some((0, false))); // the head
        assert_eq!(copies(&cache), vec![4, 7]);
        assert!(cache.lookup(0, &a.hash).is_some());
        assert_eq!(gone(&mut cache, 7), Some((0, false)));
        assert_eq!(copies(&cache), vec![4]);
        assert!(!cache.has_next_copy(4));
        assert_eq!(gone(&mut cache, 4), Some((0, true)));
        assert!(cache.lookup(0, &a.hash).is_none() && cache.copies(0, &a.hash).next().is_none());
        // The other group's copy was never touched.
        assert_eq!((cache.lookup(1, &a.hash), cache.len()), (Some(5), 1));
        // A removed block can be cached again (its link was reset).
        cache.insert(0, 6, a.clone());
        assert_eq!(copies(&cache), vec![6]);
    }
}
