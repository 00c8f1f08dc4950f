//! Unit tests of every manager operation and error path: construction, sequences, free,
//! batches, `can_allocate`, the sliding window, step inputs and the invariants. The prefix
//! cache (`prefix_cache.rs`), fork and copy-on-write (`fork.rs`) and swap (`swap.rs`)
//! have their own files.

#[path = "../common/mod.rs"]
mod common;
mod fork;
mod prefix_cache;
mod swap;

use common::*;
use kvblocks_core::{
    AllocStatus, BatchArg, HashAlgo, KVCacheManager, KvError, ManagerConfig, NULL_BLOCK,
};

// -- construction -----------------------------------------------------------------

#[test]
fn manager_can_be_shared_behind_a_mutex() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<KVCacheManager>();
}

#[test]
fn pool_size_is_capped() {
    let c = ManagerConfig::new(kvblocks_core::MAX_BLOCKS + 1, 4);
    assert!(matches!(
        KVCacheManager::new(c),
        Err(KvError::InvalidArgument(_))
    ));
    let mut c = ManagerConfig::new(8, 4);
    c.num_cpu_blocks = kvblocks_core::MAX_BLOCKS + 1;
    assert!(matches!(
        KVCacheManager::new(c),
        Err(KvError::InvalidArgument(_))
    ));
}

