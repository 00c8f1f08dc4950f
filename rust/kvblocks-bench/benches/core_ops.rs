//! Criterion benches of the core's hot operations (short measurement windows).
//!
//! `cargo bench -p kvblocks-bench` — groups:
//! * `alloc_free`: allocate a 16-block sequence and free it.
//! * `prefix_lookup_32k`: add a 32k-token prompt that is fully cached (hash + probe) and
//!   claim it, per hash algorithm.
//! * `hash_32k`: hashing throughput of a 32k-token chain per algorithm.
//! * `fork_cow`: fork a sequence and write one token into the shared last block.
//! * `decode_step_1024`: one decode step for 1,024 sequences (allocate_slots_batch +
//!   commit_batch + block_tables + slot_mapping).
//! * `host_tier_1024`: the decode step of 1,024 sequences in a pool whose free blocks are
//!   all cached, so every new block evicts one: without a host tier (`off`), offloading
//!   at eviction (`evict`) and write-through at commit (`commit`); the tier runs drain
//!   the step's memory ops and confirm them (timed).
//! * `decode_step_groups_1024`: the caching decode step over KV cache groups: one
//!   full-attention group (`one_group`, today's manager) against full attention plus a
//!   128-token sliding window (`two_groups`, gpt-oss-shaped), the block tables and slot
//!   mappings of every group in one call each (`group_block_tables`,
//!   `group_slot_mapping`), measured side by side.
//! * `decode_step_table`: the same step with 1,024 sequences of 32k (and of 128) tokens,
//!   the block tables either rebuilt (`block_tables`, the old way) or kept in a persistent
//!   table (`sync_block_table`, only changed entries written), measured side by side.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvblocks_core::{
    BatchArg, BlockHasher, GroupSpec, HashAlgo, KVCacheManager, ManagerConfig, OffloadPolicy,
};

const BLOCK_SIZE: usize = 16;

fn manager(num_blocks: usize, caching: bool, algo: HashAlgo) -> KVCacheManager {
    let mut c = ManagerConfig::new(num_blocks, BLOCK_SIZE);
    c.enable_prefix_caching = caching;
    c.hash_algo = algo;
    KVCacheManager::new(c).expect("valid config")
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 128_000)
        .collect()
}

fn bench_alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free");
    g.throughput(Throughput::Elements(16));
    let tokens = prompt(1, 16 * BLOCK_SIZE);
    for caching in [false, true] {
        let mut m = manager(4096, caching, HashAlgo::Blake3);
        g.bench_function(
            BenchmarkId::new("16_blocks", if caching { "caching" } else { "no_cache" }),
            |b| {
                b.iter(|| {
                    m.add_sequence(1, &tokens, None, None).unwrap();
                    let got = m.allocate_slots(1, tokens.len(), 0).unwrap();
                    black_box(got);
                    m.free(1).unwrap();
                })
            },
        );
    }
    g.finish();
}

fn bench_prefix_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_lookup_32k");
    let len = 32 * 1024;
    g.throughput(Throughput::Elements(len as u64));
    let tokens = prompt(7, len);
    for algo in [HashAlgo::Blake3, HashAlgo::Xxh3_128, HashAlgo::Sha256Cbor] {
        let mut m = manager(len / BLOCK_SIZE + 64, true, algo);
        // Cache the prompt once: prefill and commit, keep it referenced.
        m.add_sequence(0, &tokens, None, None).unwrap();
        m.allocate_slots(0, len, 0).unwrap().unwrap();
        m.commit(0, len, &[]).unwrap();
        g.bench_function(BenchmarkId::new("add_probe", algo.as_str()), |b| {
            b.iter(|| {
                let hit = m.add_sequence(1, &tokens, None, None).unwrap();
                black_box(hit);
                m.free(1).unwrap();
            })
        });
        g.bench_function(BenchmarkId::new("add_claim_free", algo.as_str()), |b| {
            b.iter(|| {
                let hit = m.add_sequence(1, &tokens, None, None).unwrap();
                let got = m.allocate_slots(1, len - hit, 0).unwrap();
                black_box(got);
                m.free(1).unwrap();
            })
        });
    }
    g.finish();
}

