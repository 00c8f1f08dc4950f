//! `allocate_decode_step`: one call must do exactly what `allocate_slots_batch`,
//! `sync_block_table` and `slot_mapping` do in turn, and nothing when it fails.

mod common;

use common::{assert_fails_unchanged, manager, manager_with, toks};
use kvblocks_core::{BatchArg, GroupSpec, KVCacheManager, KvError};

/// Add sequences `ids` with prompts of `len` tokens and compute them.
fn running(m: &mut KVCacheManager, ids: &[u64], len: usize) {
    for &id in ids {
        m.add_sequence(id, &toks(id as u32 * 1000, len), None, None)
            .unwrap();
    }
    m.allocate_slots_batch(ids, BatchArg::Scalar(len as i64), 0)
        .unwrap();
    let sampled = vec![7i64; ids.len()];
    m.commit_batch(
        ids,
        BatchArg::Scalar(len as i64),
        Some(BatchArg::Each(&sampled)),
    )
    .unwrap();
}

/// The positions of the next decode token of each sequence.
fn positions(m: &KVCacheManager, ids: &[u64]) -> Vec<usize> {
    ids.iter()
        .map(|&id| m.num_tokens(id).unwrap() - 1)
        .collect()
}

#[test]
fn one_call_equals_allocate_sync_and_slot_mapping_step_after_step() {
    for lookahead in [0, 3] {
        let mut fused = manager(256, 4);
        running(&mut fused, &[1, 2, 3, 4], 6);
        // Sequence 5 shares sequence 1's blocks: its first decode copies the last one.
        fused.fork(1, 5).unwrap();
        let mut split = fused.clone();
        let ids = [1, 5, 2, 3, 4];
        let rows = [4i64, 0, 2, 1, 3];
        let (nr, nc) = (6, 16);
        for step in 0..12i64 {
            let pos = positions(&fused, &ids);
            let got = fused
                .allocate_decode_step(&ids, lookahead, &rows, nr, nc, &pos)
                .unwrap();
            let served = split
                .allocate_slots_batch(&ids, BatchArg::Scalar(1), lookahead)
                .unwrap()
                .num_served;
            let delta = split
                .sync_block_table(&ids, &rows, nr, nc, None, false)
                .unwrap();
            let slots = split.slot_mapping(&ids, Some(BatchArg::Scalar(1))).unwrap();
            assert_eq!(got.num_served, served);
            assert_eq!(got.synced, Some((delta, slots)), "step {step}");
            for m in [&mut fused, &mut split] {
                let sampled = vec![100 + step; ids.len()];
                m.commit_batch(&ids, BatchArg::Scalar(1), Some(BatchArg::Each(&sampled)))
                    .unwrap();
            }
            assert!(fused == split, "the managers diverged at step {step}");
        }
    }
}

#[test]
fn a_short_pool_serves_the_leading_sequences_and_syncs_nothing() {
    // 3 free blocks: the sequences whose next token opens a block get one each.
    let mut m = manager(3 * 2 + 1 + 3, 4);
    running(&mut m, &[1, 2, 3], 8);
    let ids = [1, 2, 3];
    let pos = positions(&m, &ids);
    let mut split = m.clone();
    let got = m
        .allocate_decode_step(&ids, 4, &[0, 1, 2], 3, 8, &pos)
        .unwrap();
    let want = split
        .allocate_slots_batch(&ids, BatchArg::Scalar(1), 4)
        .unwrap();
    assert!(want.num_served < ids.len());
    assert_eq!((got.num_served, got.synced), (want.num_served, None));
    assert!(m == split);
}

#[test]
fn a_table_too_narrow_allocates_but_syncs_nothing() {
    let mut m = manager(64, 4);
    running(&mut m, &[1, 2], 8);
    let ids = [1, 2];
    let pos = positions(&m, &ids);
    let mut split = m.clone();
    // Two columns hold 8 tokens; the next token needs a third block.
    let got = m
        .allocate_decode_step(&ids, 0, &[0, 1], 2, 2, &pos)
        .unwrap();
    split
        .allocate_slots_batch(&ids, BatchArg::Scalar(1), 0)
        .unwrap();
    assert_eq!((got.num_served, got.synced), (2, None));
    assert!(m == split);
}

