//! Unit tests of every manager operation and error path.

mod common;

use common::*;
use kvblocks_core::{
    AllocStatus, BatchArg, GroupSpec, HashAlgo, KVCacheManager, KvCacheEvent, KvError,
    ManagerConfig, NULL_BLOCK,
};

fn is_invalid(e: &KvError) -> bool {
    matches!(e, KvError::InvalidArgument(_))
}
fn is_state(e: &KvError) -> bool {
    matches!(e, KvError::SequenceState(_))
}
fn is_unknown(e: &KvError) -> bool {
    matches!(e, KvError::UnknownSequence(_))
}
fn is_oob(e: &KvError) -> bool {
    matches!(e, KvError::OutOfBlocks(_))
}

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

// -- prefix cache -----------------------------------------------------------------

#[test]
fn full_blocks_enter_the_cache_with_one_event_per_run() {
    for algo in ALGOS {
        let mut m = manager_with(8, 4, |c| c.hash_algo = algo);
        prefill(&mut m, 1, &toks(0, 10));
        let ev = m.take_events();
        assert_eq!(ev.len(), 1);
        let KvCacheEvent::BlockStored(s) = &ev[0] else {
            panic!("expected BlockStored, got {ev:?}")
        };
        assert_eq!(s.block_hashes.len(), 2);
        assert_eq!(s.parent_block_hash, None);
        assert_eq!(s.token_ids, toks(0, 8));
        assert_eq!(s.block_size, 4);
        assert_eq!(s.lora_id, None);
        assert_eq!(s.block_hashes[0].as_bytes().len(), algo.digest_len());
        assert_eq!(m.stats().num_cached_blocks, 2);
        assert!(m.take_events().is_empty());
        // the next block fills during decode: a new event chained on the last hash
        m.allocate_slots(1, 0, 0).unwrap().unwrap();
        m.commit(1, 0, &[10, 11]).unwrap();
        m.allocate_slots(1, 2, 0).unwrap().unwrap();
        m.commit(1, 2, &[]).unwrap();
        let ev = m.take_events();
        let KvCacheEvent::BlockStored(s2) = &ev[0] else {
            panic!()
        };
        assert_eq!(s2.parent_block_hash, Some(s.block_hashes[1]));
        assert_eq!(s2.token_ids, toks(8, 4));
        m.check_invariants().unwrap();
    }
}

#[test]
fn free_order_unhashed_to_front_last_first() {
    let mut m = manager_with(8, 4, |c| c.enable_prefix_caching = false);
    m.add_sequence(1, &toks(0, 2), None, None).unwrap();
    m.allocate_slots(1, 2, 0).unwrap().unwrap(); // [1]
    m.add_sequence(2, &toks(0, 12), None, None).unwrap();
    assert_eq!(m.allocate_slots(2, 12, 0).unwrap(), Some(vec![2, 3, 4]));
    m.commit(2, 12, &[]).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.free_block_ids(), vec![2, 3, 4, 5, 6, 7]);
    assert!(m.take_events().is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn free_order_hashed_to_back_last_first() {
    let mut m = manager(8, 4);
    m.add_sequence(2, &toks(0, 12), None, None).unwrap();
    assert_eq!(m.allocate_slots(2, 12, 0).unwrap(), Some(vec![1, 2, 3]));
    m.commit(2, 12, &[]).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.free_block_ids(), vec![4, 5, 6, 7, 3, 2, 1]);
    // mixed: a partial last block is unhashed and goes to the front
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 10)); // [1,2 hashed, 3 partial]
    m.free(1).unwrap();
    assert_eq!(m.free_block_ids(), vec![3, 4, 5, 6, 7, 2, 1]);
    m.check_invariants().unwrap();
}