fn bench_hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash_32k");
    let len = 32 * 1024;
    g.throughput(Throughput::Bytes((len * 4) as u64));
    let tokens = prompt(3, len);
    for algo in [HashAlgo::Blake3, HashAlgo::Xxh3_128, HashAlgo::Sha256Cbor] {
        let mut h = BlockHasher::new(algo);
        let ns = h.namespace(None, None).unwrap();
        let mut chain = Vec::with_capacity(len / BLOCK_SIZE);
        g.bench_function(BenchmarkId::new("chain", algo.as_str()), |b| {
            b.iter(|| {
                chain.clear();
                h.extend_chain(&mut chain, &ns, &tokens, BLOCK_SIZE);
                black_box(&chain);
            })
        });
    }
    g.finish();
}

fn bench_fork_cow(c: &mut Criterion) {
    let mut g = c.benchmark_group("fork_cow");
    let mut m = manager(1024, true, HashAlgo::Blake3);
    let tokens = prompt(5, 8 * BLOCK_SIZE + 3);
    m.add_sequence(0, &tokens, None, None).unwrap();
    m.allocate_slots(0, tokens.len(), 0).unwrap().unwrap();
    m.commit(0, tokens.len(), &[]).unwrap();
    g.bench_function("fork_write_free", |b| {
        b.iter(|| {
            m.fork(0, 1).unwrap();
            m.commit(1, 0, &[42]).unwrap();
            let got = m.allocate_slots(1, 1, 0).unwrap();
            black_box(got);
            black_box(m.take_copy_on_writes().unwrap());
            m.commit(1, 1, &[]).unwrap();
            m.free(1).unwrap();
        })
    });
    g.finish();
}

/// 1,024 running sequences with 512-token prompts, ready to decode.
fn decode_state(caching: bool) -> (KVCacheManager, Vec<u64>) {
    let n = 1024;
    let mut m = manager(n * 128 + 1, caching, HashAlgo::Blake3);
    let ids: Vec<u64> = (0..n as u64).collect();
    for &id in &ids {
        let t = prompt(id as u32, 512);
        m.add_sequence(id, &t, None, None).unwrap();
        m.allocate_slots(id, t.len(), 0).unwrap().unwrap();
        m.commit(id, t.len(), &[1]).unwrap();
    }
    (m, ids)
}

fn bench_decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_1024");
    g.throughput(Throughput::Elements(1024));
    for caching in [false, true] {
        let name = if caching { "caching" } else { "no_cache" };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut state = decode_state(caching);
                let mut steps = 0;
                let new_tokens = vec![7i64; 1024];
                for _ in 0..iters {
                    if steps == 1024 {
                        // Sequences have grown by 1,024 tokens: start over, untimed.
                        state = decode_state(caching);
                        steps = 0;
                    }
                    let (m, ids) = &mut state;
                    let start = Instant::now();
                    let served = m
                        .allocate_slots_batch(ids, BatchArg::Scalar(1), 0)
                        .unwrap()
                        .num_served;
                    let tables = m.block_tables(ids, None).unwrap();
                    let slots = m.slot_mapping(ids, None).unwrap();
                    m.commit_batch(ids, BatchArg::Scalar(1), Some(BatchArg::Each(&new_tokens)))
                        .unwrap();
                    total += start.elapsed();
                    // A router drains events every step; without that they pile up.
                    black_box(m.take_events());
                    assert_eq!(served, ids.len());
                    black_box((tables, slots));
                    steps += 1;
                }
                total
            })
        });
    }
    g.finish();
}

/// 1,024 running sequences with 512-token prompts over `groups`, ready to decode.
fn group_decode_state(groups: &[GroupSpec]) -> (KVCacheManager, Vec<u64>) {
    let n = 1024;
    let mut c = ManagerConfig::new(groups.len() * n * 128 + 1, BLOCK_SIZE);
    c.groups = groups.to_vec();
    let mut m = KVCacheManager::new(c).expect("valid config");
    let ids: Vec<u64> = (0..n as u64).collect();
    for &id in &ids {
        let t = prompt(id as u32, 512);
        m.add_sequence(id, &t, None, None).unwrap();
        m.allocate_slots(id, t.len(), 0).unwrap().unwrap();
        m.commit(id, t.len(), &[1]).unwrap();
    }
    (m, ids)
}

