//! `sync_block_table`: a persistent table kept by incremental writes must always equal
//! the sequences' tables, and its delta must patch a mirror copy to the same content.

mod common;

use common::{assert_fails_unchanged, manager, manager_with, toks};
use kvblocks_core::{BlockTableDelta, KVCacheManager, KvError};
use proptest::prelude::*;

/// Add a sequence and compute its prompt, sampling one token (so it can decode).
fn prefill(m: &mut KVCacheManager, id: u64, prompt: &[u32]) -> bool {
    m.add_sequence(id, prompt, None, None).unwrap();
    let n = prompt.len() - m.num_computed_tokens(id).unwrap();
    if m.allocate_slots(id, n, 0).unwrap().is_none() {
        m.free(id).unwrap();
        return false;
    }
    m.commit(id, n, &[999]).unwrap();
    true
}

/// A caller-kept table plus a mirror patched only through the deltas.
struct Table {
    rows: usize,
    cols: usize,
    buf: Vec<i32>,
    mirror: Vec<i32>,
}

impl Table {
    fn new(rows: usize, cols: usize) -> Self {
        Table {
            rows,
            cols,
            buf: vec![0; rows * cols],
            mirror: vec![0; rows * cols],
        }
    }

    fn sync(
        &mut self,
        m: &mut KVCacheManager,
        ids: &[u64],
        rows: &[i64],
    ) -> Result<BlockTableDelta, KvError> {
        let d = m.sync_block_table(ids, rows, self.rows, self.cols, Some(&mut self.buf), false)?;
        self.apply(&d);
        Ok(d)
    }

    /// What an engine does with a delta on its device copy (written out here rather
    /// than through `BlockTableDelta::apply`, which the buffer path uses).
    fn apply(&mut self, d: &BlockTableDelta) {
        for k in 0..d.len() {
            let base = d.rows[k] as usize * self.cols;
            let ids = &d.block_ids[d.indptr[k] as usize..d.indptr[k + 1] as usize];
            let start = d.start_cols[k] as usize;
            if d.reset[k] {
                self.mirror[base..base + self.cols].fill(0);
            }
            self.mirror[base + start..base + start + ids.len()].copy_from_slice(ids);
        }
    }

    fn row(&self, r: usize) -> &[i32] {
        &self.buf[r * self.cols..(r + 1) * self.cols]
    }

    /// Every listed row equals its sequence's table padded with the null block.
    fn check(&self, m: &KVCacheManager, ids: &[u64], rows: &[i64]) {
        assert_eq!(
            self.buf, self.mirror,
            "delta mirror diverged from the buffer"
        );
        for (&id, &r) in ids.iter().zip(rows) {
            let mut want = m.block_table(id).unwrap();
            want.resize(self.cols, 0);
            assert_eq!(self.row(r as usize), &want[..], "row {r} of sequence {id}");
        }
    }
}

#[test]
fn appends_are_written_alone_and_consume_the_change() {
    let mut m = manager(64, 4);
    prefill(&mut m, 1, &toks(0, 10));
    let mut t = Table::new(4, 8);
    let d = t.sync(&mut m, &[1], &[2]).unwrap();
    assert_eq!(
        (d.rows.clone(), d.start_cols.clone(), d.reset.clone()),
        (vec![2], vec![0], vec![true])
    );
    assert_eq!(d.block_ids.len(), 3);
    t.check(&m, &[1], &[2]);
    // Nothing changed: nothing written.
    assert!(t.sync(&mut m, &[1], &[2]).unwrap().is_empty());
    // Two decode steps fill block 2 and open block 3: only the new entry is written.
    for tok in [100, 101, 102] {
        m.allocate_slots(1, 1, 0).unwrap().unwrap();
        m.commit(1, 1, &[tok]).unwrap();
    }
    let d = t.sync(&mut m, &[1], &[2]).unwrap();
    assert_eq!(
        (d.start_cols.clone(), d.reset.clone()),
        (vec![3], vec![false])
    );
    assert_eq!(d.block_ids, vec![m.block_table(1).unwrap()[3]]);
    t.check(&m, &[1], &[2]);
}

