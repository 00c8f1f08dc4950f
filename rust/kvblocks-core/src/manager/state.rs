//! Recurrent-state groups: where a step reads and writes each sequence's state.
//!
//! A recurrent group's table entry `j` holds the state after the tokens `[0, min(computed,
//! (j + 1) * block_size))`: while a block's tokens are computed, its entry's state is
//! updated in place, and once they are all computed it is the state at the block's end.
//! A step computing tokens `[c, r)` reads the state in entry `ceil(c / bs) - 1` (none for
//! `c == 0`) and writes the states of [`GroupSpec::state_writes`]: every checkpoint
//! boundary it crosses (entries whose state the prefix cache keeps) and the state after
//! `r`. `allocate_slots` gives those entries blocks (copying the one written in place if
//! it is shared, as a forked sequence's), `commit` caches the checkpoints and releases
//! every entry but the new state's. The engine computes each boundary's state within
//! the step (e.g. by scanning the step's tokens in segments that end at the boundaries),
//! so chunked prefill need not align chunks with checkpoints.

use super::KVCacheManager;
use crate::error::{KvError, Result};
use crate::group::GroupSpec;
use crate::state_mapping::StateMapping;
use crate::NULL_BLOCK;

impl KVCacheManager {
    /// Where the pending step of each sequence reads and writes the states of recurrent
    /// group `group`: the block holding the state after its computed tokens (`-1`: none
    /// yet, start from zeros) and, for its pending reservation `[computed, reserved)`,
    /// the `(tokens covered, block)` of every state to save (each checkpoint boundary
    /// crossed, then the state after `reserved`). Without a pending reservation a
    /// sequence writes nothing.
    ///
    /// Errors: `InvalidArgument` (group out of range or not recurrent),
    /// `UnknownSequence`, `SequenceState` (swapped).
    pub fn state_mapping(&self, seq_ids: &[u64], group: usize) -> Result<StateMapping> {
        self.check_group(group)?;
        let spec = self.pools.groups[group];
        if !spec.is_recurrent() {
            return Err(KvError::InvalidArgument(format!(
                "state_mapping: group {group} is {spec}, not a recurrent-state group"
            )));
        }
        let bs = self.config.block_size;
        let seqs = self.resident_batch(seq_ids, "state_mapping")?;
        let mut out = StateMapping {
            read_blocks: Vec::with_capacity(seqs.len()),
            write_indptr: Vec::with_capacity(seqs.len() + 1),
            write_positions: Vec::with_capacity(seqs.len()),
            write_blocks: Vec::with_capacity(seqs.len()),
        };
        out.write_indptr.push(0);
        for seq in seqs {
            let table = &seq.tables[group].blocks;
            let c = seq.num_computed;
            let read = GroupSpec::state_entry(c, bs).map_or(-1, |e| i64::from(table[e]));
            out.read_blocks.push(read);
            for (j, p) in spec.state_writes(c, seq.reserved.unwrap_or(c), bs) {
                debug_assert!(table[j] != NULL_BLOCK, "a state write without a block");
                out.write_positions.push(p as i64);
                out.write_blocks.push(i64::from(table[j]));
            }
            out.write_indptr.push(out.write_blocks.len() as i64);
        }
        Ok(out)
    }
}
