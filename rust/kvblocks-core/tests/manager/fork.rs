//! Unit tests of `fork` and copy-on-write.

use crate::common::*;
use kvblocks_core::{BatchArg, KvError};

// -- fork and copy-on-write -------------------------------------------------------

#[test]
fn fork_shares_blocks_and_cow_copies_the_written_block() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 6)); // [1, 2(partial)]
    m.fork(1, 2).unwrap();
    assert_eq!(m.block_ref_count(1), 2);
    assert_eq!(m.block_ref_count(2), 2);
    assert_eq!(m.num_computed_tokens(2).unwrap(), 6);
    m.check_invariants().unwrap();
    m.commit(2, 0, &[77]).unwrap();
    m.commit(1, 0, &[66]).unwrap();
    assert_eq!(m.allocate_slots(2, 1, 0).unwrap(), Some(vec![3]));
    assert_eq!(m.block_table(2).unwrap(), vec![1, 3]);
    assert_eq!(m.take_copy_on_writes().unwrap(), vec![[2, 3]]);
    assert!(m.take_copy_on_writes().unwrap().is_empty());
    // the parent is now the only owner of block 2: written in place
    assert_eq!(m.allocate_slots(1, 1, 0).unwrap(), Some(vec![]));
    assert_eq!(m.stats().cow_copies, 1);
    m.commit(1, 1, &[]).unwrap();
    m.commit(2, 1, &[]).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn cow_replacement_comes_before_appended_blocks() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 6));
    m.fork(1, 2).unwrap();
    m.commit(2, 0, &[1, 2, 3]).unwrap();
    assert_eq!(m.allocate_slots(2, 3, 0).unwrap(), Some(vec![3, 4]));
    assert_eq!(m.take_copy_on_writes().unwrap(), vec![[2, 3]]);
    m.check_invariants().unwrap();
}