#[test]
fn a_new_row_or_a_row_reused_by_another_sequence_is_written_whole() {
    let mut m = manager(64, 4);
    prefill(&mut m, 1, &toks(0, 10));
    prefill(&mut m, 2, &toks(50, 6));
    let mut t = Table::new(4, 8);
    t.sync(&mut m, &[1], &[0]).unwrap();
    // Sequence 2 takes row 0; sequence 1 comes back to row 0 and must be written whole.
    t.sync(&mut m, &[2], &[0]).unwrap();
    let d = t.sync(&mut m, &[1], &[0]).unwrap();
    assert_eq!(d.reset, vec![true]);
    t.check(&m, &[1], &[0]);
    // Moving to another row writes it whole, and coming back too.
    assert_eq!(t.sync(&mut m, &[1], &[3]).unwrap().reset, vec![true]);
    assert_eq!(t.sync(&mut m, &[1], &[0]).unwrap().reset, vec![true]);
    t.check(&m, &[1], &[0]);
    // full = true rewrites even an up-to-date row.
    let d = m.sync_block_table(&[1], &[0], 4, 8, None, true).unwrap();
    assert_eq!(d.reset, vec![true]);
}

#[test]
fn copy_on_write_window_release_and_swap_in_rewrite_entries() {
    // CoW after a fork replaces the shared last block.
    let mut m = manager(64, 4);
    prefill(&mut m, 1, &toks(0, 10));
    let mut t = Table::new(4, 8);
    t.sync(&mut m, &[1], &[0]).unwrap();
    m.fork(1, 2).unwrap();
    m.allocate_slots(1, 0, 1).unwrap().unwrap();
    let d = t.sync(&mut m, &[1, 2], &[0, 1]).unwrap();
    assert_eq!(d.start_cols, vec![2, 0]);
    t.check(&m, &[1, 2], &[0, 1]);

    // Sliding window: released leading entries become the null block.
    let mut m = manager_with(64, 4, |c| c.sliding_window = Some(4));
    prefill(&mut m, 1, &toks(0, 6));
    let mut t = Table::new(2, 8);
    t.sync(&mut m, &[1], &[1]).unwrap();
    for tok in 0..6 {
        m.allocate_slots(1, 1, 0).unwrap().unwrap();
        m.commit(1, 1, &[tok]).unwrap();
    }
    let d = t.sync(&mut m, &[1], &[1]).unwrap();
    assert_eq!(d.start_cols, vec![0]);
    assert_eq!(t.row(1)[0], 0);
    t.check(&m, &[1], &[1]);

    // Swap out and in: new GPU ids, same row.
    let mut m = manager_with(64, 4, |c| c.num_cpu_blocks = 16);
    prefill(&mut m, 1, &toks(0, 10));
    prefill(&mut m, 2, &toks(20, 10));
    let mut t = Table::new(2, 8);
    t.sync(&mut m, &[1, 2], &[0, 1]).unwrap();
    m.swap_out(&[1]).unwrap();
    m.free(2).unwrap();
    prefill(&mut m, 3, &toks(40, 12)); // takes the GPU blocks sequence 1 had
    m.swap_in(&[1]).unwrap();
    let d = t.sync(&mut m, &[1, 3], &[0, 1]).unwrap();
    assert_eq!(d.reset, vec![false, true]);
    t.check(&m, &[1, 3], &[0, 1]);
}

