//! Every manager feature per KV cache group: events, fork, copy-on-write and swap,
//! persistent tables, the host tier, and `can_allocate_step`. (The groups themselves and
//! the hit rule are in `main.rs`.)

use std::collections::HashSet;

use crate::common::groups::{chunked, grouped, run, window, FULL};
use crate::common::{manager_with, toks};
use kvblocks_core::{GroupSpec, KvCacheEvent, KvError, Medium};

#[test]
fn events_carry_the_group_of_their_blocks() {
    let mut m = grouped(9, 2, &[FULL, window(2)]);
    assert!(run(&mut m, 1, &toks(0, 4)));
    let stored: Vec<(u32, usize, GroupSpec)> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockStored(s) => {
                Some((s.group_idx, s.block_hashes.len(), s.kv_cache_spec))
            }
            _ => None,
        })
        .collect();
    // Each event carries its own group's spec (vLLM's kv_cache_spec_kind/_sliding_window).
    assert_eq!(stored, vec![(0, 2, FULL), (1, 2, window(2))]);
    m.free(1).unwrap();
    // A prompt of 4 blocks per group takes the whole pool: every cached block goes.
    assert!(run(&mut m, 2, &toks(50, 8)));
    let mut removed: Vec<u32> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockRemoved(r) => {
                assert_eq!(r.medium, Medium::Gpu);
                Some(r.group_idx)
            }
            _ => None,
        })
        .collect();
    removed.sort_unstable();
    assert_eq!(removed, vec![0, 0, 1, 1]);
}

#[test]
fn fork_copy_on_write_and_swap_work_in_every_group() {
    let mut m = manager_with(64, 4, |c| {
        c.groups = vec![FULL, window(3), chunked(4)];
        c.num_cpu_blocks = 32;
    });
    assert!(run(&mut m, 1, &toks(0, 10)));
    m.fork(1, 2).unwrap();
    // The partly filled last block is shared in every group: one copy each.
    let got = m.allocate_slots(2, 0, 1).unwrap().unwrap();
    assert_eq!(got.len(), 3);
    let copies = m.take_copy_on_writes().unwrap();
    assert_eq!(copies.len(), 3);
    for (g, pair) in copies.iter().enumerate() {
        assert_eq!(pair[0], m.group_block_table(1, g).unwrap()[2] as i64);
        assert_eq!(pair[1], m.group_block_table(2, g).unwrap()[2] as i64);
    }
    m.commit(2, 0, &[]).unwrap();
    let before: Vec<Vec<i32>> = (0..3).map(|g| m.group_block_table(1, g).unwrap()).collect();
    let out = m.swap_out(&[1]).unwrap();
    // Only held blocks move: 3 + 1 + 1 of sequence 1 (window 3 at 10: from 8; chunk from 8).
    assert_eq!(out.len(), 3 + 1 + 1);
    let back = m.swap_in(&[1]).unwrap();
    assert_eq!(back.len(), 5);
    for (g, old) in before.iter().enumerate() {
        let new = m.group_block_table(1, g).unwrap();
        assert_eq!(
            old.iter().map(|&b| b == 0).collect::<Vec<_>>(),
            new.iter().map(|&b| b == 0).collect::<Vec<_>>(),
            "group {g}: released entries stay null"
        );
    }
    m.check_invariants().unwrap();
}

#[test]
fn each_groups_persistent_table_is_synced_on_its_own() {
    let mut m = grouped(64, 4, &[FULL, window(4)]);
    assert!(run(&mut m, 1, &toks(0, 6)));
    let (rows, cols) = (2usize, 8usize);
    let mut buf = vec![0i32; 2 * rows * cols];
    let d = m
        .sync_group_block_tables(&[1], &[1], rows, cols, Some(&mut buf), false)
        .unwrap();
    assert_eq!(d.len(), 2);
    assert!(d.iter().all(|d| d.reset == vec![true]));
    for t in 0..3 {
        m.commit(1, 0, &[t]).unwrap();
        m.allocate_slots(1, 1, 0).unwrap().unwrap();
        m.commit(1, 1, &[]).unwrap();
    }
    // 9 computed: the window sees from 6, block 0 released in group 1 only.
    let d = m
        .sync_group_block_tables(&[1], &[1], rows, cols, Some(&mut buf), false)
        .unwrap();
    assert_eq!(d[0].start_cols, vec![2]);
    assert_eq!(d[1].start_cols, vec![0]);
    for g in 0..2 {
        let mut want = m.group_block_table(1, g).unwrap();
        want.resize(cols, 0);
        let row = &buf[g * rows * cols + cols..g * rows * cols + 2 * cols];
        assert_eq!(row, &want[..], "group {g}");
    }
    // A buffer of the wrong size is refused before anything is consumed.
    let arg = |e: &KvError| matches!(e, KvError::InvalidArgument(_));
    let mut short = vec![0i32; rows * cols];
    crate::common::assert_fails_unchanged(
        &mut m,
        |m| m.sync_group_block_tables(&[1], &[1], rows, cols, Some(&mut short), false),
        arg,
    );
}

