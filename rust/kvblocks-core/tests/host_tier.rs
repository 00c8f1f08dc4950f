//! The host tier: offload at eviction or commit, loads on a prefix hit, pins until the
//! engine confirms, and the ordered memory-op list.

mod common;

use common::*;
use kvblocks_core::{
    BlockHash, KVCacheManager, KvCacheEvent, KvError, ManagerConfig, Medium, MemoryOp,
    MemoryOpKind, OffloadPolicy, RetentionPriority,
};

fn tiered(num_blocks: usize, host: usize, policy: OffloadPolicy) -> KVCacheManager {
    manager_with(num_blocks, 4, |c| {
        c.host_cache_blocks = host;
        c.host_offload = policy;
    })
}

fn kinds(ops: &[MemoryOp]) -> Vec<MemoryOpKind> {
    ops.iter().map(|o| o.kind).collect()
}

/// Fill the pool with a second prompt so the first one's cached blocks are evicted.
fn evict_all(m: &mut KVCacheManager, id: u64, blocks: usize) {
    prefill(m, id, &toks(10_000, blocks * 4));
    m.free(id).unwrap();
}

#[test]
fn evicted_blocks_are_offloaded_then_loaded_on_a_hit() {
    // 4 usable GPU blocks.
    let mut m = tiered(5, 8, OffloadPolicy::OnEvict);
    let prompt = toks(0, 12);
    prefill(&mut m, 1, &prompt);
    m.free(1).unwrap();
    m.take_events();
    evict_all(&mut m, 2, 4);
    let ops = m.take_memory_ops();
    // The three cached blocks of prompt 1 were evicted (one per pop): three offloads.
    assert_eq!(kinds(&ops), vec![MemoryOpKind::Offload; 3]);
    let tier_events = |m: &mut KVCacheManager| {
        m.take_events()
            .into_iter()
            .filter(|e| matches!(e, KvCacheEvent::BlockStored(s) if s.medium == Medium::Cpu))
            .count()
    };
    m.check_invariants().unwrap();
    // Not confirmed: the slots are being written, no hit yet, and not announced yet.
    assert_eq!(tier_events(&mut m), 0);
    assert_eq!(m.add_sequence(3, &prompt, None, None).unwrap(), 0);
    m.free(3).unwrap();
    m.confirm_memory_ops();
    // Written: announced with the confirmation that makes them hits.
    assert_eq!(tier_events(&mut m), 3);
    // Two blocks hit (never the whole prompt): both from the tier.
    assert_eq!(m.add_sequence(4, &prompt, None, None).unwrap(), 8);
    assert_eq!(m.num_tier_tokens(4).unwrap(), 8);
    assert_eq!(m.num_tier_loads(4).unwrap(), 2);
    let got = m.allocate_slots(4, 4, 0).unwrap().unwrap();
    assert_eq!(
        got.len(),
        1,
        "the loaded blocks are not reported as new blocks"
    );
    let ops = m.take_memory_ops();
    let loads: Vec<_> = ops
        .iter()
        .filter(|o| o.kind == MemoryOpKind::Load)
        .collect();
    assert_eq!(loads.len(), 2);
    let table = m.block_table(4).unwrap();
    assert_eq!(
        loads.iter().map(|o| o.dst as i32).collect::<Vec<_>>(),
        table[..2].to_vec()
    );
    // An offload of a block popped for the loads precedes the load into it.
    for (i, op) in ops.iter().enumerate() {
        if op.kind == MemoryOpKind::Load {
            assert!(!ops[i + 1..]
                .iter()
                .any(|o| o.kind == MemoryOpKind::Offload && o.src == op.dst));
        }
    }
    assert_eq!(m.num_tier_tokens(4).unwrap(), 8);
    assert_eq!(m.num_cached_tokens(4).unwrap(), 8);
    let s = m.stats().host_tier.unwrap();
    assert_eq!((s.loads, s.hits), (2, 8));
    assert!(
        s.num_pinned >= 2,
        "load sources stay pinned until confirmed"
    );
    m.check_invariants().unwrap();
    m.confirm_memory_ops();
    assert_eq!(m.stats().host_tier.unwrap().num_pinned, 0);
    m.check_invariants().unwrap();
}

