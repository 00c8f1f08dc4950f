//! KV cache groups: per-group tables over one pool, the footprint of window and chunked
//! groups, the hit rule (a fixed point over the groups), and every feature per group.
//! (Recurrent-state groups have their own file, `recurrent.rs`; the random operations
//! here mix them in.)

mod common;

use std::collections::{HashMap, HashSet};

use common::{manager_with, toks};
use kvblocks_core::{
    BlockHash, BlockHasher, GroupSpec, HashAlgo, KVCacheManager, KvCacheEvent, KvError, Medium,
};
use proptest::prelude::*;

const FULL: GroupSpec = GroupSpec::FullAttention;

fn window(w: usize) -> GroupSpec {
    GroupSpec::SlidingWindow { window: w }
}

fn chunked(c: usize) -> GroupSpec {
    GroupSpec::ChunkedLocalAttention { chunk: c }
}

fn grouped(num_blocks: usize, block_size: usize, groups: &[GroupSpec]) -> KVCacheManager {
    manager_with(num_blocks, block_size, |c| c.groups = groups.to_vec())
}

/// Add a sequence and compute it whole; false (and freed) if the pool is short.
fn run(m: &mut KVCacheManager, id: u64, prompt: &[u32]) -> bool {
    m.add_sequence(id, prompt, None, None).unwrap();
    let n = prompt.len() - m.num_computed_tokens(id).unwrap();
    if m.allocate_slots(id, n, 0).unwrap().is_none() {
        m.free(id).unwrap();
        return false;
    }
    m.commit(id, n, &[]).unwrap();
    m.check_invariants().unwrap();
    true
}

/// Non-null entries of a group's table.
fn held(m: &KVCacheManager, id: u64, group: usize) -> usize {
    m.group_block_table(id, group)
        .unwrap()
        .iter()
        .filter(|&&b| b != 0)
        .count()
}

#[test]
fn a_manager_without_groups_is_one_full_or_window_group() {
    let m = common::manager(8, 4);
    assert_eq!(m.groups(), &[FULL]);
    let m = manager_with(8, 4, |c| c.sliding_window = Some(5));
    assert_eq!(m.groups(), &[window(5)]);
    let m = grouped(8, 4, &[FULL, chunked(6)]);
    assert_eq!((m.num_groups(), m.sliding_window()), (2, None));
}

#[test]
fn bad_group_configs_and_group_indices_are_refused() {
    let bad = |f: &dyn Fn(&mut kvblocks_core::ManagerConfig)| {
        let mut c = kvblocks_core::ManagerConfig::new(8, 4);
        f(&mut c);
        matches!(KVCacheManager::new(c), Err(KvError::InvalidArgument(_)))
    };
    assert!(bad(&|c| c.groups = vec![window(0)]));
    assert!(bad(&|c| c.groups = vec![FULL, chunked(0)]));
    assert!(bad(&|c| {
        c.groups = vec![FULL];
        c.sliding_window = Some(4);
    }));
    assert!(bad(
        &|c| c.groups = vec![FULL; kvblocks_core::MAX_GROUPS + 1]
    ));
    let mut m = grouped(16, 4, &[FULL, window(4)]);
    assert!(run(&mut m, 1, &toks(0, 6)));
    let arg = |e: &KvError| matches!(e, KvError::InvalidArgument(_));
    common::assert_fails_unchanged(&mut m, |m| m.group_block_table(1, 2), arg);
    common::assert_fails_unchanged(&mut m, |m| m.group_block_tables(&[1], None, Some(2)), arg);
    common::assert_fails_unchanged(&mut m, |m| m.group_slot_mapping(&[1], None, Some(9)), arg);
    common::assert_fails_unchanged(
        &mut m,
        |m| m.sync_group_block_table(2, &[1], &[0], 4, 8, None, false),
        arg,
    );
}

