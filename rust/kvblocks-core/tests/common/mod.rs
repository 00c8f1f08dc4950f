//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod groups;

use kvblocks_core::{HashAlgo, KVCacheManager, KvError, ManagerConfig};

/// The error is `InvalidArgument`.
pub fn is_invalid(e: &KvError) -> bool {
    matches!(e, KvError::InvalidArgument(_))
}

/// The error is `SequenceState`.
pub fn is_state(e: &KvError) -> bool {
    matches!(e, KvError::SequenceState(_))
}

/// The error is `UnknownSequence`.
pub fn is_unknown(e: &KvError) -> bool {
    matches!(e, KvError::UnknownSequence(_))
}

/// The error is `OutOfBlocks`.
pub fn is_oob(e: &KvError) -> bool {
    matches!(e, KvError::OutOfBlocks(_))
}

/// A manager with `num_blocks` GPU blocks of `block_size` tokens, no watermark.
pub fn manager(num_blocks: usize, block_size: usize) -> KVCacheManager {
    let mut c = ManagerConfig::new(num_blocks, block_size);
    c.watermark = 0.0;
    KVCacheManager::new(c).expect("valid config")
}

/// Like [`manager`] with extra settings applied by `f`.
pub fn manager_with(
    num_blocks: usize,
    block_size: usize,
    f: impl FnOnce(&mut ManagerConfig),
) -> KVCacheManager {
    let mut c = ManagerConfig::new(num_blocks, block_size);
    c.watermark = 0.0;
    f(&mut c);
    KVCacheManager::new(c).expect("valid config")
}

/// Tokens `start..start + n`.
pub fn toks(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

/// Assert that `op` fails with an error matching `pred` and leaves `m` unchanged.
pub fn assert_fails_unchanged<T: std::fmt::Debug>(
    m: &mut KVCacheManager,
    op: impl FnOnce(&mut KVCacheManager) -> Result<T, KvError>,
    pred: impl FnOnce(&KvError) -> bool,
) {
    let before = m.clone();
    let r = op(m);
    match r {
        Err(e) => assert!(pred(&e), "unexpected error kind: {e:?}"),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
    assert!(*m == before, "a failing call changed the state");
    m.check_invariants().expect("invariants after failed call");
}

/// Prompt, allocate and commit it whole; returns the allocated blocks.
pub fn prefill(m: &mut KVCacheManager, id: u64, prompt: &[u32]) -> Vec<i32> {
    m.add_sequence(id, prompt, None, None).unwrap();
    let computed = m.num_computed_tokens(id).unwrap();
    let got = m
        .allocate_slots(id, prompt.len() - computed, 0)
        .unwrap()
        .expect("enough blocks");
    m.commit(id, prompt.len() - computed, &[]).unwrap();
    m.check_invariants().unwrap();
    got
}

pub const ALGOS: [HashAlgo; 2] = [HashAlgo::Blake3, HashAlgo::Xxh3_128];