#[test]
fn a_load_source_is_never_evicted_while_pinned() {
    // 3 usable GPU blocks, 2 tier slots.
    let mut m = tiered(4, 2, OffloadPolicy::OnEvict);
    let prompt = toks(0, 9);
    prefill(&mut m, 1, &prompt);
    m.free(1).unwrap();
    evict_all(&mut m, 2, 3);
    assert_eq!(kinds(&m.take_memory_ops()), vec![MemoryOpKind::Offload; 2]);
    m.confirm_memory_ops();
    assert_eq!(m.add_sequence(3, &prompt, None, None).unwrap(), 8);
    // The claim pins both slots, then pops 3 GPU blocks, evicting prompt 2's cached
    // blocks (all three): their offloads find no unpinned slot and are skipped.
    m.allocate_slots(3, 1, 0).unwrap().unwrap();
    let ops = m.take_memory_ops();
    assert_eq!(kinds(&ops), vec![MemoryOpKind::Load; 2]);
    let s = m.stats().host_tier.unwrap();
    assert_eq!((s.evictions, s.offloads_skipped, s.num_pinned), (0, 3, 2));
    m.check_invariants().unwrap();
    m.confirm_memory_ops();
    assert_eq!(m.stats().host_tier.unwrap().num_pinned, 0);
}

#[test]
fn write_through_offloads_at_commit_and_eviction_copies_nothing() {
    let mut m = tiered(5, 8, OffloadPolicy::WriteThrough);
    let prompt = toks(0, 12);
    prefill(&mut m, 1, &prompt);
    let ops = m.take_memory_ops();
    assert_eq!(kinds(&ops), vec![MemoryOpKind::Offload; 3]);
    let cpu_stored = |m: &mut KVCacheManager| -> Vec<_> {
        m.take_events()
            .into_iter()
            .filter_map(|e| match e {
                KvCacheEvent::BlockStored(s) if s.medium == Medium::Cpu => Some(s),
                _ => None,
            })
            .collect()
    };
    // Queued, not written: no host-tier event until the confirmation.
    assert!(cpu_stored(&mut m).is_empty());
    m.confirm_memory_ops();
    let stored = cpu_stored(&mut m);
    // At commit the tokens are known: full events.
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[1].token_ids, toks(4, 4));
    m.free(1).unwrap();
    evict_all(&mut m, 2, 4);
    let ops = m.take_memory_ops();
    assert!(kinds(&ops).iter().all(|&k| k == MemoryOpKind::Offload));
    assert_eq!(ops.len(), 4, "only prompt 2's commits offload");
    m.confirm_memory_ops();
    assert_eq!(m.add_sequence(3, &prompt, None, None).unwrap(), 8);
    m.check_invariants().unwrap();
}

#[test]
fn copies_and_swaps_share_the_ordered_list() {
    let mut m = manager_with(16, 4, |c| {
        c.host_cache_blocks = 4;
        c.num_cpu_blocks = 8;
    });
    prefill(&mut m, 1, &toks(0, 6));
    m.fork(1, 2).unwrap();
    m.allocate_slots(2, 0, 1).unwrap().unwrap();
    let rows = m.swap_out(&[1]).unwrap();
    let ops = m.take_memory_ops();
    assert_eq!(ops[0].kind, MemoryOpKind::Copy);
    assert_eq!(
        ops[1..].iter().map(|o| [o.src, o.dst]).collect::<Vec<_>>(),
        rows
    );
    // Copies and swaps only: the copy view works with a tier too (the swaps' rows were
    // returned by swap_out/swap_in).
    m.commit(2, 0, &[]).unwrap();
    m.allocate_slots(2, 0, 4).unwrap().unwrap();
    let back = m.swap_in(&[1]).unwrap();
    let ops = m.take_memory_ops();
    assert_eq!(ops.last().map(|o| [o.src, o.dst]), back.last().copied());
    assert!(m.take_copy_on_writes().unwrap().is_empty());
}

