//! Recurrent-state groups: one state block per sequence, the states a step writes, the
//! checkpoint hit rule, copy-on-fork, swap, recompute, the host tier, events, and the
//! calls such a manager refuses.

mod common;

use common::{manager_with, toks};
use kvblocks_core::{GroupSpec, KVCacheManager, KvCacheEvent, KvError, MemoryOpKind, StateMapping};

const FULL: GroupSpec = GroupSpec::FullAttention;

fn recurrent(k: usize) -> GroupSpec {
    GroupSpec::Recurrent {
        checkpoint_every_blocks: k,
    }
}

fn grouped(num_blocks: usize, block_size: usize, groups: &[GroupSpec]) -> KVCacheManager {
    manager_with(num_blocks, block_size, |c| c.groups = groups.to_vec())
}

/// `(read block, [(tokens covered, block)])` of one sequence's pending step.
fn states(m: &KVCacheManager, id: u64, group: usize) -> (i64, Vec<(i64, i64)>) {
    let s: StateMapping = m.state_mapping(&[id], group).unwrap();
    assert_eq!(s.write_indptr, vec![0, s.write_blocks.len() as i64]);
    let writes = s
        .write_positions
        .iter()
        .copied()
        .zip(s.write_blocks.iter().copied())
        .collect();
    (s.read_blocks[0], writes)
}

/// Non-null entries of a group's table, as `(entry, block)`.
fn held(m: &KVCacheManager, id: u64, group: usize) -> Vec<(usize, i32)> {
    m.group_block_table(id, group)
        .unwrap()
        .into_iter()
        .enumerate()
        .filter(|&(_, b)| b != 0)
        .collect()
}

#[test]
fn a_step_writes_its_checkpoints_and_its_end_and_keeps_one_state() {
    // Blocks of 4 tokens, a state cached every 2 blocks (after 8, 16, ... tokens).
    let mut m = grouped(32, 4, &[FULL, recurrent(2)]);
    m.add_sequence(1, &toks(0, 21), None, None).unwrap();
    let got = m.allocate_slots(1, 18, 0).unwrap().unwrap();
    // 5 attention blocks, and 3 states: after 8, after 16, after 18 tokens.
    assert_eq!(got.len(), 5 + 3);
    let (read, writes) = states(&m, 1, 1);
    assert_eq!(read, -1, "no token computed: the initial state");
    let t = m.group_block_table(1, 1).unwrap();
    assert_eq!(
        writes,
        vec![(8, t[1] as i64), (16, t[3] as i64), (18, t[4] as i64)]
    );
    assert_eq!((t[0], t[2]), (0, 0), "no state is saved at 4 or 12 tokens");
    // The slot mapping of a state group maps nothing.
    assert!(m
        .group_slot_mapping(&[1], Some(18.into()), Some(1))
        .unwrap()
        .iter()
        .all(|&s| s == -1));
    m.check_invariants().unwrap();
    m.commit(1, 18, &[]).unwrap();
    m.check_invariants().unwrap();
    // One state held (after 18 tokens, entry 4); the two checkpoints are cached and free.
    assert_eq!(held(&m, 1, 1), vec![(4, t[4])]);
    assert_eq!(m.stats().num_cached_blocks_per_group, vec![4, 2]);
    assert_eq!(m.stats().num_used_blocks_per_group, vec![5, 1]);
    // The next step reads that state and updates it in place (same block).
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    assert_eq!(states(&m, 1, 1), (t[4] as i64, vec![(19, t[4] as i64)]));
    m.commit(1, 1, &[]).unwrap();
    // Crossing into block 5 (past 20 tokens) moves the state to a new block.
    m.allocate_slots(1, 2, 0).unwrap().unwrap();
    let t = m.group_block_table(1, 1).unwrap();
    assert_eq!(states(&m, 1, 1), (t[4] as i64, vec![(21, t[5] as i64)]));
    m.commit(1, 2, &[]).unwrap();
    assert_eq!(held(&m, 1, 1), vec![(5, t[5])]);
    m.check_invariants().unwrap();
}

