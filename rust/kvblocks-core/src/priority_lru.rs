//! Eviction-ordered lists of free blocks or host-tier slots, one per retention level,
//! over one index arena.

/// "No slot" marker of the links.
const NIL: u32 = u32::MAX;
/// Levels: empty slots (uncached blocks), then one per retention priority `0..=100`
/// (levels up to 101 are used; 128, a power of two, lets `slot` mask an index instead of
/// bounds-checking it, and fits the `u128` mask).
pub(crate) const LEVELS: usize = 128;
/// The level of empty slots and uncached blocks (reused before any cached one).
pub(crate) const EMPTY_LEVEL: u8 = 0;
/// `level` of an id that is not queued (one byte per id says both whether and where).
const NOT_QUEUED: u8 = u8::MAX;

/// The level of a cached block or written slot of retention `priority`.
#[inline]
pub(crate) fn cached_level(priority: crate::RetentionPriority) -> u8 {
    priority.get() + 1
}

/// Queued ids in eviction order: the lowest non-empty level first, within a level the
/// front first (pushed to the front, or least recently pushed to the back). With every
/// cached id at one level this is a single queue with uncached ids in front and cached
/// ones behind, which is vLLM's free-queue order.
///
/// One intrusive doubly linked list per level, sharing the link arrays (a slot sits in at
/// most one list) and a bit mask of the non-empty levels, so push, remove and pop are
/// O(1) whatever the number of levels in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriorityLru {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Level of each queued id, `NOT_QUEUED` for the others.
    level: Vec<u8>,
    head: [u32; LEVELS],
    tail: [u32; LEVELS],
    /// Bit `l` set iff level `l` holds a slot.
    nonempty: u128,
    len: usize,
}

impl PriorityLru {
    /// Ids `first..capacity` queued at the empty level, ascending.
    pub fn new(capacity: usize, first: u32) -> Self {
        let mut q = PriorityLru {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            level: vec![NOT_QUEUED; capacity],
            head: [NIL; LEVELS],
            tail: [NIL; LEVELS],
            nonempty: 0,
            len: 0,
        };
        for id in first..capacity as u32 {
            q.push_back(id, EMPTY_LEVEL);
        }
        q
    }

    /// The id `pop_front` would return.
    #[cfg(test)]
    pub fn front(&self) -> Option<u32> {
        Some(self.head[Self::slot(self.lowest_level()?)])
    }