#[test]
fn prefix_hit_claims_cached_blocks_at_first_allocation() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 9));
    m.free(1).unwrap();
    assert_eq!(m.add_sequence(2, &toks(0, 9), None, None).unwrap(), 8);
    assert_eq!(m.num_computed_tokens(2).unwrap(), 8);
    assert_eq!(m.num_cached_tokens(2).unwrap(), 8);
    assert_eq!(m.probe_prefixes(&[2]).unwrap(), vec![8]);
    let free_before = m.num_free_blocks();
    // the claim takes blocks 1,2 out of the queue; one new block for the last token
    let got = m.allocate_slots(2, 1, 0).unwrap().unwrap();
    assert_eq!(got, vec![3]);
    assert_eq!(m.block_table(2).unwrap(), vec![1, 2, 3]);
    assert_eq!(m.num_free_blocks(), free_before - 3);
    let s = m.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (18, 8));
    assert!((s.prefix_cache_hit_rate - 8.0 / 18.0).abs() < 1e-12);
    m.commit(2, 1, &[]).unwrap();
    assert_eq!(m.num_cached_tokens(2).unwrap(), 8);
    m.check_invariants().unwrap();
}

#[test]
fn shared_prefix_between_running_sequences() {
    let mut m = manager(16, 4);
    prefill(&mut m, 1, &toks(0, 9));
    assert_eq!(m.add_sequence(2, &toks(0, 12), None, None).unwrap(), 8);
    m.allocate_slots(2, 4, 0).unwrap().unwrap();
    assert_eq!(m.block_ref_count(1), 2);
    assert_eq!(m.block_ref_count(2), 2);
    m.check_invariants().unwrap();
}

