//! [`HostTier::check`]: the consistency of the slots, the map, the LRU list and the pins.

use super::slot::{Phase, Pin};
use super::HostTier;

impl HostTier {
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