#[test]
fn a_hit_ends_on_the_last_cached_checkpoint() {
    let mut m = grouped(64, 4, &[FULL, recurrent(3)]);
    let prompt = toks(0, 30);
    assert!(run(&mut m, 1, &prompt));
    let stored: Vec<(u32, usize, &str)> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvCacheEvent::BlockStored(s) => {
                Some((s.group_idx, s.block_hashes.len(), s.kv_cache_spec.kind()))
            }
            _ => None,
        })
        .collect();
    // Attention: 7 full blocks in one run; states at 12 and 24 tokens, one block each
    // (vLLM's "mamba" kind).
    assert_eq!(
        stored,
        vec![(0, 7, "full_attention"), (1, 1, "mamba"), (1, 1, "mamba")]
    );
    // Any prompt sharing 28 tokens hits only 24 (the state after 24 is cached; after 28
    // it is not).
    let mut other = prompt[..28].to_vec();
    other.extend([900, 901]);
    assert_eq!(m.add_sequence(2, &other, None, None).unwrap(), 24);
    // Sharing 23 tokens: back to 12.
    let mut short = prompt[..23].to_vec();
    short.push(900);
    assert_eq!(m.add_sequence(3, &short, None, None).unwrap(), 12);
    // The claim shares the cached state, which the step reads and never writes.
    m.allocate_slots(2, 6, 0).unwrap().unwrap();
    let t1 = m.group_block_table(1, 1).unwrap();
    let t2 = m.group_block_table(2, 1).unwrap();
    let (read, writes) = states(&m, 2, 1);
    assert_eq!(t2[..5], [0, 0, 0, 0, 0]);
    assert_ne!(t2[5], 0);
    assert_eq!(read, t2[5] as i64);
    assert!(writes.iter().all(|&(_, b)| b != read));
    assert_eq!(writes, vec![(30, t2[7] as i64)]);
    assert!(m.take_copy_on_writes().unwrap().is_empty());
    m.commit(2, 6, &[]).unwrap();
    // Sequence 1 still holds its own state; 2 released the claimed one back to the cache.
    assert_eq!(held(&m, 1, 1), vec![(7, t1[7])]);
    assert_eq!(held(&m, 2, 1), vec![(7, t2[7])]);
    m.check_invariants().unwrap();
}

#[test]
fn an_evicted_checkpoint_shortens_the_hit_and_a_full_group_too() {
    let mut m = grouped(64, 2, &[FULL, recurrent(1)]);
    let prompt = toks(0, 9);
    assert!(run(&mut m, 1, &prompt));
    m.free(1).unwrap();
    let mut probe = prompt[..8].to_vec();
    probe.push(50);
    // Every boundary's state is cached (k = 1): the whole 8 tokens hit.
    assert_eq!(m.add_sequence(2, &probe, None, None).unwrap(), 8);
    m.free(2).unwrap();
    // A manager whose states are cached every 4 blocks hits 8 only, never 6.
    let mut m = grouped(64, 2, &[FULL, recurrent(4)]);
    assert!(run(&mut m, 1, &toks(0, 7)));
    m.free(1).unwrap();
    let mut probe = toks(0, 7);
    probe.push(60);
    assert_eq!(m.add_sequence(2, &probe, None, None).unwrap(), 0);
}

#[test]
fn a_fork_copies_the_state_it_shares_before_writing_it() {
    let mut m = grouped(32, 4, &[FULL, recurrent(2)]);
    assert!(run(&mut m, 1, &toks(0, 6)));
    m.fork(1, 2).unwrap();
    let parent = m.group_block_table(1, 1).unwrap();
    assert_eq!(m.group_block_table(2, 1).unwrap(), parent);
    for id in [1, 2] {
        m.commit(id, 0, &[70 + id as u32]).unwrap();
    }
    // The child's next step updates the shared state in place: a copy first, in every
    // group (the attention group's last block is shared too).
    m.allocate_slots(2, 1, 0).unwrap().unwrap();
    let copies = m.take_copy_on_writes().unwrap();
    let child = m.group_block_table(2, 1).unwrap();
    assert!(copies.contains(&[parent[1] as i64, child[1] as i64]));
    assert_ne!(child[1], parent[1]);
    assert_eq!(
        states(&m, 2, 1),
        (child[1] as i64, vec![(7, child[1] as i64)])
    );
    m.commit(2, 1, &[]).unwrap();
    // The parent's state is its own again: no copy for its step.
    m.allocate_slots(1, 1, 0).unwrap().unwrap();
    let copies = m.take_copy_on_writes().unwrap();
    assert!(copies.iter().all(|c| c[0] != parent[1] as i64));
    assert_eq!(
        states(&m, 1, 1),
        (parent[1] as i64, vec![(7, parent[1] as i64)])
    );
    m.commit(1, 1, &[]).unwrap();
    m.check_invariants().unwrap();
    // A fork at a block boundary shares the (read-only) state: the step writes a new one.
    assert!(run(&mut m, 3, &toks(40, 8)));
    m.fork(3, 4).unwrap();
    m.commit(4, 0, &[9]).unwrap();
    m.allocate_slots(4, 1, 0).unwrap().unwrap();
    assert!(m.take_copy_on_writes().unwrap().is_empty());
    let t3 = m.group_block_table(3, 1).unwrap();
    let t4 = m.group_block_table(4, 1).unwrap();
    assert_eq!(states(&m, 4, 1), (t3[1] as i64, vec![(9, t4[2] as i64)]));
    m.check_invariants().unwrap();
}