#[test]
fn hit_never_covers_the_whole_prompt() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 8));
    assert_eq!(m.add_sequence(2, &toks(0, 8), None, None).unwrap(), 4);
    assert_eq!(m.add_sequence(3, &toks(0, 9), None, None).unwrap(), 8);
    assert_eq!(m.add_sequence(4, &toks(0, 1), None, None).unwrap(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn salts_and_lora_ids_are_separate_namespaces() {
    let mut m = manager(32, 4);
    let p = toks(0, 9);
    m.add_sequence(1, &p, None, None).unwrap();
    m.allocate_slots(1, 9, 0).unwrap().unwrap();
    m.commit(1, 9, &[]).unwrap();
    let variants: [(Option<&[u8]>, Option<u64>); 5] = [
        (Some(b""), None),
        (Some(b"a"), None),
        (None, Some(0)),
        (Some(b""), Some(0)),
        (Some(b"a"), Some(1)),
    ];
    for (i, (salt, lora)) in variants.iter().enumerate() {
        let id = 10 + i as u64;
        assert_eq!(
            m.add_sequence(id, &p, *salt, *lora).unwrap(),
            0,
            "{salt:?} {lora:?}"
        );
        m.allocate_slots(id, 9, 0).unwrap().unwrap();
        m.commit(id, 9, &[]).unwrap();
        // same namespace again: a hit
        assert_eq!(m.add_sequence(100 + id, &p, *salt, *lora).unwrap(), 8);
    }
    assert_eq!(m.add_sequence(99, &p, None, None).unwrap(), 8);
    assert_eq!(m.stats().num_cached_blocks, 12);
    m.check_invariants().unwrap();
}

#[test]
fn lora_id_is_reported_in_events() {
    let mut m = manager(8, 4);
    m.add_sequence(1, &toks(0, 4), None, Some(7)).unwrap();
    m.allocate_slots(1, 4, 0).unwrap().unwrap();
    m.commit(1, 4, &[]).unwrap();
    let ev = m.take_events();
    assert!(matches!(&ev[..], [KvCacheEvent::BlockStored(s)] if s.lora_id == Some(7)));
}

#[test]
fn eviction_under_pressure_shrinks_the_probe() {
    let mut m = manager(5, 4); // 4 usable
    prefill(&mut m, 1, &toks(0, 12)); // blocks 1,2,3 all cached
    m.free(1).unwrap();
    m.take_events();
    assert_eq!(m.free_block_ids(), vec![4, 3, 2, 1]);
    assert_eq!(m.add_sequence(2, &toks(0, 13), None, None).unwrap(), 12);
    // another sequence takes 2 blocks: 4 (plain) and 3 (evicted, the prompt's tail)
    m.add_sequence(3, &toks(100, 8), None, None).unwrap();
    assert_eq!(m.allocate_slots(3, 8, 0).unwrap(), Some(vec![4, 3]));
    let ev = m.take_events();
    assert_eq!(ev.len(), 1);
    assert!(matches!(&ev[0], KvCacheEvent::BlockRemoved(r) if r.block_hashes.len() == 1));
    assert_eq!(m.stats().evictions, 1);
    // the probe of the waiting sequence shrank from 3 blocks to 2
    assert_eq!(m.num_computed_tokens(2).unwrap(), 8);
    assert_eq!(m.can_allocate(2, 0).unwrap(), AllocStatus::Later);
    // the claim takes 1 and 2 and needs 2 more blocks: pool short -> None, unchanged
    let before = m.clone();
    assert_eq!(m.allocate_slots(2, 5, 0).unwrap(), None);
    assert!(m == before);
    m.free(3).unwrap();
    assert_eq!(m.allocate_slots(2, 5, 0).unwrap().unwrap().len(), 2);
    assert_eq!(m.num_cached_tokens(2).unwrap(), 8);
    m.check_invariants().unwrap();
}

#[test]
fn claim_never_grows_past_the_add_time_probe() {
    let mut m = manager(16, 4);
    m.add_sequence(2, &toks(0, 9), None, None).unwrap(); // nothing cached yet
    prefill(&mut m, 1, &toks(0, 9));
    assert_eq!(m.num_computed_tokens(2).unwrap(), 0);
    assert_eq!(m.allocate_slots(2, 9, 0).unwrap().unwrap().len(), 3);
    m.check_invariants().unwrap();
}

#[test]
fn refresh_prefixes_lets_a_waiting_claim_grow() {
    for algo in ALGOS {
        let mut m = manager_with(16, 4, |c| c.hash_algo = algo);
        m.add_sequence(2, &toks(0, 9), None, None).unwrap(); // nothing cached yet
        m.add_sequence(3, &toks(0, 8), None, None).unwrap(); // a whole-prompt hit is capped
        m.add_sequence(4, &toks(50, 9), None, None).unwrap(); // other content
        prefill(&mut m, 1, &toks(0, 9));
        assert_eq!(m.num_computed_tokens(2).unwrap(), 0);
        let (free, stats) = (m.free_block_ids(), m.stats());
        assert_eq!(m.refresh_prefixes(&[2, 3, 4, 2]).unwrap(), vec![8, 4, 0, 8]);
        // nothing claimed
        assert_eq!((m.free_block_ids(), m.stats()), (free, stats));
        assert_eq!(m.num_computed_tokens(2).unwrap(), 8);
        assert_eq!(m.probe_prefixes(&[2, 3]).unwrap(), vec![8, 4]);
        // the claim now takes the 2 cached blocks and appends 1
        assert_eq!(m.allocate_slots(2, 1, 0).unwrap().unwrap().len(), 1);
        assert_eq!(m.num_cached_tokens(2).unwrap(), 8);
        m.check_invariants().unwrap();
    }
}

#[test]
fn refresh_prefixes_follows_eviction_both_ways() {
    let mut m = manager(5, 4); // 4 usable
    prefill(&mut m, 1, &toks(0, 12));
    m.free(1).unwrap();
    assert_eq!(m.add_sequence(2, &toks(0, 13), None, None).unwrap(), 12);
    m.add_sequence(3, &toks(100, 4), None, None).unwrap();
    m.allocate_slots(3, 4, 0).unwrap().unwrap(); // takes block 4 (plain)
    m.add_sequence(4, &toks(200, 4), None, None).unwrap();
    m.allocate_slots(4, 4, 0).unwrap().unwrap(); // evicts block 3 (the prompt's tail)
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![8]);
    // the evicted block comes back into the cache from another sequence: the cap grows
    m.free(3).unwrap();
    m.free(4).unwrap();
    prefill(&mut m, 5, &toks(0, 12));
    assert_eq!(m.num_computed_tokens(2).unwrap(), 8);
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![12]);
    assert_eq!(m.num_computed_tokens(2).unwrap(), 12);
    m.check_invariants().unwrap();
}

