//! `probe_in_flight`: prefix blocks reserved by `allocate_slots` and not yet committed,
//! across every operation that starts or ends a reservation.

mod common;

use common::*;
use kvblocks_core::{KVCacheManager, KvError};

fn is_state(e: &KvError) -> bool {
    matches!(e, KvError::SequenceState(_))
}
fn is_unknown(e: &KvError) -> bool {
    matches!(e, KvError::UnknownSequence(_))
}

/// Add `id` with `prompt` and reserve `new` tokens past its cached prefix.
fn start(m: &mut KVCacheManager, id: u64, prompt: &[u32], new: usize) {
    m.add_sequence(id, prompt, None, None).unwrap();
    m.allocate_slots(id, new, 0)
        .unwrap()
        .expect("enough blocks");
    m.check_invariants().unwrap();
}

fn probe(m: &KVCacheManager, ids: &[u64]) -> Vec<i64> {
    let out = m.probe_in_flight(ids).unwrap();
    m.check_invariants().unwrap();
    out
}

#[test]
fn a_reserved_prompt_is_in_flight_until_its_commit() {
    for algo in ALGOS {
        let mut m = manager_with(32, 4, |c| c.hash_algo = algo);
        let prompt = toks(0, 18); // 4 full blocks and 2 tokens
        start(&mut m, 1, &prompt, 18);
        m.add_sequence(2, &prompt, None, None).unwrap();
        m.add_sequence(3, &prompt[..9], None, None).unwrap(); // hit capped at 2 blocks
        m.add_sequence(4, &toks(100, 18), None, None).unwrap();
        let before = m.clone();
        assert_eq!(probe(&m, &[2, 3, 4, 2]), vec![16, 8, 0, 16]);
        assert!(m == before, "probe_in_flight changed the state");
        // nothing is cached before the commit: the waiting sequences hit nothing yet
        assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![0]);
        m.commit(1, 18, &[7]).unwrap();
        assert_eq!(probe(&m, &[2, 3]), vec![0, 0]);
        assert_eq!(m.refresh_prefixes(&[2, 3]).unwrap(), vec![16, 8]);
    }
}

#[test]
fn a_partial_commit_ends_the_reservation() {
    let mut m = manager(32, 4);
    let prompt = toks(0, 17);
    start(&mut m, 1, &prompt, 17);
    m.add_sequence(2, &prompt, None, None).unwrap();
    assert_eq!(probe(&m, &[2]), vec![16]);
    m.commit(1, 6, &[]).unwrap(); // only the first block was written
    assert_eq!(probe(&m, &[2]), vec![0]);
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![4]);
    // the next chunk is in flight again, past the new hit
    m.allocate_slots(1, 11, 0).unwrap().unwrap();
    assert_eq!(probe(&m, &[2]), vec![12]);
    m.commit(1, 0, &[]).unwrap();
    assert_eq!(probe(&m, &[2]), vec![0]);
}

#[test]
fn only_the_chunk_being_computed_is_in_flight() {
    let mut m = manager(32, 4);
    let prompt = toks(0, 30);
    start(&mut m, 1, &prompt, 10); // blocks 0 and 1 full, block 2 half
    m.add_sequence(2, &prompt, None, None).unwrap();
    m.add_sequence(3, &prompt, None, None).unwrap();
    assert_eq!(probe(&m, &[2, 3]), vec![8, 8]);
    m.commit(1, 10, &[]).unwrap();
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![8]);
    // the second chunk completes block 2 (begun by the first) through block 4
    m.allocate_slots(1, 10, 0).unwrap().unwrap();
    // counted from each sequence's hit: seq 3's cap is still the empty one of its add,
    // and its first block is cached, not in flight
    assert_eq!(probe(&m, &[2, 3]), vec![12, 0]);
    assert_eq!(m.refresh_prefixes(&[3]).unwrap(), vec![8]);
    assert_eq!(probe(&m, &[3]), vec![12]);
    m.free(1).unwrap(); // the writer goes away: nothing in flight, nothing new cached
    assert_eq!(probe(&m, &[2, 3]), vec![0, 0]);
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![8]);
}

