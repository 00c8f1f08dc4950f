//! Unit tests of the manager's prefix cache: hits, free order, namespaces, eviction,
//! `refresh_prefixes`, duplicate copies, resets and events.

use crate::common::*;
use kvblocks_core::{AllocStatus, GroupSpec, HashAlgo, KvCacheEvent};

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