#[test]
fn bad_calls_fail_and_change_nothing() {
    let mut m = manager_with(64, 4, |c| c.num_cpu_blocks = 16);
    prefill(&mut m, 1, &toks(0, 10));
    prefill(&mut m, 2, &toks(20, 10));
    let mut buf = vec![7i32; 4 * 8];
    let is_arg = |e: &KvError| matches!(e, KvError::InvalidArgument(_));
    // (seq ids, rows, num_rows, num_cols, buffer length)
    type Case = (Vec<u64>, Vec<i64>, usize, usize, usize);
    let cases: Vec<Case> = vec![
        (vec![1, 2], vec![0], 4, 8, 32),    // lengths differ
        (vec![1], vec![4], 4, 8, 32),       // row out of range
        (vec![1], vec![-1], 4, 8, 32),      // negative row
        (vec![1, 2], vec![1, 1], 4, 8, 32), // duplicate row
        (vec![1, 1], vec![0, 1], 4, 8, 32), // duplicate sequence
        (vec![1], vec![0], 4, 2, 8),        // too narrow
        (vec![1], vec![0], 4, 8, 31),       // buffer size
    ];
    for (ids, rows, nr, nc, len) in cases {
        assert_fails_unchanged(
            &mut m,
            |m| m.sync_block_table(&ids, &rows, nr, nc, Some(&mut buf[..len]), false),
            is_arg,
        );
        assert!(
            buf.iter().all(|&x| x == 7),
            "a failing call wrote the buffer"
        );
    }
    assert_fails_unchanged(
        &mut m,
        |m| m.sync_block_table(&[9], &[0], 4, 8, Some(&mut buf), false),
        |e| matches!(e, KvError::UnknownSequence(9)),
    );
    m.swap_out(&[2]).unwrap();
    assert_fails_unchanged(
        &mut m,
        |m| m.sync_block_table(&[1, 2], &[0, 1], 4, 8, Some(&mut buf), false),
        |e| matches!(e, KvError::SequenceState(_)),
    );
    assert!(buf.iter().all(|&x| x == 7));
    // A huge, sparse table (delta only): far-apart rows are fine, repeats are not, and
    // rows past int32 are refused.
    assert_fails_unchanged(
        &mut m,
        |m| m.sync_block_table(&[1, 2], &[1 << 30, 1 << 30], usize::MAX, 8, None, false),
        is_arg,
    );
    assert_fails_unchanged(
        &mut m,
        |m| m.sync_block_table(&[1], &[1 << 31], usize::MAX, 8, None, false),
        is_arg,
    );
    m.sync_block_table(&[1], &[1 << 30], usize::MAX, 8, None, false)
        .unwrap();
    // A zero-width table with empty tables is fine.
    m.add_sequence(5, &toks(0, 3), None, None).unwrap();
    let d = m
        .sync_block_table(&[5], &[0], 1, 0, Some(&mut []), false)
        .unwrap();
    assert_eq!(d.reset, vec![true]);
}

#[test]
fn apply_rejects_a_delta_that_does_not_fit() {
    let d = BlockTableDelta {
        rows: vec![1],
        start_cols: vec![2],
        indptr: vec![0, 2],
        block_ids: vec![5, 6],
        reset: vec![false],
    };
    let mut t = vec![0i32; 8];
    assert!(d.apply(&mut t, 2, 3).is_err()); // 2 + 2 ids past 3 columns
    assert!(d.apply(&mut t, 1, 8).is_err()); // row 1 of 1
    assert!(d.apply(&mut t, 3, 3).is_err()); // wrong length
    assert!(t.iter().all(|&x| x == 0));
    d.apply(&mut t, 2, 4).unwrap();
    assert_eq!(t, vec![0, 0, 0, 0, 0, 0, 5, 6]);
}

