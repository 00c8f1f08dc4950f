//! Unit tests of `swap_out` / `swap_in`.

use crate::common::*;

// -- swap -------------------------------------------------------------------------

#[test]
fn swap_out_and_in_preserve_sharing() {
    let mut m = manager_with(10, 4, |c| c.num_cpu_blocks = 6);
    prefill(&mut m, 1, &toks(0, 6)); // [1,2]
    m.fork(1, 2).unwrap();
    prefill(&mut m, 3, &toks(100, 3)); // [3]
    assert!(m.can_swap_out(&[1, 2]).unwrap());
    let rows = m.swap_out(&[2, 1]).unwrap();
    assert_eq!(rows, vec![[1, 0], [2, 1]]);
    assert!(m.is_swapped(1).unwrap() && m.is_swapped(2).unwrap());
    assert_eq!(m.num_free_cpu_blocks(), 4);
    assert_eq!(m.stats().num_swapped_sequences, 2);
    assert_eq!(m.stats().blocks_swapped_out, 2);
    m.check_invariants().unwrap();
    // block 1 is cached (back of the queue), block 2 (partial) is not (front)
    assert_eq!(m.free_block_ids()[0], 2);
    assert_eq!(*m.free_block_ids().last().unwrap(), 1);
    // operations on swapped sequences are state errors
    assert_fails_unchanged(&mut m, |m| m.allocate_slots(1, 0, 0), is_state);
    assert_fails_unchanged(&mut m, |m| m.commit(1, 0, &[]), is_state);
    assert_fails_unchanged(&mut m, |m| m.fork(1, 9), is_state);
    assert_fails_unchanged(&mut m, |m| m.block_tables(&[1], None), is_state);
    assert_fails_unchanged(&mut m, |m| m.slot_mapping(&[1], None), is_state);
    assert_fails_unchanged(&mut m, |m| m.swap_out(&[1]), is_state);
    assert_fails_unchanged(&mut m, |m| m.can_swap_out(&[1]), is_state);
    assert_fails_unchanged(&mut m, |m| m.swap_in(&[3]), is_state);
    assert_fails_unchanged(&mut m, |m| m.swap_in(&[1, 1]), is_invalid);
    assert_eq!(m.num_tokens(1).unwrap(), 6);
    assert!(m.can_swap_in(&[1, 2]).unwrap());
    let rows = m.swap_in(&[1, 2]).unwrap();
    assert_eq!(rows, vec![[0, 2], [1, 4]]);
    assert_eq!(m.block_table(1).unwrap(), vec![2, 4]);
    assert_eq!(m.block_table(2).unwrap(), vec![2, 4]);
    assert_eq!(m.block_ref_count(2), 2);
    assert_eq!(m.num_free_cpu_blocks(), 6);
    assert_eq!(m.free_cpu_block_ids(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(m.stats().blocks_swapped_in, 2);
    m.check_invariants().unwrap();
    // block 1 was popped for the swap-in... no: block 2 was front, then 4
    m.commit(1, 0, &[7]).unwrap();
    assert_eq!(m.allocate_slots(1, 1, 0).unwrap().unwrap().len(), 1); // CoW
    m.check_invariants().unwrap();
}

#[test]
fn swap_shortage_is_out_of_blocks_unchanged() {
    let mut m = manager_with(10, 4, |c| c.num_cpu_blocks = 1);
    prefill(&mut m, 1, &toks(0, 6));
    assert!(!m.can_swap_out(&[1]).unwrap());
    assert_fails_unchanged(&mut m, |m| m.swap_out(&[1]), is_oob);
    let mut m = manager_with(4, 4, |c| c.num_cpu_blocks = 4);
    prefill(&mut m, 1, &toks(0, 8));
    m.swap_out(&[1]).unwrap();
    prefill(&mut m, 2, &toks(100, 8));
    assert!(!m.can_swap_in(&[1]).unwrap());
    assert_fails_unchanged(&mut m, |m| m.swap_in(&[1]), is_oob);
    // free works on swapped sequences; CPU blocks go back to the front, last first
    m.free(1).unwrap();
    assert_eq!(m.free_cpu_block_ids(), vec![0, 1, 2, 3]);
    m.check_invariants().unwrap();
}

#[test]
fn swap_out_rejects_pending_reservation() {
    let mut m = manager_with(10, 4, |c| c.num_cpu_blocks = 4);
    m.add_sequence(1, &toks(0, 6), None, None).unwrap();
    m.allocate_slots(1, 6, 0).unwrap().unwrap();
    assert_fails_unchanged(&mut m, |m| m.swap_out(&[1]), is_state);
    assert_fails_unchanged(&mut m, |m| m.swap_out(&[7]), is_unknown);
}

#[test]
fn can_swap_in_keeps_the_watermark() {
    let mut m = manager_with(11, 4, |c| {
        c.num_cpu_blocks = 8;
        c.watermark = 0.2; // 2 blocks
    });
    prefill(&mut m, 1, &toks(0, 8)); // 2 blocks
    m.swap_out(&[1]).unwrap();
    prefill(&mut m, 2, &toks(100, 24)); // 6 blocks -> 4 free
    assert!(m.can_swap_in(&[1]).unwrap());
    m.add_sequence(3, &toks(200, 1), None, None).unwrap();
    m.allocate_slots(3, 1, 0).unwrap().unwrap(); // 3 free
    assert!(!m.can_swap_in(&[1]).unwrap());
    assert_eq!(m.swap_in(&[1]).unwrap().len(), 2);
}

#[test]
fn swap_with_sliding_window_keeps_null_entries() {
    let mut m = manager_with(16, 2, |c| {
        c.sliding_window = Some(2);
        c.num_cpu_blocks = 8;
    });
    prefill(&mut m, 1, &toks(0, 8)); // table [0,0,0,4]
    assert_eq!(m.block_table(1).unwrap(), vec![0, 0, 0, 4]);
    assert_eq!(m.swap_out(&[1]).unwrap(), vec![[4, 0]]);
    m.check_invariants().unwrap();
    assert_eq!(m.swap_in(&[1]).unwrap().len(), 1);
    assert_eq!(&m.block_table(1).unwrap()[..3], &[0, 0, 0]);
    m.swap_out(&[1]).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_free_cpu_blocks(), 8);
    m.check_invariants().unwrap();
}