#[test]
fn the_copy_view_refuses_while_offloads_or_loads_are_queued() {
    let mut m = tiered(5, 8, OffloadPolicy::WriteThrough);
    prefill(&mut m, 1, &toks(0, 8));
    assert_fails_unchanged(
        &mut m,
        |m| m.take_copy_on_writes(),
        |e| matches!(e, KvError::SequenceState(_)),
    );
    let kinds: Vec<_> = m.take_memory_ops().iter().map(|o| o.kind).collect();
    assert!(kinds.contains(&MemoryOpKind::Offload));
    assert!(m.take_copy_on_writes().unwrap().is_empty());
}

#[test]
fn tier_needs_prefix_caching_and_reset_keeps_pinned_slots() {
    let mut c = ManagerConfig::new(8, 4);
    c.host_cache_blocks = 4;
    c.enable_prefix_caching = false;
    assert!(matches!(
        KVCacheManager::new(c),
        Err(KvError::InvalidArgument(_))
    ));
    let mut m = tiered(5, 8, OffloadPolicy::WriteThrough);
    prefill(&mut m, 1, &toks(0, 8));
    m.free(1).unwrap();
    let hashes_of = |events: Vec<KvCacheEvent>, medium: Medium| -> Vec<BlockHash> {
        events
            .into_iter()
            .filter_map(|e| match e {
                KvCacheEvent::BlockStored(s) if s.medium == medium => Some(s.block_hashes),
                _ => None,
            })
            .flatten()
            .collect()
    };
    let events = m.take_events();
    let stored = hashes_of(events.clone(), Medium::Gpu);
    assert_eq!(stored.len(), 2);
    // The write-through offloads are queued, not written: no host-tier event yet.
    assert!(hashes_of(events, Medium::Cpu).is_empty());
    // Offloads not confirmed: reset keeps their slots, which are no hits yet, so the
    // clear (which covers every medium: no host-tier `BlockRemoved`) is all it sends ...
    assert!(m.reset_prefix_cache());
    assert_eq!(m.stats().host_tier.unwrap().num_blocks, 2);
    assert_eq!(m.take_events(), vec![KvCacheEvent::AllBlocksCleared]);
    assert_eq!(m.add_sequence(2, &toks(0, 9), None, None).unwrap(), 0);
    m.free(2).unwrap();
    // ... and the kept blocks are announced by the confirmation that makes them hits.
    m.take_memory_ops();
    m.confirm_memory_ops();
    assert_eq!(hashes_of(m.take_events(), Medium::Cpu), stored);
    assert_eq!(m.add_sequence(3, &toks(0, 9), None, None).unwrap(), 8);
    m.free(3).unwrap();
    m.take_memory_ops();
    m.confirm_memory_ops();
    assert!(m.reset_prefix_cache());
    assert_eq!(m.stats().host_tier.unwrap().num_blocks, 0);
    assert_eq!(m.take_events(), vec![KvCacheEvent::AllBlocksCleared]);
    m.check_invariants().unwrap();
}

#[test]
fn without_a_tier_nothing_changes() {
    let mut m = manager(8, 4);
    prefill(&mut m, 1, &toks(0, 8));
    assert!(m.take_memory_ops().is_empty());
    assert_eq!(m.num_tier_tokens(1).unwrap(), 0);
    assert!(m.stats().host_tier.is_none());
    m.confirm_memory_ops();
    assert!(m.take_copy_on_writes().unwrap().is_empty());
}