fn bench_decode_step_groups(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_groups_1024");
    g.throughput(Throughput::Elements(1024));
    let runs: [(&str, Vec<GroupSpec>); 2] = [
        ("one_group", vec![GroupSpec::FullAttention]),
        (
            "two_groups",
            vec![
                GroupSpec::FullAttention,
                GroupSpec::SlidingWindow { window: 128 },
            ],
        ),
    ];
    for (name, groups) in runs {
        let one = groups.len() == 1;
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut state = group_decode_state(&groups);
                let mut steps = 0;
                let new_tokens = vec![7i64; 1024];
                for _ in 0..iters {
                    if steps == 1024 {
                        state = group_decode_state(&groups);
                        steps = 0;
                    }
                    let (m, ids) = &mut state;
                    let start = Instant::now();
                    let served = m
                        .allocate_slots_batch(ids, BatchArg::Scalar(1), 0)
                        .unwrap()
                        .num_served;
                    // One group through today's calls; several through the all-group ones.
                    let (tables, slots) = if one {
                        (
                            m.block_tables(ids, None).unwrap(),
                            m.slot_mapping(ids, None).unwrap(),
                        )
                    } else {
                        (
                            m.group_block_tables(ids, None, None).unwrap(),
                            m.group_slot_mapping(ids, None, None).unwrap(),
                        )
                    };
                    m.commit_batch(ids, BatchArg::Scalar(1), Some(BatchArg::Each(&new_tokens)))
                        .unwrap();
                    total += start.elapsed();
                    black_box(m.take_events());
                    assert_eq!(served, ids.len());
                    black_box((tables, slots));
                    steps += 1;
                }
                total
            })
        });
    }
    g.finish();
}

/// 1,024 decoding sequences (512-token prompts) in a pool whose every free block is a
/// cached block of an earlier prompt, with `tier` host slots (0: none).
fn tier_state(tier: usize, policy: OffloadPolicy) -> (KVCacheManager, Vec<u64>) {
    let n = 1024;
    // Room for the prompts (33 blocks each) and 1,024 decode steps (64 blocks each).
    let blocks = n * (33 + 64);
    let mut c = ManagerConfig::new(blocks + 1, BLOCK_SIZE);
    c.host_cache_blocks = tier;
    c.host_offload = policy;
    c.record_events = false;
    c.watermark = 0.0;
    let mut m = KVCacheManager::new(c).expect("valid config");
    // Fill the whole pool with cached blocks, then free them: every later pop evicts.
    let filler = blocks / 32;
    for id in 0..filler as u64 {
        let t = prompt(1_000_000 + id as u32, 512);
        m.add_sequence(id, &t, None, None).unwrap();
        m.allocate_slots(id, t.len(), 0).unwrap().unwrap();
        m.commit(id, t.len(), &[]).unwrap();
        m.free(id).unwrap();
    }
    let ids: Vec<u64> = (filler as u64..(filler + n) as u64).collect();
    for &id in &ids {
        let t = prompt(id as u32, 512);
        m.add_sequence(id, &t, None, None).unwrap();
        m.allocate_slots(id, t.len(), 0).unwrap().unwrap();
        m.commit(id, t.len(), &[1]).unwrap();
    }
    black_box(m.take_memory_ops());
    m.confirm_memory_ops();
    (m, ids)
}

fn bench_host_tier(c: &mut Criterion) {
    let mut g = c.benchmark_group("host_tier_1024");
    g.throughput(Throughput::Elements(1024));
    let runs = [
        ("off", 0, OffloadPolicy::OnEvict),
        ("evict", 32_768, OffloadPolicy::OnEvict),
        ("commit", 32_768, OffloadPolicy::WriteThrough),
    ];
    for (name, tier, policy) in runs {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut state = tier_state(tier, policy);
                let mut steps = 0;
                let new_tokens = vec![7i64; 1024];
                for _ in 0..iters {
                    if steps == 1024 {
                        state = tier_state(tier, policy);
                        steps = 0;
                    }
                    let (m, ids) = &mut state;
                    let start = Instant::now();
                    let served = m
                        .allocate_slots_batch(ids, BatchArg::Scalar(1), 0)
                        .unwrap()
                        .num_served;
                    let ops = m.take_memory_ops();
                    let tables = m.block_tables(ids, None).unwrap();
                    let slots = m.slot_mapping(ids, None).unwrap();
                    m.commit_batch(ids, BatchArg::Scalar(1), Some(BatchArg::Each(&new_tokens)))
                        .unwrap();
                    m.confirm_memory_ops();
                    total += start.elapsed();
                    assert_eq!(served, ids.len());
                    black_box((tables, slots, ops));
                    steps += 1;
                }
                total
            })
        });
    }
    g.finish();
}