#[test]
fn new_reserves_the_null_block() {
    let m = manager(8, 4);
    assert_eq!(m.num_free_blocks(), 7);
    assert_eq!(m.null_block(), NULL_BLOCK);
    assert_eq!(m.free_block_ids(), vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(m.usage(), 0.0);
    let s = m.stats();
    assert_eq!(
        (s.num_blocks, s.num_free_blocks, s.num_used_blocks),
        (8, 7, 0)
    );
    m.check_invariants().unwrap();
}

#[test]
fn new_rejects_bad_configs() {
    type Tweak = Box<dyn Fn(&mut ManagerConfig)>;
    let bad: Vec<Tweak> = vec![
        Box::new(|c| c.num_blocks = 1),
        Box::new(|c| c.block_size = 0),
        Box::new(|c| c.watermark = 1.0),
        Box::new(|c| c.watermark = -0.1),
        Box::new(|c| c.watermark = f64::NAN),
        Box::new(|c| c.sliding_window = Some(0)),
    ];
    for f in bad {
        let mut c = ManagerConfig::new(8, 4);
        f(&mut c);
        assert!(matches!(
            KVCacheManager::new(c),
            Err(KvError::InvalidArgument(_))
        ));
    }
}

#[test]
fn hash_algo_parses_its_names() {
    assert_eq!("blake3".parse::<HashAlgo>().unwrap(), HashAlgo::Blake3);
    assert_eq!("xxh3_128".parse::<HashAlgo>().unwrap(), HashAlgo::Xxh3_128);
    assert!("md5".parse::<HashAlgo>().is_err());
    assert_eq!(HashAlgo::Xxh3_128.to_string(), "xxh3_128");
}

#[test]
fn watermark_blocks_is_floored() {
    let m = manager_with(100, 4, |c| c.watermark = 0.05);
    assert_eq!(m.watermark_blocks(), 5);
    let m = manager_with(10, 4, |c| c.watermark = 0.05);
    assert_eq!(m.watermark_blocks(), 0);
}

// -- sequences --------------------------------------------------------------------

#[test]
fn add_sequence_and_queries() {
    let mut m = manager(8, 4);
    assert_eq!(m.add_sequence(7, &toks(0, 10), None, None).unwrap(), 0);
    assert!(m.has_sequence(7));
    assert_eq!(m.len(), 1);
    assert_eq!(m.num_tokens(7).unwrap(), 10);
    assert_eq!(m.num_computed_tokens(7).unwrap(), 0);
    assert_eq!(m.token_ids(7).unwrap(), &toks(0, 10)[..]);
    assert!(!m.is_swapped(7).unwrap());
    assert_fails_unchanged(
        &mut m,
        |m| m.add_sequence(7, &[1], None, None),
        |e| matches!(e, KvError::DuplicateSequence(7)),
    );
    assert!(matches!(m.num_tokens(8), Err(KvError::UnknownSequence(8))));
    assert!(m.num_computed_tokens(8).is_err());
    assert!(m.probe_prefixes(&[7, 8]).is_err());
    m.add_sequence(3, &[], None, None).unwrap();
    assert_eq!(m.seq_ids(), vec![3, 7]);
    m.check_invariants().unwrap();
}

#[test]
fn allocation_pops_free_queue_front_in_table_order() {
    let mut m = manager(8, 4);
    m.add_sequence(1, &toks(0, 10), None, None).unwrap();
    assert_eq!(m.allocate_slots(1, 10, 0).unwrap(), Some(vec![1, 2, 3]));
    assert_eq!(m.block_table(1).unwrap(), vec![1, 2, 3]);
    assert_eq!(m.num_free_blocks(), 4);
    assert_eq!(m.block_ref_count(2), 1);
    m.check_invariants().unwrap();
}

#[test]
fn allocate_grows_only_as_needed_and_returns_empty() {
    let mut m = manager(8, 4);
    m.add_sequence(1, &toks(0, 3), None, None).unwrap();
    assert_eq!(m.allocate_slots(1, 3, 0).unwrap(), Some(vec![1]));
    m.commit(1, 3, &[99]).unwrap();
    // position 3 still in block 1: nothing to take
    assert_eq!(m.allocate_slots(1, 1, 0).unwrap(), Some(vec![]));
    m.commit(1, 1, &[100]).unwrap();
    assert_eq!(m.allocate_slots(1, 1, 0).unwrap(), Some(vec![2]));
    // lookahead reserves extra slots
    m.commit(1, 1, &[101]).unwrap();
    assert_eq!(m.allocate_slots(1, 1, 8).unwrap(), Some(vec![3, 4]));
    m.check_invariants().unwrap();
}

#[test]
fn allocate_errors_leave_state_unchanged() {
    let mut m = manager(8, 4);
    m.add_sequence(1, &toks(0, 10), None, None).unwrap();
    assert_fails_unchanged(&mut m, |m| m.allocate_slots(1, 11, 0), is_invalid);
    assert_fails_unchanged(&mut m, |m| m.allocate_slots(2, 1, 0), is_unknown);
    assert_fails_unchanged(&mut m, |m| m.allocate_slots(1, 1, usize::MAX), is_invalid);
}

#[test]
fn allocate_short_pool_returns_none_unchanged() {
    let mut m = manager(4, 4);
    m.add_sequence(1, &toks(0, 13), None, None).unwrap();
    let before = m.clone();
    assert_eq!(m.allocate_slots(1, 13, 0).unwrap(), None);
    assert!(m == before);
    assert_eq!(m.allocate_slots(1, 12, 0).unwrap(), Some(vec![1, 2, 3]));
    m.check_invariants().unwrap();
}

#[test]
fn commit_checks_reservation_and_known_tokens() {
    let mut m = manager(8, 4);
    m.add_sequence(1, &toks(0, 6), None, None).unwrap();
    // no reservation yet: nothing may be computed, tokens may be appended
    assert_fails_unchanged(&mut m, |m| m.commit(1, 1, &[]), is_invalid);
    m.allocate_slots(1, 4, 0).unwrap().unwrap();
    assert_fails_unchanged(&mut m, |m| m.commit(1, 5, &[]), is_invalid);
    assert_fails_unchanged(&mut m, |m| m.commit(9, 0, &[]), is_unknown);
    m.commit(1, 4, &[]).unwrap();
    assert_eq!(m.num_computed_tokens(1).unwrap(), 4);
    // lookahead slots beyond the known tokens cannot be committed
    m.allocate_slots(1, 2, 4).unwrap().unwrap();
    assert_fails_unchanged(&mut m, |m| m.commit(1, 3, &[50]), is_invalid);
    m.commit(1, 2, &[50]).unwrap();
    assert_eq!(m.num_tokens(1).unwrap(), 7);
    // the reservation is cleared by commit
    assert_fails_unchanged(&mut m, |m| m.commit(1, 1, &[]), is_invalid);
    m.check_invariants().unwrap();
}

// -- free -------------------------------------------------------------------------

#[test]
fn free_unknown_is_an_error() {
    let mut m = manager(8, 4);
    assert_fails_unchanged(&mut m, |m| m.free(5), is_unknown);
    prefill(&mut m, 5, &toks(0, 3));
    m.free(5).unwrap();
    assert_fails_unchanged(&mut m, |m| m.free(5), is_unknown);
    assert_eq!(m.num_free_blocks(), 7);
}

#[test]
fn free_of_forked_blocks_keeps_shared_ones() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 6));
    m.fork(1, 2).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.block_table(2).unwrap(), vec![1, 2]);
    assert_eq!(m.num_free_blocks(), 5);
    m.free(2).unwrap();
    assert_eq!(m.num_free_blocks(), 7);
    m.check_invariants().unwrap();
}