#[test]
fn the_count_stops_at_the_first_block_not_in_flight() {
    let mut m = manager(32, 4);
    let mut other = toks(0, 12);
    other[5] = 99; // differs in block 1
    start(&mut m, 1, &other, 12);
    m.add_sequence(2, &toks(0, 13), None, None).unwrap();
    assert_eq!(probe(&m, &[2]), vec![4]);
    // block 2 of seq 3 has seq 2's content only if its chain (blocks 0, 1) matches too
    start(&mut m, 3, &toks(0, 13), 12);
    assert_eq!(probe(&m, &[2]), vec![12]);
}

#[test]
fn the_prompts_last_token_is_never_counted() {
    let mut m = manager(32, 4);
    start(&mut m, 1, &toks(0, 16), 16);
    m.add_sequence(2, &toks(0, 16), None, None).unwrap(); // hit at most 3 blocks
    m.add_sequence(3, &toks(0, 17), None, None).unwrap();
    assert_eq!(probe(&m, &[2, 3]), vec![12, 16]);
}

#[test]
fn lookahead_slots_are_not_in_flight() {
    let mut m = manager(32, 4);
    m.add_sequence(1, &toks(0, 12), None, None).unwrap();
    m.allocate_slots(1, 5, 8).unwrap().unwrap(); // 13 slots, 5 known tokens computed
    m.add_sequence(2, &toks(0, 13), None, None).unwrap();
    assert_eq!(probe(&m, &[2]), vec![4]);
    m.commit(1, 5, &[]).unwrap();
    assert_eq!(probe(&m, &[2]), vec![0]);
}

#[test]
fn namespaces_do_not_share_in_flight_blocks() {
    let mut m = manager(32, 4);
    let prompt = toks(0, 9);
    m.add_sequence(1, &prompt, Some(b"tenant"), None).unwrap();
    m.allocate_slots(1, 9, 0).unwrap().unwrap();
    m.add_sequence(2, &prompt, None, None).unwrap();
    m.add_sequence(3, &prompt, Some(b"tenant"), None).unwrap();
    m.add_sequence(4, &prompt, Some(b"tenant"), Some(5))
        .unwrap();
    m.add_sequence(5, &prompt, None, Some(5)).unwrap();
    assert_eq!(probe(&m, &[2, 3, 4, 5]), vec![0, 8, 0, 0]);
}

#[test]
fn duplicate_writers_are_counted_until_the_last_ends() {
    let mut m = manager(32, 4);
    let prompt = toks(0, 9);
    start(&mut m, 1, &prompt, 9);
    start(&mut m, 2, &prompt, 9); // same content, own blocks (nothing cached yet)
    m.add_sequence(3, &prompt, None, None).unwrap();
    assert_eq!(probe(&m, &[3]), vec![8]);
    m.free(1).unwrap();
    assert_eq!(probe(&m, &[3]), vec![8]);
    m.commit(2, 9, &[]).unwrap();
    assert_eq!(probe(&m, &[3]), vec![0]);
    assert_eq!(m.refresh_prefixes(&[3]).unwrap(), vec![8]);
}

#[test]
fn reallocating_before_commit_replaces_the_range() {
    let mut m = manager(32, 4);
    let prompt = toks(0, 17);
    m.add_sequence(1, &prompt, None, None).unwrap();
    m.allocate_slots(1, 16, 0).unwrap().unwrap();
    m.add_sequence(2, &prompt, None, None).unwrap();
    assert_eq!(probe(&m, &[2]), vec![16]);
    m.allocate_slots(1, 5, 0).unwrap().unwrap(); // the engine resized the step
    assert_eq!(probe(&m, &[2]), vec![4]);
    m.allocate_slots(1, 0, 0).unwrap().unwrap();
    assert_eq!(probe(&m, &[2]), vec![0]);
}

#[test]
fn an_allocation_the_pool_refuses_puts_nothing_in_flight() {
    let mut m = manager(3, 4); // 2 usable blocks
    m.add_sequence(1, &toks(0, 12), None, None).unwrap();
    m.add_sequence(2, &toks(0, 12), None, None).unwrap();
    let before = m.clone();
    assert_eq!(m.allocate_slots(1, 12, 0).unwrap(), None);
    assert!(m == before);
    assert_eq!(probe(&m, &[2]), vec![0]);
}

