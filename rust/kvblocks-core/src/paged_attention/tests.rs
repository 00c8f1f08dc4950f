//! Tests of the paged decode kernel against a plain f64 statement of its semantics.

use super::*;

/// A plain f64 statement of the semantics, sequence by sequence, head by head.
fn naive(batch: &DecodeBatch<'_>, shape: PagedShape, params: &AttentionParams<'_>) -> Vec<f64> {
    let PagedShape {
        num_heads,
        num_kv_heads,
        head_size: d,
        block_size,
    } = shape;
    let n = batch.seq_lens.len();
    let max_blocks = batch.block_tables.len().checked_div(n).unwrap_or(0);
    let mut out = vec![0.0f64; n * num_heads * d];
    for s in 0..n {
        let len = batch.seq_lens[s] as usize;
        for h in 0..num_heads {
            let kv = h / (num_heads / num_kv_heads);
            let q = &batch.query[(s * num_heads + h) * d..][..d];
            let first = params.sliding_window.map_or(0, |w| len.saturating_sub(w));
            let row = |cache: &[f32], j: usize| -> Vec<f64> {
                let block = batch.block_tables[s * max_blocks + j / block_size] as usize;
                let at = ((block * num_kv_heads + kv) * block_size + j % block_size) * d;
                cache[at..at + d].iter().map(|&x| f64::from(x)).collect()
            };
            let mut scores: Vec<f64> = (first..len)
                .map(|j| {
                    let k = row(batch.key_cache, j);
                    let dot: f64 = q.iter().zip(&k).map(|(a, b)| f64::from(*a) * b).sum();
                    let s = dot * f64::from(params.scale);
                    match params.soft_cap {
                        Some(cap) => f64::from(cap) * (s / f64::from(cap)).tanh(),
                        None => s,
                    }
                })
                .collect();
            if scores.is_empty() {
                continue;
            }
            let sink = params.sinks.map(|x| f64::from(x[h]));
            let m = scores
                .iter()
                .copied()
                .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            for x in &mut scores {
                *x = (*x - m).exp();
            }
            let denominator: f64 = scores.iter().sum::<f64>() + sink.map_or(0.0, |x| (x - m).exp());
            for (i, j) in (first..len).enumerate() {
                let v = row(batch.value_cache, j);
                for e in 0..d {
                    out[(s * num_heads + h) * d + e] += scores[i] * v[e] / denominator;
                }
            }
        }
    }
    out
}

/// A small deterministic generator (xorshift), values in [-2, 2).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

struct Case {
    query: Vec<f32>,
    key_cache: Vec<f32>,
    value_cache: Vec<f32>,
    tables: Vec<i32>,
    lens: Vec<i32>,
    shape: PagedShape,
}

impl Case {
    fn new(lens: &[i32], shape: PagedShape, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let bs = shape.block_size;
        let max_blocks = lens
            .iter()
            .map(|&l| (l as usize).div_ceil(bs))
            .max()
            .unwrap_or(0)
            + 1;
        let num_blocks = 1 + lens
            .iter()
            .map(|&l| (l as usize).div_ceil(bs))
            .sum::<usize>();
        // Blocks handed out back to front, so no table is in cache order.
        let mut next = num_blocks as i32 - 1;
        let mut tables = vec![0i32; lens.len() * max_blocks];
        for (s, &l) in lens.iter().enumerate() {
            for b in 0..(l as usize).div_ceil(bs) {
                tables[s * max_blocks + b] = next;
                next -= 1;
            }
        }
        let cache = num_blocks * shape.num_kv_heads * bs * shape.head_size;
        let mut key_cache = rng.vec(cache);
        let mut value_cache = rng.vec(cache);
        // The null block and every slot past a length hold poison: never read.
        let tile = bs * shape.head_size;
        key_cache[..shape.num_kv_heads * tile].fill(f32::NAN);
        value_cache[..shape.num_kv_heads * tile].fill(f32::INFINITY);
        for (s, &l) in lens.iter().enumerate() {
            let l = l as usize;
            if l % bs == 0 {
                continue;
            }
            let block = tables[s * max_blocks + l / bs] as usize;
            for h in 0..shape.num_kv_heads {
                let tile_start = (block * shape.num_kv_heads + h) * tile;
                key_cache[tile_start + (l % bs) * shape.head_size..tile_start + tile]
                    .fill(f32::NAN);
                value_cache[tile_start + (l % bs) * shape.head_size..tile_start + tile]
                    .fill(f32::INFINITY);
            }
        }
        let query = rng.vec(lens.len() * shape.num_heads * shape.head_size);
        Self {
            query,
            key_cache,
            value_cache,
            tables,
            lens: lens.to_vec(),
            shape,
        }
    }