#[test]
fn a_reset_re_announces_each_groups_kept_host_blocks_with_its_spec() {
    let mut m = manager_with(13, 2, |c| {
        c.groups = vec![FULL, chunked(4)];
        c.host_cache_blocks = 16;
    });
    assert!(run(&mut m, 1, &toks(0, 6)));
    m.free(1).unwrap();
    assert!(run(&mut m, 2, &toks(100, 12))); // evicts (offloads) every cached block
    m.free(2).unwrap();
    // Offloads not confirmed: their host slots stay pinned through the reset.
    assert!(!m.take_memory_ops().is_empty());
    m.take_events();
    assert!(m.reset_prefix_cache());
    // Being written, the kept blocks are no hits yet: the clear comes alone, and the
    // confirmation that makes them hits announces them, each with its group's spec.
    assert_eq!(m.take_events(), vec![KvCacheEvent::AllBlocksCleared]);
    m.confirm_memory_ops();
    let events = m.take_events();
    let mut kept: Vec<(u32, GroupSpec)> = events
        .iter()
        .map(|e| match e {
            KvCacheEvent::BlockStored(s) => {
                assert_eq!(s.medium, Medium::Cpu);
                (s.group_idx, s.kv_cache_spec)
            }
            other => panic!("only host-tier stores follow the clear, got {other:?}"),
        })
        .collect();
    kept.sort_by_key(|(g, _)| *g);
    kept.dedup();
    assert_eq!(kept, vec![(0, FULL), (1, chunked(4))]);
    m.check_invariants().unwrap();
}

#[test]
fn host_tier_keys_blocks_by_group() {
    let mut m = manager_with(13, 2, |c| {
        c.groups = vec![FULL, window(3)];
        c.host_cache_blocks = 16;
    });
    let prompt = toks(0, 6);
    assert!(run(&mut m, 1, &prompt));
    m.free(1).unwrap();
    // 6 blocks per group take the whole pool: every cached block of both groups is
    // evicted (and offloaded).
    assert!(run(&mut m, 2, &toks(100, 12)));
    m.free(2).unwrap();
    let ops = m.take_memory_ops();
    m.confirm_memory_ops();
    assert!(ops
        .iter()
        .any(|o| o.kind == kvblocks_core::MemoryOpKind::Offload));
    let slots: Vec<i64> = (0..16).collect();
    let groups: HashSet<usize> = m
        .tier_slot_keys(&slots)
        .into_iter()
        .flatten()
        .map(|(g, _)| g)
        .collect();
    assert_eq!(groups, HashSet::from([0, 1]));
    // The repeat loads each group's own blocks back.
    let mut probe = prompt.clone();
    probe.push(1);
    assert_eq!(m.add_sequence(3, &probe, None, None).unwrap(), 6);
    m.allocate_slots(3, 1, 0).unwrap().unwrap();
    m.check_invariants().unwrap();
    let loads = m
        .take_memory_ops()
        .into_iter()
        .filter(|o| o.kind == kvblocks_core::MemoryOpKind::Load)
        .count();
    // Full: 3 blocks; window 3 at position 6 sees from 4: block 2 only.
    assert_eq!(loads, 4);
    assert_eq!(m.num_tier_tokens(3).unwrap(), 6);
}

#[test]
fn tier_loads_are_limited_over_every_group() {
    let mut m = manager_with(9, 2, |c| {
        c.groups = vec![FULL, window(3)];
        c.host_cache_blocks = 16;
    });
    let prompt = toks(0, 8);
    assert!(run(&mut m, 1, &prompt));
    m.free(1).unwrap();
    // 4 blocks per group take the whole pool: every cached block goes to the tier.
    assert!(run(&mut m, 2, &toks(100, 8)));
    m.free(2).unwrap();
    m.take_memory_ops();
    m.confirm_memory_ops();
    let mut probe = prompt.clone();
    probe.push(1);
    m.add_sequence(3, &probe, None, None).unwrap();
    // The whole hit (4 blocks) loads 4 full-attention blocks and the window's block 3.
    assert_eq!(m.num_computed_tokens(3).unwrap(), 8);
    assert_eq!(m.num_tier_tokens(3).unwrap(), 8);
    assert_eq!(m.num_tier_loads(3).unwrap(), 5);
    // At most 2 loads: a hit of 1 block (1 + 1 loads); 2 blocks would load 2 + 1.
    assert_eq!(m.limit_tier_loads(3, 2).unwrap(), 2);
    m.allocate_slots(3, 2, 0).unwrap().unwrap();
    let loads = m
        .take_memory_ops()
        .into_iter()
        .filter(|o| o.kind == kvblocks_core::MemoryOpKind::Load)
        .count();
    assert_eq!(loads, 2);
    m.check_invariants().unwrap();
}