#[test]
fn no_cow_when_nothing_is_written_or_at_block_boundary() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 6));
    m.fork(1, 2).unwrap();
    assert_eq!(m.allocate_slots(2, 0, 0).unwrap(), Some(vec![]));
    assert!(m.take_copy_on_writes().unwrap().is_empty());
    m.commit(2, 0, &[]).unwrap();
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 8));
    m.fork(1, 2).unwrap();
    m.commit(2, 0, &[5]).unwrap();
    assert_eq!(m.allocate_slots(2, 1, 0).unwrap(), Some(vec![3]));
    assert!(m.take_copy_on_writes().unwrap().is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn cow_short_pool_returns_none_unchanged() {
    let mut m = manager(3, 4); // 2 usable
    prefill(&mut m, 1, &toks(0, 6)); // takes both
    m.fork(1, 2).unwrap();
    m.commit(2, 0, &[9]).unwrap();
    let before = m.clone();
    assert_eq!(m.allocate_slots(2, 1, 0).unwrap(), None);
    assert!(m == before);
}

/// Regression (issue 7, defect 1): spare blocks past the computed tokens (from lookahead
/// or a commit smaller than its reservation) were shared by `fork`, and copy-on-write
/// only looked at one block, so parent and child wrote the same slots.
#[test]
fn fork_does_not_share_spare_blocks() {
    let mut m = manager(16, 4);
    m.add_sequence(1, &toks(0, 12), None, None).unwrap();
    m.allocate_slots(1, 4, 8).unwrap().unwrap(); // 3 blocks, 1 of them computed below
    m.commit(1, 4, &[]).unwrap();
    m.fork(1, 2).unwrap();
    assert_eq!(m.block_table(2).unwrap().len(), 1);
    m.check_invariants().unwrap();
    m.allocate_slots(1, 8, 0).unwrap().unwrap();
    m.allocate_slots(2, 8, 0).unwrap().unwrap();
    let a = m.slot_mapping(&[1], None).unwrap();
    let b = m.slot_mapping(&[2], None).unwrap();
    assert!(
        a.iter().all(|s| !b.contains(s)),
        "{a:?} and {b:?} share slots"
    );
    m.check_invariants().unwrap();
}

/// Regression (issue 7, defect 2): after `fork` + `commit(child, 0, [t])` with no
/// `allocate_slots`, `slot_mapping` mapped both sequences onto the shared block.
#[test]
fn slot_mapping_needs_a_reservation() {
    let mut m = manager(16, 4);
    prefill(&mut m, 1, &toks(0, 6));
    m.commit(1, 0, &[9]).unwrap();
    m.fork(1, 2).unwrap();
    m.commit(2, 0, &[7]).unwrap();
    assert_fails_unchanged(&mut m, |m| m.slot_mapping(&[1], None), is_state);
    assert_fails_unchanged(&mut m, |m| m.slot_mapping(&[2], None), is_state);
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    m.allocate_slots(2, 2, 0).unwrap().unwrap();
    let (a, b) = (
        m.slot_mapping(&[1], None).unwrap(),
        m.slot_mapping(&[2], None).unwrap(),
    );
    assert_ne!(a, b);
}

/// A batch reports the prefix each sequence claimed as made: serving an earlier entry
/// can evict a later entry's probed prefix (issue 7, defect 4).
#[test]
fn allocate_batch_reports_claims_and_new_blocks() {
    let mut m = manager(16, 4); // 15 usable
    prefill(&mut m, 1, &toks(0, 9)); // blocks 1, 2 cached, 3 not
    prefill(&mut m, 5, &toks(200, 9)); // blocks 4, 5 cached, 6 not
    m.free(1).unwrap();
    m.free(5).unwrap(); // free queue: 11 uncached blocks, then 2, 1, 5, 4
    m.add_sequence(2, &toks(100, 48), None, None).unwrap();
    m.add_sequence(3, &toks(0, 9), None, None).unwrap();
    assert_eq!(m.num_computed_tokens(3).unwrap(), 8);
    // Sequence 2 takes 12 blocks: the 11 uncached and block 2, evicting half of the
    // prefix sequence 3 probed.
    let got = m
        .allocate_slots_batch(&[2, 3], BatchArg::Each(&[48, 1]), 0)
        .unwrap();
    assert_eq!(got.num_served, 2);
    assert_eq!(got.num_cached_tokens, vec![0, 4]);
    assert_eq!(m.num_cached_tokens(3).unwrap(), 4);
    assert_eq!(got.block_indptr, vec![0, 12, 13]); // claimed block + 1 new
    let t3 = m.block_table(3).unwrap();
    let mine = &got.block_ids[got.block_indptr[1] as usize..got.block_indptr[2] as usize];
    assert_eq!(mine, &t3[t3.len() - mine.len()..]);
    m.check_invariants().unwrap();
}

#[test]
fn fork_errors() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 6));
    m.add_sequence(3, &[1], None, None).unwrap();
    assert_fails_unchanged(
        &mut m,
        |m| m.fork(9, 2),
        |e| matches!(e, KvError::UnknownSequence(9)),
    );
    assert_fails_unchanged(
        &mut m,
        |m| m.fork(1, 3),
        |e| matches!(e, KvError::DuplicateSequence(3)),
    );
    assert_fails_unchanged(
        &mut m,
        |m| m.fork(1, 1),
        |e| matches!(e, KvError::DuplicateSequence(1)),
    );
    m.commit(1, 0, &[5]).unwrap();
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    assert_fails_unchanged(&mut m, |m| m.fork(1, 2), is_state);
    m.commit(1, 1, &[]).unwrap();
    m.fork(1, 2).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn fork_of_unallocated_sequence_claims_later() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 9));
    m.add_sequence(2, &toks(0, 9), None, None).unwrap();
    m.fork(2, 3).unwrap();
    assert_eq!(m.num_computed_tokens(3).unwrap(), 8);
    assert_eq!(m.allocate_slots(3, 1, 0).unwrap().unwrap().len(), 1);
    m.check_invariants().unwrap();
}