#[test]
fn free_keeps_slot_index_consistent() {
    let mut m = manager(64, 4);
    for id in 0..10 {
        prefill(&mut m, id, &toks(id as u32 * 100, 5));
    }
    for id in [3, 0, 9, 5] {
        m.free(id).unwrap();
        m.check_invariants().unwrap();
    }
    assert_eq!(m.seq_ids(), vec![1, 2, 4, 6, 7, 8]);
    assert_eq!(m.token_ids(8).unwrap(), &toks(800, 5)[..]);
}

// -- batches ----------------------------------------------------------------------

#[test]
fn allocate_batch_serves_a_prefix() {
    let mut m = manager(6, 4); // 5 usable
    for id in 0..4 {
        m.add_sequence(id, &toks(id as u32 * 100, 6), None, None)
            .unwrap();
    }
    let ids = [0, 1, 2, 3];
    let got = m
        .allocate_slots_batch(&ids, BatchArg::Scalar(6), 0)
        .unwrap();
    assert_eq!(got.num_served, 2);
    assert_eq!(got.num_cached_tokens, vec![0, 0]);
    assert_eq!(got.block_indptr, vec![0, 2, 4]);
    assert_eq!(got.block_ids.len(), 4);
    assert_eq!(m.block_table(2).unwrap(), Vec::<i32>::new());
    assert_eq!(m.num_free_blocks(), 1);
    let per: Vec<i64> = vec![4, 4];
    assert_eq!(
        m.allocate_slots_batch(&[2, 3], BatchArg::Each(&per), 0)
            .unwrap()
            .num_served,
        1
    );
    m.check_invariants().unwrap();
}

#[test]
fn allocate_batch_validates_everything_first() {
    let mut m = manager(16, 4);
    for id in 0..3 {
        m.add_sequence(id, &toks(0, 6), None, None).unwrap();
    }
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_slots_batch(&[0, 1, 9], 1.into(), 0),
        is_unknown,
    );
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_slots_batch(&[0, 1, 0], 1.into(), 0),
        is_invalid,
    );
    let bad: &[i64] = &[1, 7, 1];
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_slots_batch(&[0, 1, 2], bad.into(), 0),
        is_invalid,
    );
    let neg: &[i64] = &[1, -1, 1];
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_slots_batch(&[0, 1, 2], neg.into(), 0),
        is_invalid,
    );
    let short: &[i64] = &[1, 1];
    assert_fails_unchanged(
        &mut m,
        |m| m.allocate_slots_batch(&[0, 1, 2], short.into(), 0),
        is_invalid,
    );
    assert_eq!(
        m.allocate_slots_batch(&[], 1.into(), 0).unwrap().num_served,
        0
    );
}

#[test]
fn commit_batch_appends_one_token_each_all_or_nothing() {
    let mut m = manager(16, 4);
    for id in 0..3 {
        prefill(&mut m, id, &toks(0, 5));
    }
    let toks_in: &[i64] = &[10, -1, 12];
    m.commit_batch(&[0, 1, 2], 0.into(), Some(toks_in.into()))
        .unwrap();
    assert_eq!(m.num_tokens(0).unwrap(), 6);
    assert_eq!(m.num_tokens(1).unwrap(), 5);
    assert_eq!(m.token_ids(2).unwrap()[5], 12);
    assert_eq!(
        m.allocate_slots_batch(&[0, 2], 1.into(), 0)
            .unwrap()
            .num_served,
        2
    );
    let counts: &[i64] = &[1, 2];
    assert_fails_unchanged(
        &mut m,
        |m| m.commit_batch(&[0, 2], counts.into(), None),
        is_invalid,
    );
    let big: &[i64] = &[1, 1 << 33];
    assert_fails_unchanged(
        &mut m,
        |m| m.commit_batch(&[0, 2], 1.into(), Some(big.into())),
        is_invalid,
    );
    assert_fails_unchanged(
        &mut m,
        |m| m.commit_batch(&[0, 0], 1.into(), None),
        is_invalid,
    );
    m.commit_batch(&[0, 2], 1.into(), Some(BatchArg::Scalar(5)))
        .unwrap();
    assert_eq!(m.num_computed_tokens(2).unwrap(), 6);
    assert_eq!(m.num_tokens(2).unwrap(), 7);
    m.check_invariants().unwrap();
}

// -- can_allocate -----------------------------------------------------------------