    fn batch(&self) -> DecodeBatch<'_> {
        DecodeBatch {
            query: &self.query,
            key_cache: &self.key_cache,
            value_cache: &self.value_cache,
            block_tables: &self.tables,
            seq_lens: &self.lens,
        }
    }

    /// The kernel without AVX2, on one thread (what a CPU without it runs).
    fn portable(&self, params: &AttentionParams<'_>) -> Vec<f32> {
        let batch = self.batch();
        let mut out = vec![f32::NAN; self.query.len()];
        let mut plan = Plan::new(out.len(), &batch, self.shape, params).unwrap();
        plan.avx2 = false;
        let row = plan.group * self.shape.head_size;
        let mut scratch = Scratch::default();
        for (item, chunk) in out.chunks_exact_mut(row).enumerate() {
            plan.attend(item, chunk, &mut scratch);
        }
        out
    }

    fn check(&self, params: &AttentionParams<'_>, threads: usize) {
        let mut out = vec![f32::NAN; self.query.len()];
        paged_decode_attention(&mut out, &self.batch(), self.shape, params, threads).unwrap();
        let want = naive(&self.batch(), self.shape, params);
        let portable = self.portable(params);
        for (i, (got, want)) in out
            .iter()
            .chain(&portable)
            .zip(want.iter().cycle())
            .enumerate()
        {
            let err = (f64::from(*got) - want).abs();
            assert!(
                err <= 2e-6 + 2e-6 * want.abs(),
                "element {i}: {got} vs {want}"
            );
        }
    }
}

const SHAPE: PagedShape = PagedShape {
    num_heads: 8,
    num_kv_heads: 2,
    head_size: 64,
    block_size: 16,
};

#[test]
fn matches_the_naive_statement_with_every_option() {
    let sinks: Vec<f32> = (0..8).map(|h| h as f32 * 0.7 - 2.0).collect();
    let all = [
        AttentionParams {
            scale: 0.125,
            sliding_window: None,
            soft_cap: None,
            sinks: None,
        },
        AttentionParams {
            scale: 0.3,
            sliding_window: Some(1),
            soft_cap: None,
            sinks: None,
        },
        AttentionParams {
            scale: 0.3,
            sliding_window: Some(7),
            soft_cap: Some(2.0),
            sinks: None,
        },
        AttentionParams {
            scale: 0.2,
            sliding_window: None,
            soft_cap: None,
            sinks: Some(&sinks),
        },
        AttentionParams {
            scale: 0.2,
            sliding_window: Some(20),
            soft_cap: Some(3.0),
            sinks: Some(&sinks),
        },
    ];
    for block_size in [8, 16, 32] {
        for (heads, kv) in [(8, 2), (4, 4), (8, 1)] {
            let shape = PagedShape {
                num_heads: heads,
                num_kv_heads: kv,
                head_size: 64,
                block_size,
            };
            let case = Case::new(&[1, 0, 17, 100, 33, 2, 64], shape, 7 + block_size as u64);
            for params in &all {
                let params = AttentionParams {
                    sinks: params.sinks.map(|s| &s[..heads]),
                    ..*params
                };
                for threads in [1, 2, 5] {
                    case.check(&params, threads);
                }
            }
        }
    }
}

#[test]
fn odd_head_sizes_use_the_scalar_tail() {
    let shape = PagedShape {
        num_heads: 2,
        num_kv_heads: 1,
        head_size: 12,
        block_size: 8,
    };
    let case = Case::new(&[5, 9], shape, 3);
    case.check(
        &AttentionParams {
            scale: 0.5,
            sliding_window: None,
            soft_cap: None,
            sinks: None,
        },
        1,
    );
}