/// Random operations in a debug build (debug assertions on): no panic, invariants after
/// every call, a failing call changes nothing, and every queued op is drained.
#[test]
fn random_operations_keep_the_invariants() {
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n.max(1)
    };
    let mut kinds_seen = std::collections::HashSet::new();
    for round in 0..40 {
        let policy = if round % 3 == 0 {
            OffloadPolicy::WriteThrough
        } else {
            OffloadPolicy::OnEvict
        };
        let mut m = manager_with(4 + next(12) as usize, 1 + next(4) as usize, |c| {
            c.host_cache_blocks = 1 + next(16) as usize;
            c.host_offload = policy;
            c.num_cpu_blocks = next(8) as usize;
        });
        let mut next_id = 0u64;
        for _ in 0..300 {
            let ids = m.seq_ids();
            let pick = |r: u64| ids.get(r as usize % ids.len().max(1)).copied();
            match next(9) {
                0 | 1 => {
                    let stem = next(3) as u32 * 100;
                    let len = 1 + next(20) as usize;
                    m.add_sequence(next_id, &toks(stem, len), None, None)
                        .unwrap();
                    next_id += 1;
                }
                2 | 3 => {
                    if let Some(id) = pick(next(64)) {
                        let left = m.num_tokens(id).unwrap() as i64
                            - m.num_computed_tokens(id).unwrap() as i64;
                        if !m.is_swapped(id).unwrap() && left >= 0 {
                            let new = next(left as u64 + 1) as usize;
                            let before = m.clone();
                            match m.allocate_slots(id, new, next(3) as usize) {
                                Ok(Some(_)) => m.commit(id, new, &[7]).map(|_| ()).unwrap_or(()),
                                Ok(None) => assert!(m == before),
                                Err(_) => assert!(m == before),
                            }
                        }
                    }
                }
                4 => {
                    if let Some(id) = pick(next(64)) {
                        m.free(id).unwrap();
                    }
                }
                5 => {
                    if let Some(id) = pick(next(64)) {
                        let _ = m.fork(id, next_id);
                        next_id += 1;
                    }
                }
                6 => {
                    if let Some(id) = pick(next(64)) {
                        if m.is_swapped(id).unwrap() {
                            let _ = m.swap_in(&[id]);
                        } else {
                            let _ = m.swap_out(&[id]);
                        }
                    }
                }
                7 => {
                    for op in m.take_memory_ops() {
                        kinds_seen.insert(op.kind);
                    }
                    if next(2) == 0 {
                        m.confirm_memory_ops();
                    }
                }
                _ => {
                    if next(8) == 0 {
                        m.reset_prefix_cache();
                    } else {
                        m.confirm_memory_ops();
                    }
                }
            }
            m.check_invariants().unwrap();
        }
    }
    for kind in [
        MemoryOpKind::Offload,
        MemoryOpKind::Load,
        MemoryOpKind::SwapOut,
    ] {
        assert!(kinds_seen.contains(&kind), "{kind:?} never issued");
    }
}

/// The GPU-medium `BlockStored` hashes of `m`'s events, in order.
fn stored_gpu_hashes(m: &mut KVCacheManager) -> Vec<Vec<u8>> {
    m.take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockStored(s) if s.medium == Medium::Gpu => Some(s.block_hashes),
            _ => None,
        })
        .flatten()
        .map(|h| h.as_bytes().to_vec())
        .collect()
}