#[test]
fn can_allocate_with_watermark() {
    let mut m = manager_with(11, 4, |c| c.watermark = 0.2); // 10 usable, 2 kept
    m.add_sequence(1, &toks(0, 33), None, None).unwrap(); // 9 blocks > 10 - 2
    assert_eq!(m.can_allocate(1, 0).unwrap(), AllocStatus::Never);
    m.add_sequence(2, &toks(0, 32), None, None).unwrap(); // 8 blocks
    assert_eq!(m.can_allocate(2, 0).unwrap(), AllocStatus::Ok);
    assert_eq!(m.can_allocate(2, 1).unwrap(), AllocStatus::Never);
    m.add_sequence(3, &toks(500, 4), None, None).unwrap();
    m.allocate_slots(3, 4, 0).unwrap().unwrap();
    assert_eq!(m.can_allocate(2, 0).unwrap(), AllocStatus::Later);
    assert_fails_unchanged(&mut m, |m| m.can_allocate(3, 0), is_state);
    assert_fails_unchanged(&mut m, |m| m.can_allocate(4, 0), is_unknown);
}

#[test]
fn can_allocate_counts_shared_cached_blocks_free() {
    let mut m = manager(6, 4); // 5 usable
    prefill(&mut m, 1, &toks(0, 9)); // 3 blocks, 2 cached and in use
    m.add_sequence(2, &toks(0, 16), None, None).unwrap(); // 4 blocks, 2 shared
    assert_eq!(m.can_allocate(2, 0).unwrap(), AllocStatus::Ok);
    assert_eq!(m.can_allocate(2, 1).unwrap(), AllocStatus::Later);
    // once the holder is freed, the cached blocks sit in the free queue: they count
    m.free(1).unwrap();
    assert_eq!(m.can_allocate(2, 4).unwrap(), AllocStatus::Ok);
    assert_eq!(m.can_allocate(2, 5).unwrap(), AllocStatus::Never);
}

// -- sliding window ---------------------------------------------------------------

#[test]
fn sliding_window_releases_blocks_outside_the_window() {
    let mut m = manager_with(16, 2, |c| c.sliding_window = Some(4));
    m.add_sequence(1, &toks(0, 8), None, None).unwrap();
    m.allocate_slots(1, 8, 0).unwrap().unwrap(); // [1,2,3,4]
    m.commit(1, 8, &[50]).unwrap();
    // computed 8, window 4: block i released iff (i+1)*2 <= 5 -> blocks 0,1
    assert_eq!(m.block_table(1).unwrap(), vec![0, 0, 3, 4]);
    // cached blocks go to the back of the queue, last first
    assert_eq!(&m.free_block_ids()[m.num_free_blocks() - 2..], &[2, 1]);
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    m.commit(1, 1, &[51]).unwrap();
    // computed 9: (i+1)*2 <= 6 -> blocks 0..=2
    assert_eq!(m.block_table(1).unwrap(), vec![0, 0, 0, 4, 5]);
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    m.commit(1, 1, &[52]).unwrap();
    assert_eq!(m.block_table(1).unwrap(), vec![0, 0, 0, 4, 5]);
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    m.commit(1, 1, &[]).unwrap();
    assert_eq!(m.block_table(1).unwrap(), vec![0, 0, 0, 0, 5, 6]);
    let bt = m.block_tables(&[1], Some(7)).unwrap();
    assert_eq!(bt.data, vec![0, 0, 0, 0, 5, 6, 0]);
    assert_eq!(m.slot_mapping(&[1], None).unwrap(), Vec::<i64>::new());
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_free_blocks(), 15);
    m.check_invariants().unwrap();
}

// -- step inputs ------------------------------------------------------------------

#[test]
fn block_tables_are_padded_with_the_null_block() {
    let mut m = manager(16, 4);
    prefill(&mut m, 1, &toks(0, 9)); // 3 blocks
    prefill(&mut m, 2, &toks(100, 2)); // 1 block
    let bt = m.block_tables(&[2, 1], None).unwrap();
    assert_eq!((bt.num_rows, bt.num_cols), (2, 3));
    assert_eq!(bt.data, vec![4, 0, 0, 1, 2, 3]);
    let bt = m.block_tables(&[1], Some(5)).unwrap();
    assert_eq!(bt.data, vec![1, 2, 3, 0, 0]);
    assert_fails_unchanged(&mut m, |m| m.block_tables(&[1], Some(2)), is_invalid);
    assert_fails_unchanged(&mut m, |m| m.block_tables(&[1, 3], None), is_unknown);
    let empty = m.block_tables(&[], None).unwrap();
    assert_eq!(
        (empty.num_rows, empty.num_cols, empty.data.len()),
        (0, 0, 0)
    );
}