#[test]
fn refresh_prefixes_errors_leave_state_unchanged() {
    let mut m = manager_with(16, 4, |c| c.num_cpu_blocks = 8);
    m.add_sequence(1, &toks(0, 9), None, None).unwrap();
    prefill(&mut m, 2, &toks(0, 9));
    prefill(&mut m, 3, &toks(50, 9));
    m.swap_out(&[3]).unwrap();
    // seq 1 would grow to 8 tokens; a later bad id must stop that
    assert_fails_unchanged(&mut m, |m| m.refresh_prefixes(&[1, 9]), is_unknown);
    assert_fails_unchanged(&mut m, |m| m.refresh_prefixes(&[1, 2]), is_state);
    assert_fails_unchanged(&mut m, |m| m.refresh_prefixes(&[1, 3]), is_state);
    assert_eq!(m.num_computed_tokens(1).unwrap(), 0);
    assert_eq!(m.refresh_prefixes(&[]).unwrap(), Vec::<i64>::new());
}

#[test]
fn refresh_prefixes_without_caching_is_zero() {
    let mut m = manager_with(16, 4, |c| c.enable_prefix_caching = false);
    prefill(&mut m, 1, &toks(0, 9));
    m.add_sequence(2, &toks(0, 9), None, None).unwrap();
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![0]);
}

#[test]
fn duplicate_content_is_cached_as_another_copy() {
    let mut m = manager(16, 4);
    m.add_sequence(1, &toks(0, 8), None, None).unwrap();
    m.add_sequence(2, &toks(0, 8), None, None).unwrap();
    m.allocate_slots(1, 8, 0).unwrap().unwrap(); // 1,2
    m.allocate_slots(2, 8, 0).unwrap().unwrap(); // 3,4
    m.commit(1, 8, &[]).unwrap();
    assert_eq!(m.take_events().len(), 1);
    // vLLM's block pool caches a recomputed block too, and publishes it in one run.
    m.commit(2, 8, &[]).unwrap();
    match m.take_events().as_slice() {
        [KvCacheEvent::BlockStored(ev)] => assert_eq!(ev.block_hashes.len(), 2),
        other => panic!("expected one BlockStored of both blocks, got {other:?}"),
    }
    assert_eq!(m.stats().num_cached_blocks, 4);
    // seq 2's blocks are cached: freed to the back, last block first
    m.free(2).unwrap();
    assert_eq!(&m.free_block_ids()[m.num_free_blocks() - 2..], &[4, 3]);
    m.check_invariants().unwrap();
}

/// A recomputed prefix duplicates blocks; evicting the first copy must leave the hash
/// hittable while another sequence holds an identical block (the first copy was the only
/// one the cache indexed, so the hit shrank to the blocks before it).
#[test]
fn a_hash_stays_cached_while_any_copy_lives() {
    let mut m = manager(10, 4);
    let a = toks(100, 12);
    let mut b = a.clone();
    b.push(7);
    m.add_sequence(1, &a, None, None).unwrap();
    m.add_sequence(2, &b, None, None).unwrap(); // probed before 1 committed: no hit
    m.allocate_slots(1, 12, 0).unwrap().unwrap(); // 1,2,3
    m.commit(1, 12, &[]).unwrap();
    m.allocate_slots(2, 13, 0).unwrap().unwrap(); // 4,5,6 (copies of 1,2,3), 7
    m.commit(2, 13, &[]).unwrap();
    m.free(1).unwrap(); // queue: 8, 9, then 3, 2, 1 at the back
    m.add_sequence(3, &toks(500, 20), None, None).unwrap();
    m.allocate_slots(3, 12, 0).unwrap().unwrap(); // 8, 9 and 3 (evicted)
    assert_eq!(m.stats().evictions, 1);
    m.check_invariants().unwrap();
    // Sequence 2 still holds all three blocks: the whole prefix hits.
    assert_eq!(m.add_sequence(4, &b, None, None).unwrap(), 12);
    // The claim shares sequence 2's copies (in use) rather than taking the free
    // copies 1 and 2 out of the queue.
    let free = m.num_free_blocks();
    m.allocate_slots(4, 1, 0).unwrap().unwrap();
    let table = m.block_table(4).unwrap();
    assert_eq!(&table[..3], &[4, 5, 6]);
    assert_eq!(m.num_free_blocks(), free - 1); // the new block only
    m.check_invariants().unwrap();
}