#[test]
fn zero_length_rows_are_zero_and_an_empty_batch_is_fine() {
    let case = Case::new(&[0, 0], SHAPE, 1);
    let mut out = vec![f32::NAN; case.query.len()];
    let params = AttentionParams {
        scale: 1.0,
        sliding_window: None,
        soft_cap: None,
        sinks: None,
    };
    paged_decode_attention(&mut out, &case.batch(), SHAPE, &params, 2).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
    let empty = Case::new(&[], SHAPE, 1);
    paged_decode_attention(&mut [], &empty.batch(), SHAPE, &params, 3).unwrap();
}

#[test]
fn a_non_finite_value_in_reach_shows_as_nan() {
    let mut case = Case::new(&[20], SHAPE, 5);
    let params = AttentionParams {
        scale: 0.1,
        sliding_window: None,
        soft_cap: None,
        sinks: None,
    };
    let block = case.tables[0] as usize;
    case.key_cache[(block * 2) * 16 * 64] = f32::NAN; // key 0 of KV head 0
    let mut out = vec![0.0; case.query.len()];
    paged_decode_attention(&mut out, &case.batch(), SHAPE, &params, 1).unwrap();
    assert!(out[..4 * 64].iter().all(|x| x.is_nan()));
    assert!(out[4 * 64..].iter().all(|x| x.is_finite()));
}

#[test]
fn bad_arguments_are_refused_before_writing() {
    let case = Case::new(&[20, 5], SHAPE, 9);
    let params = AttentionParams {
        scale: 0.1,
        sliding_window: None,
        soft_cap: None,
        sinks: None,
    };
    let mut out = vec![7.0; case.query.len()];
    let mut tables = case.tables.clone();
    tables[0] = 10_000;
    let bad_tables = DecodeBatch {
        block_tables: &tables,
        ..case.batch()
    };
    let too_long = [2000, 5];
    let bad_lens = DecodeBatch {
        seq_lens: &too_long,
        ..case.batch()
    };
    let negative = [-1, 5];
    let negative_lens = DecodeBatch {
        seq_lens: &negative,
        ..case.batch()
    };
    let short_query = DecodeBatch {
        query: &case.query[1..],
        ..case.batch()
    };
    for (batch, needle) in [
        (bad_tables, "block id 10000"),
        (bad_lens, "capacity"),
        (negative_lens, "negative"),
        (short_query, "must hold"),
    ] {
        let err = paged_decode_attention(&mut out, &batch, SHAPE, &params, 1).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }
    let few_sinks = [0.0f32; 3];
    for (p, needle) in [
        (
            AttentionParams {
                sinks: Some(&few_sinks),
                ..params
            },
            "one per query head",
        ),
        (
            AttentionParams {
                sliding_window: Some(0),
                ..params
            },
            "at least 1",
        ),
        (
            AttentionParams {
                soft_cap: Some(-1.0),
                ..params
            },
            "soft_cap",
        ),
        (
            AttentionParams {
                scale: f32::NAN,
                ..params
            },
            "scale",
        ),
    ] {
        let err = paged_decode_attention(&mut out, &case.batch(), SHAPE, &p, 1).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }
    let odd = PagedShape {
        num_kv_heads: 3,
        ..SHAPE
    };
    assert!(paged_decode_attention(&mut out, &case.batch(), odd, &params, 1).is_err());
    assert!(out.iter().all(|&x| x == 7.0));
}

#[test]
fn exp_is_within_two_ulp_and_keeps_nan() {
    let mut x = -87.0f32;
    while x < 88.0 {
        let mut got = [x];
        exp_in_place(&mut got);
        let want = f64::from(x).exp();
        let ulp = f64::from(f32::EPSILON) * want;
        assert!(
            (f64::from(got[0]) - want).abs() <= 2.0 * ulp,
            "exp({x}) = {} vs {want}",
            got[0]
        );
        x += 0.013;
    }
    let mut special = [f32::NAN, f32::NEG_INFINITY, 0.0, -200.0];
    exp_in_place(&mut special);
    assert!(special[0].is_nan());
    assert!(special[1] < 1e-37 && special[1] >= 0.0 && special[3] < 1e-37);
    assert_eq!(special[2], 1.0);
}