#[test]
fn slot_mapping_covers_uncomputed_tokens() {
    let mut m = manager(16, 4);
    m.add_sequence(1, &toks(0, 6), None, None).unwrap();
    m.add_sequence(2, &toks(0, 3), None, None).unwrap();
    // before allocation there is no slot for the prompt
    assert_fails_unchanged(&mut m, |m| m.slot_mapping(&[1], None), is_state);
    m.allocate_slots(1, 6, 0).unwrap().unwrap(); // [1,2]
    m.allocate_slots(2, 3, 0).unwrap().unwrap(); // [3]
    let s = m.slot_mapping(&[1, 2], None).unwrap();
    assert_eq!(s, vec![4, 5, 6, 7, 8, 9, 12, 13, 14]);
    let n: &[i64] = &[2, 1];
    assert_eq!(
        m.slot_mapping(&[1, 2], Some(n.into())).unwrap(),
        vec![4, 5, 12]
    );
    let too_many: &[i64] = &[9, 1];
    assert_fails_unchanged(
        &mut m,
        |m| m.slot_mapping(&[1, 2], Some(too_many.into())),
        is_state,
    );
    let neg: &[i64] = &[-1, 1];
    assert_fails_unchanged(
        &mut m,
        |m| m.slot_mapping(&[1, 2], Some(neg.into())),
        is_invalid,
    );
    m.commit(1, 6, &[99]).unwrap();
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    assert_eq!(m.slot_mapping(&[1], None).unwrap(), vec![10]);
    // lookahead slots can be mapped beyond the known tokens (block 4 appended)
    m.allocate_slots(1, 1, 2).unwrap().unwrap();
    assert_eq!(
        m.slot_mapping(&[1], Some(3.into())).unwrap(),
        vec![10, 11, 16]
    );
}

// -- invariants -------------------------------------------------------------------

#[test]
fn check_invariants_passes_on_fresh_and_busy_managers() {
    let mut m = manager_with(32, 4, |c| c.num_cpu_blocks = 8);
    m.check_invariants().unwrap();
    for id in 0..5 {
        prefill(&mut m, id, &toks(0, 4 * id as usize + 3));
    }
    m.fork(2, 20).unwrap();
    m.swap_out(&[3]).unwrap();
    m.free(4).unwrap();
    m.check_invariants().unwrap();
}

/// The last batch's slots are reused by the next call with the same ids (a scheduler's
/// allocate / map / sync / commit): freeing a sequence (its slot refilled by another) or
/// adding one must not let a stale slot through, and duplicates are still refused.
#[test]
fn batch_calls_resolve_ids_again_after_sequences_come_and_go() {
    let mut m = manager(64, 4);
    for id in [1, 2, 3] {
        m.add_sequence(id, &toks(10 * id as u32, 6), None, None)
            .unwrap();
    }
    let ids = [1u64, 2, 3];
    let step = |m: &mut KVCacheManager, ids: &[u64]| {
        let mut want = Vec::new();
        for &id in ids {
            let n = m.num_tokens(id).unwrap() - m.num_computed_tokens(id).unwrap();
            want.push(n as i64);
        }
        let got = m
            .allocate_slots_batch(ids, BatchArg::Each(&want), 0)
            .unwrap();
        assert_eq!(got.num_served, ids.len());
        let batch = m.slot_mapping(ids, Some(BatchArg::Each(&want))).unwrap();
        let mut single = Vec::new();
        for (&id, &n) in ids.iter().zip(&want) {
            single.extend(m.slot_mapping(&[id], Some(BatchArg::Scalar(n))).unwrap());
        }
        assert_eq!(batch, single);
        m.commit_batch(ids, BatchArg::Each(&want), None).unwrap();
        m.check_invariants().unwrap();
    };
    step(&mut m, &ids);
    // Free the first: the last sequence moves into its slot; a new 1 takes another.
    m.free(1).unwrap();
    m.add_sequence(1, &toks(500, 9), None, None).unwrap();
    step(&mut m, &ids);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 9);
    assert!(matches!(
        m.allocate_slots_batch(&[2, 2], BatchArg::Scalar(0), 0),
        Err(KvError::InvalidArgument(_))
    ));
    m.free(2).unwrap();
    assert!(matches!(
        m.slot_mapping(&ids, None),
        Err(KvError::UnknownSequence(2))
    ));
}