#[test]
fn imported_blocks_hit_only_after_confirmation_and_load() {
    let prompt = toks(0, 12);
    let mut a = tiered(8, 4, OffloadPolicy::OnEvict);
    prefill(&mut a, 1, &prompt);
    let hashes = stored_gpu_hashes(&mut a);
    assert_eq!(hashes.len(), 3);
    let refs: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();

    let mut b = tiered(8, 2, OffloadPolicy::OnEvict);
    b.take_events();
    // Two slots: the third block finds none free (both pinned by the import).
    assert_eq!(
        b.import_tier_blocks(&refs, RetentionPriority::DEFAULT)
            .unwrap(),
        vec![0, 1, -1]
    );
    let cpu_stored = |b: &mut KVCacheManager| {
        b.take_events()
            .into_iter()
            .filter(|e| matches!(e, KvCacheEvent::BlockStored(s) if s.medium == Medium::Cpu))
            .count()
    };
    // Reserved, not written: announced only once confirmed (then they are hits).
    assert_eq!(cpu_stored(&mut b), 0);
    b.check_invariants().unwrap();
    // Held already (being written): nothing to write again.
    assert_eq!(
        b.import_tier_blocks(&refs[..1], RetentionPriority::DEFAULT)
            .unwrap(),
        vec![-1]
    );
    // Not written yet: no hit.
    assert_eq!(b.add_sequence(2, &prompt, None, None).unwrap(), 0);
    b.free(2).unwrap();
    b.confirm_memory_ops();
    assert_eq!(cpu_stored(&mut b), 2);
    b.check_invariants().unwrap();
    assert_eq!(b.add_sequence(3, &prompt, None, None).unwrap(), 8);
    assert_eq!(b.num_tier_tokens(3).unwrap(), 8);
    b.allocate_slots(3, 4, 0).unwrap().unwrap();
    let loads: Vec<_> = b
        .take_memory_ops()
        .into_iter()
        .filter(|o| o.kind == MemoryOpKind::Load)
        .map(|o| o.src)
        .collect();
    assert_eq!(loads, vec![0, 1]);
    b.confirm_memory_ops();
    b.check_invariants().unwrap();
    assert_eq!(b.tier_stats().unwrap().imports, 2);
    // A block in the GPU prefix cache is not imported.
    assert_eq!(
        a.import_tier_blocks(&refs[..1], RetentionPriority::DEFAULT)
            .unwrap(),
        vec![-1]
    );
}

#[test]
fn imports_keep_their_retention_priority_in_the_tier() {
    let digest = |i: u8| [i; 32];
    let digests: Vec<[u8; 32]> = (1..=5).map(digest).collect();
    let refs: Vec<&[u8]> = digests.iter().map(|d| d.as_slice()).collect();
    let high = RetentionPriority::new(80).unwrap();
    let mut m = tiered(8, 2, OffloadPolicy::OnEvict);
    assert_eq!(m.import_tier_blocks(&refs[..2], high).unwrap(), vec![0, 1]);
    m.confirm_memory_ops();
    // Default-priority imports find no slot: both hold higher-priority blocks.
    assert_eq!(
        m.import_tier_blocks(&refs[2..4], RetentionPriority::DEFAULT)
            .unwrap(),
        vec![-1, -1]
    );
    assert_eq!(m.num_cached_prefix_blocks(&refs[..1]), 1);
    // A higher priority still evicts one (the least recently used).
    let top = RetentionPriority::new(90).unwrap();
    assert_eq!(m.import_tier_blocks(&refs[4..], top).unwrap(), vec![0]);
    m.confirm_memory_ops();
    m.check_invariants().unwrap();
    assert_eq!(m.num_cached_prefix_blocks(&refs[..1]), 0);
    assert_eq!(m.num_cached_prefix_blocks(&refs[4..]), 1);
}

#[test]
fn import_rejects_bad_digests_and_managers_without_a_tier() {
    let mut m = tiered(8, 2, OffloadPolicy::OnEvict);
    let good = [0u8; 32];
    let before = m.tier_stats();
    for bad in [&[0u8; 16][..], &[0u8; 31][..], &[][..]] {
        let err = m
            .import_tier_blocks(&[&good[..], bad], RetentionPriority::DEFAULT)
            .unwrap_err();
        assert!(matches!(err, KvError::InvalidArgument(_)), "{err:?}");
    }
    assert_eq!(m.tier_stats(), before, "a failed import reserves nothing");
    m.check_invariants().unwrap();
    let mut plain = manager_with(8, 4, |_| {});
    assert!(matches!(
        plain.import_tier_blocks(&[&good[..]], RetentionPriority::DEFAULT),
        Err(KvError::InvalidArgument(_))
    ));
}

