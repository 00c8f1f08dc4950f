//! Reusable marks for detecting a sequence id listed twice in a batch, and the last
//! batch resolved to slots.

/// Per-slot epoch marks: an id is a duplicate if its slot already carries this epoch.
///
/// Scratch memory only: it never affects behaviour across calls, so it compares equal
/// to any other scratch (snapshots of the manager ignore it).
#[derive(Debug, Clone, Default)]
pub(super) struct BatchScratch {
    marks: Vec<u64>,
    epoch: u64,
    // The last batch of distinct ids resolved to slots: a scheduler passes the same ids
    // to allocate, map, sync and commit every step, and the steps after it.
    memo_ids: Vec<u64>,
    memo_slots: Vec<u32>,
}

impl PartialEq for BatchScratch {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl BatchScratch {
    /// Start a new batch over `num_slots` slots; returns its epoch.
    pub fn next_epoch(&mut self, num_slots: usize) -> u64 {
        if self.marks.len() < num_slots {
            self.marks.resize(num_slots, 0);
        }
        self.epoch += 1;
        self.epoch
    }

    /// The slots of `ids` if they are the last batch remembered (distinct ids, resolved
    /// since the last [`BatchScratch::forget_batch`]).
    #[inline]
    pub fn recall(&self, ids: &[u64]) -> Option<&[u32]> {
        (!ids.is_empty() && self.memo_ids == ids).then_some(&self.memo_slots[..])
    }

    /// Remember a batch of distinct ids and their slots.
    pub fn remember(&mut self, ids: &[u64], slots: &[u32]) {
        self.memo_ids.clear();
        self.memo_ids.extend_from_slice(ids);
        self.memo_slots.clear();
        self.memo_slots.extend_from_slice(slots);
    }

    /// Sequences were added or freed (a freed slot is refilled by another sequence):
    /// the remembered batch may name slots that moved.
    pub fn forget_batch(&mut self) {
        self.memo_ids.clear();
        self.memo_slots.clear();
    }

    /// Mark `slot` for `epoch`; false if it was already marked (a duplicate).
    #[inline]
    pub fn mark(&mut self, slot: u32, epoch: u64) -> bool {
        let m = &mut self.marks[slot as usize];
        if *m == epoch {
            return false;
        }
        *m = epoch;
        true
    }
}
