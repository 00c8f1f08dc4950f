//! KV cache groups: per-group tables over one pool, the footprint of window and chunked
//! groups, the hit rule (a fixed point over the groups), checked by random operations.
//! (Every other feature per group is in `group_features.rs`; recurrent-state groups have
//! their own file, `recurrent.rs`; the random operations here mix them in.)

#[path = "../common/mod.rs"]
mod common;
mod group_features;

use std::collections::HashMap;

use common::groups::{chunked, grouped, held, run, window, FULL};
use common::{manager_with, toks};
use kvblocks_core::{
    BlockHash, BlockHasher, GroupSpec, HashAlgo, KVCacheManager, KvCacheEvent, KvError, Medium,
};
use proptest::prelude::*;

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