#[test]
fn every_group_gets_its_own_blocks_from_the_one_pool() {
    let mut m = grouped(32, 4, &[FULL, window(5), chunked(8)]);
    m.add_sequence(1, &toks(0, 10), None, None).unwrap();
    let got = m.allocate_slots(1, 10, 0).unwrap().unwrap();
    // Three blocks per group, group after group.
    assert_eq!(got.len(), 9);
    let tables: Vec<Vec<i32>> = (0..3).map(|g| m.group_block_table(1, g).unwrap()).collect();
    assert_eq!(got, tables.concat());
    // Slot mappings differ per group: each writes its layers' KV into its own blocks.
    let all = m.group_slot_mapping(&[1], None, None).unwrap();
    assert_eq!(all.len(), 30);
    for (g, t) in tables.iter().enumerate() {
        let slots = m.group_slot_mapping(&[1], None, Some(g)).unwrap();
        assert_eq!(&all[g * 10..(g + 1) * 10], &slots[..]);
        assert_eq!(slots[5], t[1] as i64 * 4 + 1);
    }
    let b = m.group_block_tables(&[1], None, None).unwrap();
    assert_eq!((b.num_groups, b.num_rows, b.num_cols), (3, 1, 3));
    assert_eq!(b.data, tables.concat());
    m.commit(1, 10, &[]).unwrap();
    // Computed 10: the window (5) sees from 6 on, block 0 goes; the chunk (8) from 8 on,
    // blocks 0 and 1 go. Full attention keeps all three.
    assert_eq!((held(&m, 1, 0), held(&m, 1, 1), held(&m, 1, 2)), (3, 2, 1));
    assert_eq!(m.stats().num_used_blocks_per_group, vec![3, 2, 1]);
    assert_eq!(m.num_free_blocks(), 31 - 6);
    m.free(1).unwrap();
    assert_eq!(m.stats().num_used_blocks_per_group, vec![0, 0, 0]);
    assert_eq!(m.stats().num_cached_blocks_per_group, vec![2, 2, 2]);
    m.check_invariants().unwrap();
}

#[test]
fn a_window_group_holds_its_window_plus_the_step_and_no_more() {
    // W = 7 with blocks of 4: a query sees 7 tokens, spread over at most 3 blocks.
    let (bs, w) = (4usize, 7usize);
    let mut m = grouped(64, bs, &[window(w), chunked(6)]);
    assert!(run(&mut m, 1, &toks(0, 3)));
    for step in 0..60u32 {
        m.commit(1, 0, &[step]).unwrap();
        m.allocate_slots(1, 1, 0).unwrap().unwrap();
        let computed = m.num_computed_tokens(1).unwrap();
        // During the step: the window of the next query plus the step's token.
        assert!(held(&m, 1, 0) <= (w - 1).div_ceil(bs) + 2, "step {step}");
        m.commit(1, 1, &[]).unwrap();
        let c = computed + 1;
        let visible = (c + 1).saturating_sub(w);
        assert_eq!(held(&m, 1, 0), c.div_ceil(bs) - visible / bs, "step {step}");
        assert_eq!(
            held(&m, 1, 1),
            c.div_ceil(bs) - c / 6 * 6 / bs,
            "step {step}"
        );
        m.check_invariants().unwrap();
    }
    assert_eq!(m.block_table(1).unwrap().len(), 63usize.div_ceil(bs));
}

#[test]
fn a_window_hit_needs_only_the_blocks_of_the_window() {
    // One window group (the `sliding_window` form): the prompt's early blocks are
    // evicted, yet a repeat of the prompt hits it whole, since its next query sees only
    // the last W - 1 = 4 tokens (block 3).
    let mut m = manager_with(9, 4, |c| c.sliding_window = Some(5));
    let prompt = toks(0, 17);
    assert!(run(&mut m, 1, &prompt));
    // Computed 17: first visible 13, blocks 0..3 released (cached, free).
    assert_eq!(m.block_table(1).unwrap()[..3], [0, 0, 0]);
    m.free(1).unwrap();
    // Pressure: blocks 0..2 (freed first, and evicted first) go.
    assert!(run(&mut m, 2, &toks(100, 12)));
    let mut probe = prompt.clone();
    probe.push(99);
    assert_eq!(m.add_sequence(3, &probe, None, None).unwrap(), 16);
    m.allocate_slots(3, 2, 0).unwrap().unwrap();
    let t = m.block_table(3).unwrap();
    assert_eq!(&t[..3], &[0, 0, 0], "nothing claimed before the window");
    assert!(t[3] != 0 && t[4] != 0);
    m.check_invariants().unwrap();

    // A full-attention group beside it needs every block: the hit is gone.
    let mut m = grouped(17, 4, &[FULL, window(5)]);
    assert!(run(&mut m, 1, &prompt));
    m.free(1).unwrap();
    // The full group's blocks were freed last (evicted last); the window group's three
    // released ones and its two last ones go before them.
    assert!(run(&mut m, 2, &toks(100, 24)));
    assert_eq!(m.add_sequence(3, &probe, None, None).unwrap(), 0);
}