/// `can_allocate_step` says `Ok` exactly when the step's `allocate_slots` is served (no
/// watermark), after other sequences took part of the pool and with a cached prefix that a
/// window group claims only the end of; `Never` only when no such step can be.
#[test]
fn can_allocate_step_is_the_steps_real_need_in_every_group() {
    let prompt: Vec<u32> = (1..=60).collect();
    for groups in [
        vec![FULL, window(6)],
        vec![window(5), chunked(8)],
        vec![FULL, FULL],
        vec![chunked(4), FULL, window(9)],
    ] {
        for others in 0..4u64 {
            for new in [1usize, 7, 16, 30, 56] {
                let mut m = manager_with(40, 4, |c| {
                    c.groups = groups.clone();
                    c.watermark = 0.0;
                });
                // A cached prefix of the prompt, then sequences holding part of the pool.
                assert!(run(&mut m, 100, &prompt[..33]));
                m.free(100).unwrap();
                for o in 0..others {
                    let filler: Vec<u32> =
                        (1000 * (o as u32 + 1)..1000 * (o as u32 + 1) + 9).collect();
                    run(&mut m, 200 + o, &filler);
                }
                m.add_sequence(1, &prompt, None, None).unwrap();
                let cached = m.num_computed_tokens(1).unwrap();
                if cached + new > prompt.len() {
                    assert!(matches!(
                        m.can_allocate_step(1, new, 0),
                        Err(KvError::InvalidArgument(_))
                    ));
                    continue;
                }
                let status = m.can_allocate_step(1, new, 0).unwrap();
                let served = m.allocate_slots(1, new, 0).unwrap().is_some();
                assert_eq!(
                    status == kvblocks_core::AllocStatus::Ok,
                    served,
                    "{groups:?} others={others} new={new}: {status:?}"
                );
                m.check_invariants().unwrap();
            }
        }
    }
    // A full + window model: a 100-token prompt can never be allocated whole (every
    // block in both groups until it commits: 50 > 39), but in steps it fits.
    let mut m = grouped(40, 4, &[FULL, window(4)]);
    let long: Vec<u32> = (1..=100).collect();
    m.add_sequence(1, &long, None, None).unwrap();
    assert_eq!(
        m.can_allocate(1, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
    assert_eq!(
        m.can_allocate_step(1, 100, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
    assert_eq!(
        m.can_allocate_step(1, 16, 0).unwrap(),
        kvblocks_core::AllocStatus::Ok
    );
    // A window's count is not monotone: 46 tokens in blocks of 8 with a 28-token window
    // and a full group end holding 4 + 6 = 10 blocks (all of the pool), but the query at
    // position 40 sees from 13, blocks 1..=5, with 6 full blocks: 11. No schedule passes.
    let mut m = manager_with(11, 8, |c| {
        c.groups = vec![window(28), FULL];
        c.watermark = 0.0;
    });
    let prompt46: Vec<u32> = (1..=46).collect();
    m.add_sequence(1, &prompt46, None, None).unwrap();
    assert_eq!(
        m.can_allocate_step(1, 1, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
    // Two full groups: the last step keeps every block of both (50 > 39).
    let mut m = grouped(40, 4, &[FULL, FULL]);
    m.add_sequence(1, &long, None, None).unwrap();
    assert_eq!(
        m.can_allocate_step(1, 16, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
}

/// Two chunk sizes: the peak need can lie outside the last `lcm(chunk, block_size)`
/// positions of the larger chunk. A window of 12 and chunks of 12 and 8 over blocks of 1
/// hold 12 + 12 + 8 = 32 blocks at the query at 23, more than the 30 usable; the last
/// 12 positions peak at 28, which the check used to read, and said `Ok` for a prompt
/// that stalls at 23 computed one token a step with the pool to itself.
#[test]
fn can_allocate_step_finds_the_peak_of_two_chunk_sizes() {
    let groups = [window(12), chunked(12), chunked(8)];
    let prompt: Vec<u32> = (1..=38).collect();
    let mut m = grouped(31, 1, &groups);
    m.add_sequence(1, &prompt, None, None).unwrap();
    assert_eq!(
        m.can_allocate_step(1, 1, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
    let mut stalled = None;
    for p in 0..prompt.len() {
        if m.allocate_slots(1, 1, 0).unwrap().is_none() {
            stalled = Some(p);
            break;
        }
        m.commit(1, 1, &[]).unwrap();
    }
    assert_eq!(stalled, Some(23));
    // With 32 usable blocks it fits, and runs to the end one token a step.
    let mut m = grouped(33, 1, &groups);
    m.add_sequence(1, &prompt, None, None).unwrap();
    assert_eq!(
        m.can_allocate_step(1, 1, 0).unwrap(),
        kvblocks_core::AllocStatus::Ok
    );
    for _ in 0..prompt.len() {
        assert!(m.allocate_slots(1, 1, 0).unwrap().is_some());
        m.commit(1, 1, &[]).unwrap();
    }
}