    /// Queued slots.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `id` is queued.
    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        self.level[id as usize] != NOT_QUEUED
    }

    /// Array index of a level (masked: never out of bounds, no check on the hot path).
    #[inline]
    fn slot(level: u8) -> usize {
        usize::from(level) & (LEVELS - 1)
    }

    /// The lowest non-empty level, if any slot is queued.
    #[inline]
    pub fn lowest_level(&self) -> Option<u8> {
        (self.nonempty != 0).then(|| self.nonempty.trailing_zeros() as u8)
    }

    /// Remove and return the next slot to reuse.
    #[inline]
    pub fn pop_front(&mut self) -> Option<u32> {
        let l = Self::slot(self.lowest_level()?);
        let id = self.head[l];
        let i = id as usize;
        // Unlink the head of level `l` (its level is known: no lookup, fewer branches).
        let n = self.next[i];
        self.head[l] = n;
        if n == NIL {
            self.tail[l] = NIL;
            self.nonempty &= !(1 << l);
        } else {
            self.prev[n as usize] = NIL;
        }
        self.next[i] = NIL;
        self.level[i] = NOT_QUEUED;
        self.len -= 1;
        Some(id)
    }

    /// Queue `id` at the back of `level` (reused last among its level).
    #[inline]
    pub fn push_back(&mut self, id: u32, level: u8) {
        debug_assert!(!self.contains(id) && usize::from(level) < LEVELS);
        let (i, l) = (id as usize, Self::slot(level));
        self.next[i] = NIL;
        self.prev[i] = self.tail[l];
        if self.tail[l] == NIL {
            self.head[l] = id;
            self.nonempty |= 1 << l;
        } else {
            self.next[self.tail[l] as usize] = id;
        }
        self.tail[l] = id;
        self.level[i] = level;
        self.len += 1;
    }

    /// Queue `id` at the front of `level` (reused first among its level).
    #[inline]
    pub fn push_front(&mut self, id: u32, level: u8) {
        debug_assert!(!self.contains(id) && usize::from(level) < LEVELS);
        let (i, l) = (id as usize, Self::slot(level));
        self.prev[i] = NIL;
        self.next[i] = self.head[l];
        if self.head[l] == NIL {
            self.tail[l] = id;
            self.nonempty |= 1 << l;
        } else {
            self.prev[self.head[l] as usize] = id;
        }
        self.head[l] = id;
        self.level[i] = level;
        self.len += 1;
    }

    /// Unlink a queued `id`.
    #[inline]
    pub fn remove(&mut self, id: u32) {
        debug_assert!(self.contains(id));
        let i = id as usize;
        let l = Self::slot(self.level[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head[l] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail[l] = p;
        } else {
            self.prev[n as usize] = p;
        }
        if self.head[l] == NIL {
            self.nonempty &= !(1 << l);
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.level[i] = NOT_QUEUED;
        self.len -= 1;
    }

    /// Level of a queued slot.
    #[inline]
    pub fn level_of(&self, id: u32) -> Option<u8> {
        self.contains(id).then(|| self.level[id as usize])
    }

    /// Queued slots in eviction order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..LEVELS).flat_map(move |l| {
            let mut cur = self.head[l];
            std::iter::from_fn(move || {
                if cur == NIL {
                    return None;
                }
                let id = cur;
                cur = self.next[id as usize];
                Some(id)
            })
        })
    }

    /// Verify the links of every level, the mask and the length.
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0usize;
        for l in 0..LEVELS {
            if ((self.nonempty >> l) & 1 == 1) != (self.head[l] != NIL) {
                return Err(format!(
                    "priority LRU: level {l} mask bit disagrees with its head"
                ));
            }
            let mut prev = NIL;
            let mut cur = self.head[l];
            while cur != NIL {
                let i = cur as usize;
                if i >= self.level.len() || usize::from(self.level[i]) != l {
                    return Err(format!(
                        "priority LRU: level {l} links to slot {cur} wrongly"
                    ));
                }
                if self.prev[i] != prev {
                    return Err(format!("priority LRU: slot {cur} has a wrong prev link"));
                }
                count += 1;
                if count > self.len {
                    return Err("priority LRU: walk longer than its length (cycle?)".into());
                }
                prev = cur;
                cur = self.next[i];
            }
            if prev != self.tail[l] {
                return Err(format!(
                    "priority LRU: level {l} tail does not match its walk"
                ));
            }
        }
        let marked = self.level.iter().filter(|&&l| l != NOT_QUEUED).count();
        if count != self.len || marked != self.len {
            return Err(format!(
                "priority LRU: length {} but walks visit {count} and {marked} slots are marked",
                self.len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_level_first_then_lru() {
        let mut q = PriorityLru::new(6, 0);
        let order: Vec<u32> = q.iter().collect();
        assert_eq!(order, vec![0, 1, 2, 3, 4, 5]);
        for _ in 0..6 {
            q.pop_front();
        }
        assert_eq!(q.lowest_level(), None);
        q.push_back(0, 50);
        q.push_back(1, 10);
        q.push_back(2, 50);
        q.push_back(3, 10);
        q.push_front(4, EMPTY_LEVEL);
        q.check().unwrap();
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![4, 1, 3, 0, 2]);
        assert_eq!(q.pop_front(), Some(4));
        q.remove(1);
        assert_eq!(q.level_of(3), Some(10));
        assert_eq!(q.pop_front(), Some(3));
        assert_eq!(q.lowest_level(), Some(50));
        q.push_back(1, 101);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 2, 1]);
        q.check().unwrap();
    }

    #[test]
    fn check_detects_corruption() {
        let mut q = PriorityLru::new(4, 1);
        assert_eq!((q.len(), q.front(), q.contains(0)), (3, Some(1), false));
        q.nonempty = 0;
        assert!(q.check().is_err());
        let mut q = PriorityLru::new(4, 0);
        q.len = 3;
        assert!(q.check().is_err());
    }
}