#[test]
fn reset_prefix_cache_only_when_nothing_is_used() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 9));
    m.take_events();
    let before = m.clone();
    assert!(!m.reset_prefix_cache());
    assert!(m == before);
    m.free(1).unwrap();
    let order = m.free_block_ids();
    assert!(m.reset_prefix_cache());
    assert_eq!(m.take_events(), vec![KvCacheEvent::AllBlocksCleared]);
    assert_eq!(m.free_block_ids(), order);
    assert_eq!(m.stats().num_cached_blocks, 0);
    assert_eq!(m.add_sequence(2, &toks(0, 9), None, None).unwrap(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn events_can_be_turned_off_without_changing_caching() {
    let mut on = manager(5, 4);
    let mut off = manager_with(5, 4, |c| c.record_events = false);
    for m in [&mut on, &mut off] {
        prefill(m, 1, &toks(0, 12));
        m.free(1).unwrap();
        prefill(m, 2, &toks(100, 12)); // evicts
        m.free(2).unwrap();
        assert!(m.reset_prefix_cache());
    }
    assert_eq!(on.take_events().len(), 2 + 2 + 1);
    assert!(off.take_events().is_empty());
    assert_eq!(on.stats(), off.stats());
    assert_eq!(on.free_block_ids(), off.free_block_ids());
}

#[test]
fn events_carry_the_group_and_its_attention_kind() {
    for (window, spec) in [
        (None, GroupSpec::FullAttention),
        (Some(8), GroupSpec::SlidingWindow { window: 8 }),
    ] {
        let mut m = manager_with(5, 4, |c| c.sliding_window = window);
        prefill(&mut m, 1, &toks(0, 12));
        m.free(1).unwrap();
        prefill(&mut m, 2, &toks(100, 12)); // evicts
        let events = m.take_events();
        assert!(events
            .iter()
            .any(|e| matches!(e, KvCacheEvent::BlockRemoved(_))));
        for e in events {
            match e {
                KvCacheEvent::BlockStored(s) => {
                    assert_eq!((s.group_idx, s.kv_cache_spec), (0, spec));
                }
                KvCacheEvent::BlockRemoved(r) => assert_eq!(r.group_idx, 0),
                KvCacheEvent::AllBlocksCleared => unreachable!(),
            }
        }
    }
    let sw = GroupSpec::SlidingWindow { window: 8 };
    assert_eq!(
        (sw.kind(), sw.sliding_window()),
        ("sliding_window", Some(8))
    );
    let full = GroupSpec::FullAttention;
    assert_eq!(
        (full.kind(), full.sliding_window()),
        ("full_attention", None)
    );
}

#[test]
fn the_manager_s_hasher_gives_its_own_hashes() {
    let mut m = manager_with(16, 4, |c| {
        c.hash_algo = HashAlgo::Sha256Cbor;
        c.hash_seed = Some("12345".to_string());
    });
    m.register_lora(9, "my-lora", "/p");
    let tokens = toks(0, 14);
    m.add_sequence(1, &tokens, Some(b"s"), Some(9)).unwrap();
    m.allocate_slots(1, 14, 0).unwrap().unwrap();
    m.commit(1, 14, &[]).unwrap();
    let stored: Vec<_> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockStored(s) => Some(s.block_hashes),
            _ => None,
        })
        .flatten()
        .collect();
    let mut hasher = m.block_hasher();
    let got = hasher
        .prompt_hashes(&tokens, 4, Some(b"s"), Some(9))
        .unwrap();
    assert_eq!((got.len(), &got), (3, &stored));
}

#[test]
fn caching_disabled_means_no_hits_no_events() {
    let mut m = manager_with(8, 4, |c| c.enable_prefix_caching = false);
    prefill(&mut m, 1, &toks(0, 9));
    assert_eq!(m.add_sequence(2, &toks(0, 9), None, None).unwrap(), 0);
    assert!(m.take_events().is_empty());
    let s = m.stats();
    assert_eq!((s.num_cached_blocks, s.prefix_cache_queries), (0, 0));
    m.free(1).unwrap();
    assert!(m.reset_prefix_cache());
    assert!(m.take_events().is_empty());
    m.check_invariants().unwrap();
}

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