#[test]
fn the_hit_is_the_fixed_point_of_every_groups_longest_served_prefix() {
    // Groups: windows of 5 and 11, chunks of 8, blocks of 4 (no full-attention group,
    // whose first evicted block would end every hit). Cache a 33-token prompt, evict
    // more and more of it by pressure, and compare the hit with the rule tried at every
    // length over the cache the events describe.
    let bs = 4;
    let groups = [window(5), chunked(8), window(11)];
    let prompt = toks(0, 33);
    for pressure in 0..40 {
        let mut m = grouped(30, bs, &groups);
        let mut cached = CacheModel::default();
        assert!(run(&mut m, 1, &prompt));
        cached.apply(&m.take_events());
        m.free(1).unwrap();
        if pressure > 0 && run(&mut m, 2, &toks(1000, pressure)) {
            m.free(2).unwrap();
        }
        cached.apply(&m.take_events());
        let mut probe = prompt.clone();
        probe.push(7);
        let hit = m.add_sequence(3, &probe, None, None).unwrap();
        assert_eq!(
            hit,
            cached.hit(&groups, &probe, bs) * bs,
            "pressure {pressure}"
        );
        let n = probe.len() - hit;
        m.allocate_slots(3, n, 0).unwrap().unwrap();
        m.check_invariants().unwrap();
    }
}

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
    common::assert_fails_unchanged(
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
    let events = m.take_events();
    assert!(matches!(events[0], KvCacheEvent::AllBlocksCleared));
    let mut kept: Vec<(u32, GroupSpec)> = events[1..]
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
    assert_eq!(kept, vec![(0, FULL), (1, chunked(4))]);
    m.confirm_memory_ops();
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

/// The GPU prefix cache as the events describe it: cached copies per `(group, hash)`
/// (a recomputed block is one more copy, stored and removed on its own).
#[derive(Default)]
struct CacheModel {
    blocks: HashMap<(u32, BlockHash), usize>,
}

impl CacheModel {
    fn apply(&mut self, events: &[KvCacheEvent]) {
        for e in events {
            match e {
                KvCacheEvent::BlockStored(s) if s.medium == Medium::Gpu => {
                    for h in &s.block_hashes {
                        *self.blocks.entry((s.group_idx, *h)).or_default() += 1;
                    }
                }
                KvCacheEvent::BlockRemoved(r) if r.medium == Medium::Gpu => {
                    for h in &r.block_hashes {
                        let key = (r.group_idx, *h);
                        let copies = self.blocks.get_mut(&key).expect("removed a stored block");
                        *copies -= 1;
                        if *copies == 0 {
                            self.blocks.remove(&key);
                        }
                    }
                }
                KvCacheEvent::AllBlocksCleared => self.blocks.clear(),
                _ => {}
            }
        }
    }

    /// The longest hit of `prompt` by the rule, found by trying every length.
    fn hit(&self, groups: &[GroupSpec], prompt: &[u32], bs: usize) -> usize {
        let mut hasher = BlockHasher::new(HashAlgo::Blake3);
        let ns = hasher.namespace(None, None).unwrap();
        let mut hashes = Vec::new();
        hasher.extend_chain(&mut hashes, &ns, prompt, bs);
        let cap = (prompt.len() - 1) / bs;
        (0..=cap.min(hashes.len()))
            .rev()
            .find(|&n| {
                groups.iter().enumerate().all(|(g, spec)| {
                    // A recurrent group needs the state after n blocks: cached only on
                    // its checkpoint boundaries.
                    let boundary = spec.checkpoint_every_blocks().is_none_or(|k| n % k == 0);
                    let start = spec.released_blocks(n * bs, bs).min(n);
                    boundary
                        && hashes[start..n]
                            .iter()
                            .all(|h| self.blocks.contains_key(&(g as u32, *h)))
                })
            })
            .unwrap_or(0)
    }
}

fn arb_group() -> impl Strategy<Value = GroupSpec> {
    prop_oneof![
        Just(FULL),
        (1usize..10).prop_map(window),
        (1usize..10).prop_map(chunked),
        (1usize..4).prop_map(|k| GroupSpec::Recurrent {
            checkpoint_every_blocks: k
        }),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    /// Add a prompt of one of a few stems, cut and extended, and compute it whole.
    Run { stem: usize, cut: usize, extra: u32 },
    /// Decode `n` tokens on a held sequence.
    Decode { which: usize, n: usize },
    /// Free a held sequence.
    Free { which: usize },
    /// Fork a held sequence.
    Fork { which: usize },
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..3, 1usize..30, 0u32..3).prop_map(|(stem, cut, extra)| Op::Run {
            stem,
            cut,
            extra
        }),
        (0usize..8, 1usize..6).prop_map(|(which, n)| Op::Decode { which, n }),
        (0usize..8).prop_map(|which| Op::Free { which }),
        (0usize..8).prop_map(|which| Op::Fork { which }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Random operations over a manager of one to three groups: the invariants hold
    /// after each (per-group released entries exact, per-group counts, one group per
    /// block), every prompt's hit is the longest length the rule allows (brute force
    /// over the cache the events describe), and every group's table holds only what its
    /// next query sees.
    #[test]
    fn groups_keep_their_invariants_and_the_hit_rule(
        groups in prop::collection::vec(arb_group(), 1..4),
        bs in 1usize..5,
        num_blocks in 8usize..60,
        ops in prop::collection::vec(arb_op(), 1..40),
    ) {
        let mut m = grouped(num_blocks, bs, &groups);
        // Two stems share their first 12 tokens.
        let forked: Vec<u32> = toks(0, 12).into_iter().chain(toks(90, 28)).collect();
        let stems: [Vec<u32>; 3] = [toks(0, 40), forked, toks(200, 40)];
        let mut cache = CacheModel::default();
        let mut held_ids: Vec<u64> = Vec::new();
        let mut next = 0u64;
        for op in ops {
            match op {
                Op::Run { stem, cut, extra } => {
                    let mut prompt = stems[stem][..cut].to_vec();
                    prompt.push(300 + extra);
                    m.add_sequence(next, &prompt, None, None).unwrap();
                    cache.apply(&m.take_events());
                    let hit = m.num_computed_tokens(next).unwrap();
                    prop_assert_eq!(hit, cache.hit(&groups, &prompt, bs) * bs);
                    let n = prompt.len() - hit;
                    if m.allocate_slots(next, n, 0).unwrap().is_some() {
                        m.commit(next, n, &[]).unwrap();
                        held_ids.push(next);
                    } else {
                        m.free(next).unwrap();
                    }
                    next += 1;
                }
                Op::Decode { which, n } if !held_ids.is_empty() => {
                    let id = held_ids[which % held_ids.len()];
                    for t in 0..n {
                        m.commit(id, 0, &[400 + t as u32]).unwrap();
                        if m.allocate_slots(id, 1, 0).unwrap().is_none() {
                            break;
                        }
                        m.commit(id, 1, &[]).unwrap();
                    }
                }
                Op::Free { which } if !held_ids.is_empty() => {
                    let id = held_ids.remove(which % held_ids.len());
                    m.free(id).unwrap();
                }
                Op::Fork { which } if !held_ids.is_empty() => {
                    let id = held_ids[which % held_ids.len()];
                    m.fork(id, next).unwrap();
                    held_ids.push(next);
                    next += 1;
                }
                _ => {}
            }
            cache.apply(&m.take_events());
            m.check_invariants().unwrap();
            for &id in &held_ids {
                let c = m.num_computed_tokens(id).unwrap();
                for (g, spec) in groups.iter().enumerate() {
                    let t = m.group_block_table(id, g).unwrap();
                    let gone = spec.released_blocks(c, bs);
                    prop_assert!(t[..gone].iter().all(|&b| b == 0));
                    prop_assert!(t[gone..c.div_ceil(bs)].iter().all(|&b| b != 0));
                    if spec.is_recurrent() {
                        // One state, after the computed tokens, and nothing past it.
                        prop_assert!(t[c.div_ceil(bs)..].iter().all(|&b| b == 0));
                    }
                }
            }
        }
    }
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