#[test]
fn swap_moves_the_one_state_and_free_releases_it() {
    let mut m = manager_with(32, 4, |c| {
        c.groups = vec![FULL, recurrent(2)];
        c.num_cpu_blocks = 8;
    });
    assert!(run(&mut m, 1, &toks(0, 10)));
    let state = m.group_block_table(1, 1).unwrap();
    let out = m.swap_out(&[1]).unwrap();
    // 3 attention blocks, 1 state.
    assert_eq!(out.len(), 4);
    assert!(out.iter().any(|r| r[0] == state[2] as i64));
    m.check_invariants().unwrap();
    let back = m.swap_in(&[1]).unwrap();
    assert_eq!(back.len(), 4);
    let t = m.group_block_table(1, 1).unwrap();
    assert_eq!(t.iter().filter(|&&b| b != 0).count(), 1);
    assert_ne!(t[2], 0);
    m.check_invariants().unwrap();
    // Freed while swapped: its CPU blocks (one of them the state) go back.
    m.swap_out(&[1]).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_free_cpu_blocks(), 8);
    m.check_invariants().unwrap();
}

#[test]
fn a_commit_of_nothing_drops_the_steps_states_and_keeps_the_old_one() {
    let mut m = grouped(32, 4, &[FULL, recurrent(1)]);
    m.add_sequence(1, &toks(0, 14), None, None).unwrap();
    m.allocate_slots(1, 5, 0).unwrap().unwrap();
    m.commit(1, 5, &[]).unwrap();
    let before = m.group_block_table(1, 1).unwrap();
    let free = m.num_free_blocks();
    // A step reserved and not run (the scheduler preempted it): nothing computed.
    m.allocate_slots(1, 9, 0).unwrap().unwrap();
    m.commit(1, 0, &[]).unwrap();
    m.check_invariants().unwrap();
    let after = m.group_block_table(1, 1).unwrap();
    assert_eq!(after.iter().filter(|&&b| b != 0).count(), 1);
    assert_eq!(after[1], before[1]);
    // The attention group keeps its spare blocks (3 more entries); the states went back.
    assert_eq!(m.num_free_blocks(), free - 2);
    // The next step fills the state entries it needs among the spare entries.
    m.allocate_slots(1, 9, 0).unwrap().unwrap();
    let (read, writes) = states(&m, 1, 1);
    assert_eq!(read, before[1] as i64);
    assert_eq!(
        writes.iter().map(|w| w.0).collect::<Vec<_>>(),
        vec![8, 12, 14]
    );
    m.commit(1, 9, &[]).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn lookahead_partial_commits_and_non_state_groups_are_refused() {
    let mut m = grouped(32, 4, &[FULL, recurrent(2)]);
    m.add_sequence(1, &toks(0, 10), None, None).unwrap();
    let arg = |e: &KvError| matches!(e, KvError::InvalidArgument(_));
    common::assert_fails_unchanged(&mut m, |m| m.allocate_slots(1, 4, 2), arg);
    common::assert_fails_unchanged(&mut m, |m| m.can_allocate(1, 1), arg);
    common::assert_fails_unchanged(&mut m, |m| m.allocate_slots_batch(&[1], 4.into(), 1), arg);
    m.allocate_slots(1, 6, 0).unwrap().unwrap();
    common::assert_fails_unchanged(&mut m, |m| m.commit(1, 3, &[]), arg);
    common::assert_fails_unchanged(&mut m, |m| m.state_mapping(&[1], 0), arg);
    common::assert_fails_unchanged(&mut m, |m| m.state_mapping(&[1], 2), arg);
    common::assert_fails_unchanged(
        &mut m,
        |m| m.state_mapping(&[7], 1),
        |e| matches!(e, KvError::UnknownSequence(7)),
    );
    m.commit(1, 6, &[]).unwrap();
    m.check_invariants().unwrap();
    // A manager without a state group still takes lookahead and partial commits.
    let mut plain = grouped(32, 4, &[FULL]);
    plain.add_sequence(1, &toks(0, 10), None, None).unwrap();
    plain.allocate_slots(1, 6, 2).unwrap().unwrap();
    plain.commit(1, 3, &[]).unwrap();
}

#[test]
fn admission_counts_the_claimed_state_and_the_states_one_step_writes() {
    // 1 full group and a state every block: a 9-token prompt computed in one step needs
    // 3 attention blocks and 3 states (after 4, 8 and 9 tokens).
    let mut m = grouped(7, 4, &[FULL, recurrent(1)]);
    m.add_sequence(1, &toks(0, 9), None, None).unwrap();
    assert_eq!(
        m.can_allocate(1, 0).unwrap(),
        kvblocks_core::AllocStatus::Ok
    );
    let got = m.allocate_slots(1, 9, 0).unwrap().unwrap();
    assert_eq!(got.len(), 6);
    m.commit(1, 9, &[]).unwrap();
    // 3 + 1 held of 6: the 2 free ones are the cached states after 4 and 8 tokens.
    assert_eq!(m.num_free_blocks(), 2);
    assert_eq!(m.stats().num_cached_blocks_per_group, vec![2, 2]);
    let mut m = grouped(6, 4, &[FULL, recurrent(1)]);
    m.add_sequence(1, &toks(0, 9), None, None).unwrap();
    assert_eq!(
        m.can_allocate(1, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
}

/// A first step from position 0 reads no state: a 2-token prompt computed in one step
/// holds 2 chunk blocks, 2 states of the every-block group and 1 of the every-2-blocks
/// group (5 blocks, the usable pool), while one token a step holds an input and an
/// output state of both recurrent groups at the second token (6). `can_allocate_step`
/// said `Never` for the whole step, judging it by the one-a-step peak, and the scheduler
/// refused the prompt.
#[test]
fn a_step_from_position_0_is_not_refused_for_the_states_one_a_step_would_hold() {
    let chunked = GroupSpec::ChunkedLocalAttention { chunk: 3 };
    let mut m = manager_with(6, 1, |c| {
        c.groups = vec![chunked, recurrent(1), recurrent(2)];
        c.watermark = 0.0;
    });
    m.add_sequence(1, &toks(0, 2), None, None).unwrap();
    assert_eq!(
        m.can_allocate_step(1, 2, 0).unwrap(),
        kvblocks_core::AllocStatus::Ok
    );
    // One token first: the second then holds 2 + 2 + 2 > 5 whatever follows.
    assert_eq!(
        m.can_allocate_step(1, 1, 0).unwrap(),
        kvblocks_core::AllocStatus::Never
    );
    assert_eq!(m.allocate_slots(1, 2, 0).unwrap().unwrap().len(), 5);
    m.commit(1, 2, &[]).unwrap();
    m.check_invariants().unwrap();
    // And one token a step indeed stalls at the second token.
    let mut m = manager_with(6, 1, |c| {
        c.groups = vec![chunked, recurrent(1), recurrent(2)];
        c.watermark = 0.0;
    });
    m.add_sequence(1, &toks(0, 2), None, None).unwrap();
    assert!(m.allocate_slots(1, 1, 0).unwrap().is_some());
    m.commit(1, 1, &[]).unwrap();
    assert!(m.allocate_slots(1, 1, 0).unwrap().is_none());
}

#[test]
fn a_state_goes_to_the_host_tier_and_comes_back_as_a_hit() {
    let mut m = manager_with(13, 2, |c| {
        c.groups = vec![FULL, recurrent(2)];
        c.host_cache_blocks = 16;
    });
    let prompt = toks(0, 8);
    assert!(run(&mut m, 1, &prompt));
    m.free(1).unwrap();
    // Another prompt takes the pool: every cached block and state is offloaded.
    assert!(run(&mut m, 2, &toks(100, 16)));
    m.free(2).unwrap();
    m.take_memory_ops();
    m.confirm_memory_ops();
    let mut probe = prompt.clone();
    probe.push(1);
    assert_eq!(m.add_sequence(3, &probe, None, None).unwrap(), 8);
    m.allocate_slots(3, 1, 0).unwrap().unwrap();
    let loads: Vec<_> = m
        .take_memory_ops()
        .into_iter()
        .filter(|o| o.kind == MemoryOpKind::Load)
        .collect();
    // 4 attention blocks and the state after 8 tokens.
    assert_eq!(loads.len(), 5);
    let state = m.group_block_table(3, 1).unwrap()[3];
    assert!(loads.iter().any(|o| o.dst == state as i64));
    assert_eq!(states(&m, 3, 1).0, state as i64);
    m.check_invariants().unwrap();
}

#[test]
fn blocks_in_flight_count_up_to_a_checkpoint_only() {
    let mut m = grouped(64, 2, &[FULL, recurrent(3)]);
    // Sequence 1 computes 10 prompt tokens (5 blocks; checkpoints after 6 and 12).
    m.add_sequence(1, &toks(0, 11), None, None).unwrap();
    m.allocate_slots(1, 10, 0).unwrap().unwrap();
    let mut twin = toks(0, 11);
    twin.push(99);
    m.add_sequence(2, &twin, None, None).unwrap();
    // 5 blocks in flight, but a hit must end on a cached state: 3 blocks.
    assert_eq!(m.probe_in_flight(&[2]).unwrap(), vec![6]);
    m.commit(1, 10, &[]).unwrap();
    assert_eq!(m.refresh_prefixes(&[2]).unwrap(), vec![6]);
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