/// Steps run on one decode-table state before it is rebuilt (untimed).
const TABLE_STEPS: usize = 2048;

/// A decode-table state: manager, ids, rows and the persistent table (`cols` wide).
struct TableState {
    m: KVCacheManager,
    ids: Vec<u64>,
    rows: Vec<i64>,
    cols: usize,
    table: Vec<i32>,
}

impl TableState {
    /// 1,024 sequences of `len` computed tokens (plus one sampled), prefix caching off, in
    /// a pool with room for `TABLE_STEPS` more tokens each, synced once, then run for one
    /// block's worth of steps (untimed) so every table has grown its buffer once, as in a
    /// long-running server.
    fn new(len: usize) -> Self {
        let n = 1024;
        let cols = (len + TABLE_STEPS + 2 * BLOCK_SIZE).div_ceil(BLOCK_SIZE);
        let mut m = manager(n * cols + 1, false, HashAlgo::Blake3);
        let ids: Vec<u64> = (0..n as u64).collect();
        let t = prompt(7, len);
        for &id in &ids {
            m.add_sequence(id, &t, None, None).unwrap();
        }
        m.allocate_slots_batch(&ids, BatchArg::Scalar(len as i64), 0)
            .unwrap();
        m.commit_batch(
            &ids,
            BatchArg::Scalar(len as i64),
            Some(BatchArg::Scalar(1)),
        )
        .unwrap();
        let rows = (0..n as i64).collect();
        let table = vec![0i32; n * cols];
        let mut s = TableState {
            m,
            ids,
            rows,
            cols,
            table,
        };
        for _ in 0..BLOCK_SIZE {
            s.step(true);
        }
        s
    }

    /// One decode step; the block tables kept incrementally or rebuilt.
    fn step(&mut self, incremental: bool) {
        let (m, ids) = (&mut self.m, &self.ids);
        let served = m
            .allocate_slots_batch(ids, BatchArg::Scalar(1), 0)
            .unwrap()
            .num_served;
        let slots = m.slot_mapping(ids, None).unwrap();
        if incremental {
            let n = ids.len();
            let delta = m
                .sync_block_table(ids, &self.rows, n, self.cols, Some(&mut self.table), false)
                .unwrap();
            black_box(delta);
        } else {
            black_box(m.block_tables(ids, None).unwrap());
        }
        m.commit_batch(ids, BatchArg::Scalar(1), Some(BatchArg::Scalar(7)))
            .unwrap();
        assert_eq!(served, ids.len());
        black_box(slots);
    }
}

fn bench_decode_step_table(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step_table");
    g.throughput(Throughput::Elements(1024));
    for (label, len) in [("32k", 32_768usize), ("128", 128)] {
        let mut state = TableState::new(len);
        let mut steps = 0;
        for incremental in [false, true] {
            let name = if incremental {
                "incremental"
            } else {
                "rebuild"
            };
            g.bench_function(BenchmarkId::new(label, name), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        if steps == TABLE_STEPS {
                            state = TableState::new(len);
                            steps = 0;
                        }
                        let start = Instant::now();
                        state.step(incremental);
                        total += start.elapsed();
                        steps += 1;
                    }
                    total
                })
            });
        }
        // The rebuild steps do not sync: their changes pile up and the first incremental
        // step writes them (once per state, within the measurement's noise).
        black_box(&state.table);
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_alloc_free, bench_prefix_lookup, bench_hash, bench_fork_cow, bench_decode_step,
        bench_decode_step_groups, bench_decode_step_table, bench_host_tier
}
criterion_main!(benches);
