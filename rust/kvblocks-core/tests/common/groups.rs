//! Helpers of the KV-cache-group tests (`groups/`).

use kvblocks_core::{GroupSpec, KVCacheManager};

use super::manager_with;

/// The full-attention group.
pub const FULL: GroupSpec = GroupSpec::FullAttention;

/// A sliding-window group of `w` tokens.
pub fn window(w: usize) -> GroupSpec {
    GroupSpec::SlidingWindow { window: w }
}

/// A chunked-local-attention group of `c`-token chunks.
pub fn chunked(c: usize) -> GroupSpec {
    GroupSpec::ChunkedLocalAttention { chunk: c }
}

/// A manager of these groups (no watermark).
pub fn grouped(num_blocks: usize, block_size: usize, groups: &[GroupSpec]) -> KVCacheManager {
    manager_with(num_blocks, block_size, |c| c.groups = groups.to_vec())
}

/// Add a sequence and compute it whole; false (and freed) if the pool is short.
pub fn run(m: &mut KVCacheManager, id: u64, prompt: &[u32]) -> bool {
    m.add_sequence(id, prompt, None, None).unwrap();
    let n = prompt.len() - m.num_computed_tokens(id).unwrap();
    if m.allocate_slots(id, n, 0).unwrap().is_none() {
        m.free(id).unwrap();
        return false;
    }
    m.commit(id, n, &[]).unwrap();
    m.check_invariants().unwrap();
    true
}

/// Non-null entries of a group's table.
pub fn held(m: &KVCacheManager, id: u64, group: usize) -> usize {
    m.group_block_table(id, group)
        .unwrap()
        .iter()
        .filter(|&&b| b != 0)
        .count()
}
