//! Reusable marks for detecting a sequence id listed twice in a batch.

/// Per-slot epoch marks: an id is a duplicate if its slot already carries this epoch.
///
/// Scratch memory only: it never affects behaviour across calls, so it compares equal
/// to any other scratch (snapshots of the manager ignore it).
#[derive(Debug, Clone, Default)]
pub(super) struct BatchScratch {
    marks: Vec<u64>,
    epoch: u64,
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
