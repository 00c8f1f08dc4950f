//! Intrusive doubly linked list of free block ids over a block arena.

/// "No block" marker of the links.
const NIL: u32 = u32::MAX;

/// Free blocks in eviction order: the front is reused first.
///
/// The links live in arrays indexed by block id (an index arena), so push, pop and
/// removal from the middle (a cache hit on a free block) are all O(1) and allocation free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue over ids `0..capacity` holding `first..capacity` in ascending order.
    pub fn new(capacity: usize, first: u32) -> Self {
        let mut q = FreeQueue {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            queued: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in first..capacity as u32 {
            q.push_back(id);
        }
        q
    }

    /// Number of queued blocks.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `id` is queued.
    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        self.queued[id as usize]
    }

    /// The block that `pop_front` would return.
    #[inline]
    pub fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Remove and return the front block.
    #[inline]
    pub fn pop_front(&mut self) -> Option<u32> {
        let id = self.front()?;
        self.remove(id);
        Some(id)
    }

    /// Queue `id` at the front (reused first). `id` must not be queued.
    #[inline]
    pub fn push_front(&mut self, id: u32) {
        debug_assert!(!self.queued[id as usize]);
        let i = id as usize;
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.queued[i] = true;
        self.len += 1;
    }

    /// Queue `id` at the back (reused last). `id` must not be queued.
    #[inline]
    pub fn push_back(&mut self, id: u32) {
        debug_assert!(!self.queued[id as usize]);
        let i = id as usize;
        self.next[i] = NIL;
        self.prev[i] = self.tail;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.queued[i] = true;
        self.len += 1;
    }

    /// Unlink `id` from wherever it sits. `id` must be queued.
    #[inline]
    pub fn remove(&mut self, id: u32) {
        debug_assert!(self.queued[id as usize]);
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.queued[i] = false;
        self.len -= 1;
    }

    /// Iterate the queued ids front to back.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.next[id as usize];
            Some(id)
        })
    }

    /// Verify the links: walking forward and backward visits exactly the queued ids.
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let i = cur as usize;
            if i >= self.queued.len() || !self.queued[i] {
                return Err(format!(
                    "free queue links to block {cur}, which is not marked queued"
                ));
            }
            if self.prev[i] != prev {
                return Err(format!("free queue: block {cur} has a wrong prev link"));
            }
            count += 1;
            if count > self.len {
                return Err("free queue: forward walk longer than its length (cycle?)".into());
            }
            prev = cur;
            cur = self.next[i];
        }
        if prev != self.tail {
            return Err("free queue: tail does not match the last block of the walk".into());
        }
        let marked = self.queued.iter().filter(|&&q| q).count();
        if count != self.len || marked != self.len {
            return Err(format!(
                "free queue: length {} but walk visits {count} and {marked} blocks are marked",
                self.len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &FreeQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn starts_ascending_from_first() {
        let q = FreeQueue::new(5, 1);
        assert_eq!(ids(&q), vec![1, 2, 3, 4]);
        assert_eq!(q.len(), 4);
        assert!(!q.contains(0));
        q.check().unwrap();
    }

    #[test]
    fn push_pop_remove_keep_links_consistent() {
        let mut q = FreeQueue::new(6, 0);
        assert_eq!(q.pop_front(), Some(0));
        assert_eq!(q.pop_front(), Some(1));
        q.remove(3); // middle
        assert_eq!(ids(&q), vec![2, 4, 5]);
        q.remove(5); // tail
        q.remove(2); // head
        assert_eq!(ids(&q), vec![4]);
        q.push_front(1);
        q.push_back(0);
        q.push_front(3);
        assert_eq!(ids(&q), vec![3, 1, 4, 0]);
        assert_eq!(q.front(), Some(3));
        q.check().unwrap();
        while q.pop_front().is_some() {}
        assert_eq!(q.len(), 0);
        assert_eq!(q.front(), None);
        q.check().unwrap();
        q.push_back(2);
        assert_eq!(ids(&q), vec![2]);
        q.check().unwrap();
    }

    #[test]
    fn check_detects_corruption() {
        let mut q = FreeQueue::new(4, 0);
        q.next[1] = 3; // skip block 2
        assert!(q.check().is_err());
        let mut q = FreeQueue::new(4, 0);
        q.len = 3;
        assert!(q.check().is_err());
    }
}