#[test]
fn decode_blocks_of_unknown_hash_are_not_in_flight() {
    let mut m = manager(32, 4);
    start(&mut m, 1, &toks(0, 3), 3);
    m.commit(1, 3, &[3]).unwrap(); // 4 known tokens, 3 computed
    m.allocate_slots(1, 1, 0).unwrap().unwrap(); // completes block 0 by decode
    m.add_sequence(2, &toks(0, 5), None, None).unwrap();
    // the decode block's hash is computed at commit: not known while in flight
    assert_eq!(probe(&m, &[2]), vec![0]);
    m.commit(1, 1, &[4]).unwrap();
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![4]);
    // once hashed, a readmitted sequence (prompt = prompt + output) is in flight again
    m.add_sequence(3, &toks(0, 9), None, None).unwrap();
    m.allocate_slots(3, 4, 0).unwrap().unwrap();
    m.add_sequence(4, &toks(0, 9), None, None).unwrap();
    assert_eq!(probe(&m, &[4]), vec![4]);
}

#[test]
fn fork_and_swap_refuse_a_pending_reservation_and_start_nothing() {
    let mut m = manager_with(32, 4, |c| c.num_cpu_blocks = 16);
    let prompt = toks(0, 9);
    start(&mut m, 1, &prompt, 9);
    m.add_sequence(2, &prompt, None, None).unwrap();
    // a forked waiting sequence has its parent's hashes: it sees the same flights
    m.fork(2, 6).unwrap();
    assert_eq!(probe(&m, &[2, 6]), vec![8, 8]);
    assert_fails_unchanged(&mut m, |m| m.fork(1, 5), is_state);
    assert_fails_unchanged(&mut m, |m| m.swap_out(&[1]), is_state);
    m.commit(1, 9, &[]).unwrap();
    m.fork(1, 5).unwrap();
    m.swap_out(&[5]).unwrap();
    assert_eq!(probe(&m, &[2, 6]), vec![0, 0]);
    m.swap_in(&[5]).unwrap();
    assert_eq!(probe(&m, &[2, 6]), vec![0, 0]);
}

#[test]
fn reset_prefix_cache_finds_nothing_in_flight() {
    let mut m = manager(32, 4);
    let prompt = toks(0, 9);
    start(&mut m, 1, &prompt, 9);
    m.add_sequence(2, &prompt, None, None).unwrap();
    assert!(!m.reset_prefix_cache());
    assert_eq!(probe(&m, &[2]), vec![8]);
    m.free(1).unwrap();
    assert!(m.reset_prefix_cache());
    assert_eq!(probe(&m, &[2]), vec![0]);
    start(&mut m, 3, &prompt, 9);
    assert_eq!(probe(&m, &[2]), vec![8]);
}

#[test]
fn without_caching_nothing_is_in_flight() {
    let mut m = manager_with(32, 4, |c| c.enable_prefix_caching = false);
    start(&mut m, 1, &toks(0, 9), 9);
    m.add_sequence(2, &toks(0, 9), None, None).unwrap();
    assert_eq!(probe(&m, &[2]), vec![0]);
}

#[test]
fn errors_leave_state_unchanged() {
    let mut m = manager_with(32, 4, |c| c.num_cpu_blocks = 8);
    start(&mut m, 1, &toks(0, 9), 9);
    m.add_sequence(2, &toks(0, 9), None, None).unwrap();
    start(&mut m, 3, &toks(50, 5), 5);
    m.commit(3, 5, &[]).unwrap();
    m.swap_out(&[3]).unwrap();
    assert_fails_unchanged(&mut m, |m| m.probe_in_flight(&[2, 9]), is_unknown);
    assert_fails_unchanged(&mut m, |m| m.probe_in_flight(&[2, 1]), is_state);
    assert_fails_unchanged(&mut m, |m| m.probe_in_flight(&[3]), is_state);
    assert_eq!(m.probe_in_flight(&[]).unwrap(), Vec::<i64>::new());
}
