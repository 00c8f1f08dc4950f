//! Swapping sequences between the GPU and CPU pools.

use rustc_hash::FxHashMap;

use super::KVCacheManager;
use crate::error::{KvError, Result};
use crate::host_tier::MemoryOpKind;
use crate::NULL_BLOCK;

/// Direction of a swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Out,
    In,
}

impl KVCacheManager {
    /// Whether the CPU pool can take the sequences' distinct GPU blocks.
    ///
    /// Errors as `swap_out` for unknown, swapped or mid-step sequences.
    pub fn can_swap_out(&self, seq_ids: &[u64]) -> Result<bool> {
        let (_, blocks) = self.swap_plan(seq_ids, Direction::Out)?;
        Ok(blocks.len() <= self.pools.cpu.num_free())
    }

    /// Whether the GPU pool can take the swapped sequences' distinct blocks, keeping
    /// the watermark free. Errors as `swap_in`.
    pub fn can_swap_in(&self, seq_ids: &[u64]) -> Result<bool> {
        let (_, blocks) = self.swap_plan(seq_ids, Direction::In)?;
        let free = self.pools.gpu.num_free();
        Ok(blocks.len() <= free && free - blocks.len() >= self.watermark_blocks)
    }

    /// Move the sequences' blocks to the CPU pool; returns `(gpu, cpu)` rows.
    ///
    /// A GPU block shared by several of the sequences maps to one CPU block; rows follow
    /// first appearance (sequence order, then group order, then table order). Null
    /// entries stay null.
    /// Errors: `OutOfBlocks` if the CPU pool is short; `SequenceState` if a sequence is
    /// swapped or has a pending reservation.
    pub fn swap_out(&mut self, seq_ids: &[u64]) -> Result<Vec<[i64; 2]>> {
        let (slots, blocks) = self.swap_plan(seq_ids, Direction::Out)?;
        if blocks.len() > self.pools.cpu.num_free() {
            return Err(KvError::OutOfBlocks(format!(
                "swap_out needs {} CPU blocks, {} are free",
                blocks.len(),
                self.pools.cpu.num_free()
            )));
        }
        let mut map = FxHashMap::with_capacity_and_hasher(blocks.len(), Default::default());
        let mut rows = Vec::with_capacity(blocks.len());
        for &g in &blocks {
            let Some(c) = self.pools.cpu.pop_free() else {
                return Err(KvError::InvariantViolation(
                    "CPU pool shrank mid-swap".into(),
                ));
            };
            // pop_free gave the one reference of the first appearance; the rest are added
            // below while the tables are rewritten.
            self.pools.cpu.decref(c);
            map.insert(g, c);
            rows.push([g as i64, c as i64]);
        }
        for &slot in &slots {
            let seq = &mut self.slots[slot as usize];
            for t in seq.tables.iter_mut().rev() {
                for i in (0..t.blocks.len()).rev() {
                    let g = t.blocks[i];
                    if g == NULL_BLOCK {
                        continue;
                    }
                    let c = map[&g];
                    self.pools.cpu.incref(c);
                    t.blocks[i] = c;
                    self.pools.release_gpu(g);
                }
            }
            // CPU ids never reach a caller's table (sync refuses swapped sequences);
            // swap_in marks the entries it rewrites.
            seq.swapped = true;
        }
        self.num_swapped += slots.len();
        self.pools.counters.blocks_swapped_out += blocks.len() as u64;
        self.queue_swap(MemoryOpKind::SwapOut, &rows);
        Ok(rows)
    }

    /// Move swapped sequences back; returns `(cpu, gpu)` rows. `OutOfBlocks` if the GPU
    /// pool is short (the watermark does not apply). Swapped-in blocks are uncached.
    pub fn swap_in(&mut self, seq_ids: &[u64]) -> Result<Vec<[i64; 2]>> {
        let (slots, blocks) = self.swap_plan(seq_ids, Direction::In)?;
        if blocks.len() > self.pools.gpu.num_free() {
            return Err(KvError::OutOfBlocks(format!(
                "swap_in needs {} GPU blocks, {} are free",
                blocks.len(),
                self.pools.gpu.num_free()
            )));
        }
        let mut map = FxHashMap::with_capacity_and_hasher(blocks.len(), Default::default());
        let mut rows = Vec::with_capacity(blocks.len());
        for &c in &blocks {
            let Some(g) = self.pools.pop_gpu() else {
                return Err(KvError::InvariantViolation(
                    "GPU pool shrank mid-swap".into(),
                ));
            };
            self.pools.gpu.decref(g);
            map.insert(c, g);
            rows.push([c as i64, g as i64]);
        }
        for &slot in &slots {
            let seq = &mut self.slots[slot as usize];
            for t in seq.tables.iter_mut().rev() {
                for i in (t.num_released..t.blocks.len()).rev() {
                    let c = t.blocks[i];
                    let g = map[&c];
                    self.pools.gpu.incref(g);
                    t.blocks[i] = g;
                    self.pools.release_cpu(c);
                }
                t.dirty_from = t.dirty_from.min(t.num_released);
            }
            seq.swapped = false;
        }
        self.num_swapped -= slots.len();
        self.pools.counters.blocks_swapped_in += blocks.len() as u64;
        self.queue_swap(MemoryOpKind::SwapIn, &rows);
        Ok(rows)
    }

    /// Validate a swap and list the distinct source blocks in order of first appearance.
    fn swap_plan(&self, seq_ids: &[u64], dir: Direction) -> Result<(Vec<u32>, Vec<u32>)> {
        // Swaps are rare: a set is cheap enough for the duplicate check here.
        let mut ids = rustc_hash::FxHashSet::default();
        let mut slots = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            slots.push(self.slot_of(id)? as u32);
            if !ids.insert(id) {
                return Err(KvError::InvalidArgument(format!(
                    "sequence id {id} is listed twice; expected distinct ids"
                )));
            }
        }
        for &slot in &slots {
            let seq = &self.slots[slot as usize];
            match dir {
                Direction::Out => {
                    Self::require_resident(seq, "swap_out")?;
                    if seq.reserved.is_some() {
                        return Err(KvError::SequenceState(format!(
                            "swap_out: sequence {} has allocated but uncommitted slots; \
                             commit first",
                            seq.id
                        )));
                    }
                }
                Direction::In => {
                    if !seq.swapped {
                        return Err(KvError::SequenceState(format!(
                            "swap_in: sequence {} is not swapped out",
                            seq.id
                        )));
                    }
                }
            }
        }
        let mut seen = rustc_hash::FxHashSet::default();
        let mut blocks = Vec::new();
        for &slot in &slots {
            let seq = &self.slots[slot as usize];
            for t in seq.tables.iter() {
                for (i, &b) in t.blocks.iter().enumerate() {
                    let is_null = match dir {
                        Direction::Out => b == NULL_BLOCK,
                        Direction::In => i < t.num_released,
                    };
                    if !is_null && seen.insert(b) {
                        blocks.push(b);
                    }
                }
            }
        }
        Ok((slots, blocks))
    }
}