#[test]
fn slot_hashes_and_cached_prefix_follow_offloads_and_imports() {
    let prompt = toks(0, 12);
    let mut a = tiered(8, 4, OffloadPolicy::WriteThrough);
    prefill(&mut a, 1, &prompt);
    let hashes = stored_gpu_hashes(&mut a);
    let refs: Vec<&[u8]> = hashes.iter().map(|h| h.as_slice()).collect();
    assert_eq!(a.num_cached_prefix_blocks(&refs), 3);
    let offloads: Vec<i64> = a
        .take_memory_ops()
        .into_iter()
        .filter(|o| o.kind == MemoryOpKind::Offload)
        .map(|o| o.dst)
        .collect();
    let slot_hashes: Vec<Vec<u8>> = a
        .tier_slot_hashes(&offloads)
        .into_iter()
        .map(|h| h.unwrap().as_bytes().to_vec())
        .collect();
    assert_eq!(slot_hashes, hashes);
    assert_eq!(a.tier_slot_hashes(&[-1, 3, 99]), vec![None, None, None]);

    let mut b = tiered(8, 4, OffloadPolicy::OnEvict);
    assert_eq!(b.num_cached_prefix_blocks(&refs), 0);
    let slots = b
        .import_tier_blocks(&refs[..2], RetentionPriority::DEFAULT)
        .unwrap();
    // Being written: no hit yet.
    assert_eq!(b.num_cached_prefix_blocks(&refs), 0);
    assert!(b.tier_slot_hashes(&slots).iter().all(|h| h.is_some()));
    b.confirm_memory_ops();
    assert_eq!(b.num_cached_prefix_blocks(&refs), 2);
    assert_eq!(b.num_cached_prefix_blocks(&[&[1u8; 7][..]]), 0);
}

/// Two sequences computing one prompt at once cache two copies of each block: evicting
/// one copy leaves the content on the GPU and offloads nothing (the tier would only be
/// asked for a hash the GPU still serves); the last copy's eviction offloads it once.
#[test]
fn evicting_a_duplicate_offloads_only_the_last_copy() {
    let mut m = tiered(9, 8, OffloadPolicy::OnEvict); // 8 usable GPU blocks
    let prompt = toks(0, 8);
    for id in [1, 2] {
        m.add_sequence(id, &prompt, None, None).unwrap();
        m.allocate_slots(id, 8, 0).unwrap().unwrap(); // 1,2 then 3,4
    }
    m.commit(1, 8, &[]).unwrap();
    m.commit(2, 8, &[]).unwrap();
    assert_eq!(m.stats().num_cached_blocks, 4);
    m.free(1).unwrap();
    m.free(2).unwrap(); // queue: 5..8, then 2, 1, 4, 3 at the back
    prefill(&mut m, 3, &toks(1_000, 24)); // 5..8, then copies 2 and 1
    assert_eq!(m.stats().evictions, 2);
    assert!(m.take_memory_ops().is_empty(), "a copy was offloaded");
    m.check_invariants().unwrap();
    assert_eq!(m.add_sequence(4, &toks(0, 9), None, None).unwrap(), 8);
    assert_eq!(m.num_tier_loads(4).unwrap(), 0);
    m.free(4).unwrap();
    prefill(&mut m, 5, &toks(2_000, 8)); // the last copies, 4 and 3
    assert_eq!(m.stats().evictions, 4);
    assert_eq!(kinds(&m.take_memory_ops()), vec![MemoryOpKind::Offload; 2]);
    m.confirm_memory_ops();
    m.free(3).unwrap();
    m.free(5).unwrap();
    assert_eq!(m.add_sequence(6, &toks(0, 9), None, None).unwrap(), 8);
    assert_eq!(m.num_tier_loads(6).unwrap(), 2);
    m.check_invariants().unwrap();
}