#[test]
fn bad_calls_fail_and_change_nothing() {
    let mut m = manager_with(64, 4, |c| c.num_cpu_blocks = 16);
    running(&mut m, &[1, 2], 6);
    let is_arg = |e: &KvError| matches!(e, KvError::InvalidArgument(_));
    // (seq ids, rows, positions)
    type Case = (Vec<u64>, Vec<i64>, Vec<usize>);
    let cases: Vec<Case> = vec![
        (vec![1, 2], vec![0], vec![6, 6]),    // rows: not one per sequence
        (vec![1, 2], vec![0, 1], vec![6]),    // positions: not one per sequence
        (vec![1, 2], vec![0, 4], vec![6, 6]), // a row past the table
        (vec![1, 2], vec![1, 1], vec![6, 6]), // a row twice
        (vec![1, 1], vec![0, 1], vec![6, 6]), // a sequence twice
        // Positions in no block the sequence holds once served (2 blocks of 4): the row's
        // null padding there would name a slot of the null block.
        (vec![1, 2], vec![0, 1], vec![6, 8]),
        (vec![1, 2], vec![0, 1], vec![31, 6]),
    ];
    for (ids, rows, pos) in cases {
        assert_fails_unchanged(
            &mut m,
            |m| m.allocate_decode_step(&ids, 0, &rows, 4, 8, &pos),
            is_arg,
        );
    }
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_decode_step(&[9], 0, &[0], 4, 8, &[6]),
        |e| matches!(e, KvError::UnknownSequence(9)),
    );
    m.swap_out(&[2]).unwrap();
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_decode_step(&[1, 2], 0, &[0, 1], 4, 8, &[6, 6]),
        |e| matches!(e, KvError::SequenceState(_)),
    );
    // More than one KV cache group: one table cannot hold them.
    let mut g = manager_with(64, 4, |c| {
        c.groups = vec![
            GroupSpec::FullAttention,
            GroupSpec::SlidingWindow { window: 8 },
        ]
    });
    running(&mut g, &[1], 6);
    assert_fails_unchanged(
        &mut g,
        |m| m.allocate_decode_step(&[1], 0, &[0], 4, 8, &[6]),
        is_arg,
    );
}

#[test]
fn a_lone_window_or_state_group_gets_the_slots_slot_mapping_gives() {
    // The one group of the table may release blocks (a window) or keep no per-token KV
    // (a recurrent state group, whose slot mapping is -1): the slots must still be
    // slot_mapping's, not read from the table as if every entry held a token's KV.
    for group in [
        GroupSpec::SlidingWindow { window: 5 },
        GroupSpec::Recurrent {
            checkpoint_every_blocks: 2,
        },
    ] {
        let mut fused = manager_with(64, 4, |c| c.groups = vec![group]);
        running(&mut fused, &[1, 2], 6);
        let mut split = fused.clone();
        let ids = [2, 1];
        let rows = [0i64, 1];
        for step in 0..9i64 {
            let pos = positions(&fused, &ids);
            let got = fused
                .allocate_decode_step(&ids, 0, &rows, 2, 8, &pos)
                .unwrap();
            split
                .allocate_slots_batch(&ids, BatchArg::Scalar(1), 0)
                .unwrap();
            let delta = split
                .sync_block_table(&ids, &rows, 2, 8, None, false)
                .unwrap();
            let slots = split.slot_mapping(&ids, Some(BatchArg::Scalar(1))).unwrap();
            assert_eq!(got.synced, Some((delta, slots)), "{group} step {step}");
            for m in [&mut fused, &mut split] {
                let sampled = vec![100 + step; ids.len()];
                m.commit_batch(&ids, BatchArg::Scalar(1), Some(BatchArg::Each(&sampled)))
                    .unwrap();
            }
        }
    }
}

#[test]
fn positions_in_released_window_blocks_are_refused() {
    let mut m = manager_with(64, 4, |c| {
        c.groups = vec![GroupSpec::SlidingWindow { window: 4 }]
    });
    running(&mut m, &[1], 17); // the next query, at 17, sees 14..17: blocks 0..2 released
    let is_arg = |e: &KvError| matches!(e, KvError::InvalidArgument(_));
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_decode_step(&[1], 0, &[0], 4, 8, &[1]),
        is_arg,
    );
    m.allocate_slots_batch(&[1], BatchArg::Scalar(1), 0)
        .unwrap();
    assert_fails_unchanged(&mut m, |m| m.check_decode_positions(&[1], &[11]), is_arg);
    assert_fails_unchanged(&mut m, |m| m.check_decode_positions(&[1], &[20]), is_arg);
    m.check_decode_positions(&[1], &[17]).unwrap();
}