/// One random operation on a small manager.
#[derive(Debug, Clone)]
enum Op {
    Add(u32),
    Decode(u8, u8),
    Fork(u8),
    Free(u8),
    SwapOut(u8),
    SwapIn(u8),
    Move(u8, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u32..30).prop_map(Op::Add),
        (any::<u8>(), 0u8..3).prop_map(|(s, l)| Op::Decode(s, l)),
        any::<u8>().prop_map(Op::Fork),
        any::<u8>().prop_map(Op::Free),
        any::<u8>().prop_map(Op::SwapOut),
        any::<u8>().prop_map(Op::SwapIn),
        (any::<u8>(), any::<u8>()).prop_map(|(s, r)| Op::Move(s, r)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_ops_keep_the_synced_table_equal_to_the_tables(
        ops in proptest::collection::vec(op(), 1..60),
        window in prop_oneof![Just(None), Just(Some(6usize))],
    ) {
        const ROWS: usize = 8;
        let mut m = manager_with(40, 4, |c| {
            c.num_cpu_blocks = 40;
            c.sliding_window = window;
            c.enable_prefix_caching = true;
        });
        let mut t = Table::new(ROWS, 64);
        // seq id -> row (None while swapped out); rows are reused freely.
        let mut live: Vec<(u64, Option<i64>)> = Vec::new();
        let mut next_id = 0u64;
        let mut next_row = 0i64;
        for op in ops {
            let pick = |k: u8, n: usize| (k as usize) % n.max(1);
            match op {
                Op::Add(len) => {
                    if live.len() >= ROWS { continue; }
                    let id = next_id;
                    next_id += 1;
                    if !prefill(&mut m, id, &toks(id as u32 % 3 * 7, len as usize)) {
                        continue;
                    }
                    next_row = (next_row + 3) % ROWS as i64;
                    live.push((id, Some(next_row)));
                }
                Op::Decode(k, look) if !live.is_empty() => {
                    let (id, row) = live[pick(k, live.len())];
                    if row.is_none() { continue; }
                    if m.allocate_slots(id, 1, look as usize).unwrap().is_some() {
                        m.commit(id, 1, &[k as u32]).unwrap();
                    }
                }
                Op::Fork(k) if !live.is_empty() && live.len() < ROWS => {
                    let (id, row) = live[pick(k, live.len())];
                    if row.is_none() { continue; }
                    let child = next_id;
                    next_id += 1;
                    m.fork(id, child).unwrap();
                    next_row = (next_row + 5) % ROWS as i64;
                    live.push((child, Some(next_row)));
                }
                Op::Free(k) if !live.is_empty() => {
                    let (id, _) = live.swap_remove(pick(k, live.len()));
                    m.free(id).unwrap();
                }
                Op::SwapOut(k) if !live.is_empty() => {
                    let i = pick(k, live.len());
                    if live[i].1.is_some() && m.can_swap_out(&[live[i].0]).unwrap() {
                        m.swap_out(&[live[i].0]).unwrap();
                        live[i].1 = None;
                    }
                }
                Op::SwapIn(k) if !live.is_empty() => {
                    let i = pick(k, live.len());
                    if live[i].1.is_none() && m.can_swap_in(&[live[i].0]).unwrap() {
                        m.swap_in(&[live[i].0]).unwrap();
                        live[i].1 = Some(k as i64 % ROWS as i64);
                    }
                }
                Op::Move(k, r) if !live.is_empty() => {
                    let i = pick(k, live.len());
                    if live[i].1.is_some() {
                        live[i].1 = Some(r as i64 % ROWS as i64);
                    }
                }
                _ => continue,
            }
            m.check_invariants().unwrap();
            // Resolve row clashes the way a row allocator would: the later one moves.
            let mut used = [false; ROWS];
            for entry in live.iter_mut() {
                if let Some(r) = entry.1 {
                    let mut r = r as usize;
                    while used[r] { r = (r + 1) % ROWS; }
                    used[r] = true;
                    entry.1 = Some(r as i64);
                }
            }
            // Sync a subset (the "scheduled" sequences) each step; the rest wait.
            let sched: Vec<(u64, i64)> = live
                .iter()
                .filter_map(|&(id, r)| r.map(|r| (id, r)))
                .filter(|&(id, _)| (id + next_id) % 3 != 0)
                .collect();
            let ids: Vec<u64> = sched.iter().map(|s| s.0).collect();
            let rows: Vec<i64> = sched.iter().map(|s| s.1).collect();
            t.sync(&mut m, &ids, &rows).unwrap();
            t.check(&m, &ids, &rows);
        }
    }
}
