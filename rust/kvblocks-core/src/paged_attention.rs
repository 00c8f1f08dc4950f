//! Decode attention over a paged KV cache on the CPU, fp32: the CPU engine's decode kernel.
//!
//! One query token per sequence, at position `seq_len - 1`, attends to the keys its
//! window lets it see, read in place through the block table: no gathered copy of the
//! context, no padding between sequences of different lengths. The semantics are those
//! of the torch reference (`kvblocks.ops.reference`, which the Python tests compare
//! against):
//!
//! ```text
//! s_j = scale * <q, k_j>                  for j in [max(0, len - window), len)
//! s_j = cap * tanh(s_j / cap)             with a soft-cap
//! m   = max(max_j s_j, sink)              with a sink (a logit per query head)
//! out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m))
//! ```
//!
//! The layout is the one `kvblocks.ops` allocates: caches `[num_blocks, num_kv_heads,
//! block_size, head_size]`, queries and outputs `[num_seqs, num_heads, head_size]`,
//! block tables `[num_seqs, max_blocks]` (int32), lengths `[num_seqs]` (int32); query
//! head `h` reads KV head `h / (num_heads / num_kv_heads)`. A length of 0 (batch
//! padding) yields a zero row. Work items are (sequence, KV head) pairs: the query heads
//! of one KV head share every key and value row read, and items are split over
//! `threads` scoped threads by their number of keys.

use crate::error::{KvError, Result};

/// The attention shape of a call (the cache length gives the number of blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_size: usize,
    /// Tokens per cache block.
    pub block_size: usize,
}

/// What a layer chooses: scale, window, soft-cap and sinks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams<'a> {
    /// Multiplies every dot product (finite).
    pub scale: f32,
    /// Keys `j > pos - window` only (at least 1).
    pub sliding_window: Option<usize>,
    /// `cap * tanh(s / cap)` after scaling (finite, positive).
    pub soft_cap: Option<f32>,
    /// One logit per query head in the softmax denominator (`num_heads` entries).
    pub sinks: Option<&'a [f32]>,
}

/// The tensors of a decode batch, row-major (see the module docs for their shapes).
#[derive(Debug, Clone, Copy)]
pub struct DecodeBatch<'a> {
    /// `[num_seqs, num_heads, head_size]`.
    pub query: &'a [f32],
    /// `[num_blocks, num_kv_heads, block_size, head_size]`.
    pub key_cache: &'a [f32],
    /// Same shape as `key_cache`.
    pub value_cache: &'a [f32],
    /// `[num_seqs, max_blocks]` block ids; only the first `ceil(len / block_size)` of a
    /// row are read.
    pub block_tables: &'a [i32],
    /// `[num_seqs]` context lengths, the query's own token included.
    pub seq_lens: &'a [i32],
}

/// Decode attention of every sequence of `batch` into `out` (`[num_seqs, num_heads,
/// head_size]`).
///
/// Every argument is checked before anything is written: slice lengths against the
/// shape, each length against the table's capacity, each block id it reads against the
/// cache, the parameters' ranges. `threads` (at least 1) scoped threads share the work.
pub fn paged_decode_attention(
    out: &mut [f32],
    batch: &DecodeBatch<'_>,
    shape: PagedShape,
    params: &AttentionParams<'_>,
    threads: usize,
) -> Result<()> {
    let plan = Plan::new(out.len(), batch, shape, params)?;
    let row = plan.group * shape.head_size;
    let items = batch.seq_lens.len() * shape.num_kv_heads;
    let ranges = split_by_work(&plan, items, threads.max(1));
    std::thread::scope(|scope| {
        let mut rest = &mut out[..];
        let mut handles = Vec::new();
        for (index, &(start, end)) in ranges.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut((end - start) * row);
            rest = tail;
            let plan = &plan;
            let mut work = move || {
                let mut scratch = Scratch::default();
                for (item, chunk) in (start..end).zip(mine.chunks_exact_mut(row)) {
                    plan.attend(item, chunk, &mut scratch);
                }
            };
            if index + 1 == ranges.len() {
                work(); // the calling thread takes the last range
            } else {
                handles.push(scope.spawn(work));
            }
        }
        for handle in handles {
            // A panic in a worker is a bug in this module; re-raise it on this thread.
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    Ok(())
}

/// A validated call: the batch, its derived sizes and the layer's parameters.
struct Plan<'a> {
    batch: DecodeBatch<'a>,
    shape: PagedShape,
    params: AttentionParams<'a>,
    group: usize,
    max_blocks: usize,
    /// The running CPU has AVX2: [`Plan::attend`] runs its 256-bit build.
    avx2: bool,
}

fn invalid(message: String) -> KvError {
    KvError::InvalidArgument(message)
}

impl<'a> Plan<'a> {
    fn new(
        out_len: usize,
        batch: &DecodeBatch<'a>,
        shape: PagedShape,
        params: &AttentionParams<'a>,
    ) -> Result<Self> {
        let PagedShape {
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
        } = shape;
        if num_heads == 0 || num_kv_heads == 0 || head_size == 0 || block_size == 0 {
            return Err(invalid(format!(
                "every size must be positive, got {shape:?}"
            )));
        }
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(format!(
                "num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )));
        }
        let block_len = num_kv_heads * block_size * head_size;
        let cache_len = batch.key_cache.len();
        if cache_len % block_len != 0 || batch.value_cache.len() != cache_len {
            return Err(invalid(format!(
                "caches of {cache_len} and {} elements are not whole blocks of {block_len}",
                batch.value_cache.len()
            )));
        }
        let num_blocks = cache_len / block_len;
        let num_seqs = batch.seq_lens.len();
        let rows = num_seqs * num_heads * head_size;
        if batch.query.len() != rows || out_len != rows {
            return Err(invalid(format!(
                "query ({}) and out ({out_len}) must hold {num_seqs} x {num_heads} x \
                 {head_size} elements",
                batch.query.len()
            )));
        }
        let max_blocks = match batch.block_tables.len().checked_div(num_seqs) {
            Some(cols) if cols * num_seqs == batch.block_tables.len() => cols,
            None => 0,
            _ => {
                return Err(invalid(format!(
                    "block_tables of {} entries is not {num_seqs} rows",
                    batch.block_tables.len()
                )))
            }
        };
        for (s, &len) in batch.seq_lens.iter().enumerate() {
            let capacity = max_blocks * block_size;
            let len = usize::try_from(len)
                .map_err(|_| invalid(format!("seq_lens[{s}] = {len} is negative")))?;
            if len > capacity {
                return Err(invalid(format!(
                    "seq_lens[{s}] = {len} exceeds the block table capacity {capacity}"
                )));
            }
            let row = &batch.block_tables[s * max_blocks..][..len.div_ceil(block_size)];
            if let Some(&bad) = row.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
                return Err(invalid(format!(
                    "block_tables[{s}] holds block id {bad}, outside [0, {num_blocks})"
                )));
            }
        }
        if !params.scale.is_finite() {
            return Err(invalid(format!(
                "scale must be finite, got {}",
                params.scale
            )));
        }
        if params.sliding_window == Some(0) {
            return Err(invalid("sliding_window must be at least 1".to_owned()));
        }
        if let Some(cap) = params.soft_cap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(invalid(format!(
                    "soft_cap must be finite and positive, got {cap}"
                )));
            }
        }
        if let Some(sinks) = params.sinks {
            if sinks.len() != num_heads {
                return Err(invalid(format!(
                    "sinks has {} entries, expected one per query head ({num_heads})",
                    sinks.len()
                )));
            }
        }
        Ok(Self {
            batch: *batch,
            shape,
            params: *params,
            group: num_heads / num_kv_heads,
            max_blocks,
            avx2: has_avx2(),
        })
    }

    /// The keys item `item` = (sequence, KV head) reads: `[first, len)`.
    fn key_range(&self, item: usize) -> (usize, usize) {
        let len = self.batch.seq_lens[item / self.shape.num_kv_heads] as usize;
        let first = self
            .params
            .sliding_window
            .map_or(0, |w| len.saturating_sub(w));
        (first, len)
    }

    /// The contiguous runs of cache rows holding keys `[first, len)` of sequence `seq`
    /// for KV head `head`, each as (first key, element offset in the cache, rows).
    fn runs(&self, seq: usize, head: usize, first: usize, len: usize) -> Runs<'_> {
        Runs {
            plan: self,
            table: seq * self.max_blocks,
            head,
            next: first,
            end: len,
        }
    }

    /// Attend the query heads of one (sequence, KV head) item into `out` (`[group, D]`).
    fn attend(&self, item: usize, out: &mut [f32], scratch: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `avx2` is true only when the running CPU reports AVX2 (`has_avx2`).
            unsafe { self.attend_avx2(item, out, scratch) };
            return;
        }
        self.attend_portable(item, out, scratch);
    }

    /// [`Plan::attend_portable`] compiled for AVX2: the default x86-64 target stops at
    /// SSE2, so the inlined loops get 8 lanes per instruction instead of 4.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn attend_avx2(&self, item: usize, out: &mut [f32], scratch: &mut Scratch) {
        self.attend_portable(item, out, scratch);
    }

    /// The attention of one item, inlined into each target's build.
    #[inline(always)]
    fn attend_portable(&self, item: usize, out: &mut [f32], scratch: &mut Scratch) {
        let (seq, head) = (
            item / self.shape.num_kv_heads,
            item % self.shape.num_kv_heads,
        );
        let (first, len) = self.key_range(item);
        let n = len - first;
        if n == 0 {
            out.fill(0.0);
            return;
        }
        let d = self.shape.head_size;
        let group = self.group;
        let q_start = (seq * self.shape.num_heads + head * group) * d;
        let queries = &self.batch.query[q_start..q_start + group * d];
        scratch.scores.clear();
        scratch.scores.resize(group * n, 0.0);
        scratch.runs.clear();
        scratch.runs.extend(self.runs(seq, head, first, len));
        let (key_cache, value_cache) = (self.batch.key_cache, self.batch.value_cache);
        for (i, &(key, offset, rows)) in scratch.runs.iter().enumerate() {
            // The next run's rows (after the last key run, the first value run), one per
            // row read here: each run is its own page of the cache, where the hardware
            // prefetcher starts cold, and the engine's layers evict each other's blocks.
            let next = match scratch.runs.get(i + 1) {
                Some(&(_, o, r)) => (key_cache, o, r),
                None => (value_cache, scratch.runs[0].1, scratch.runs[0].2),
            };
            let keys = &key_cache[offset..offset + rows * d];
            for (r, k) in keys.chunks_exact(d).enumerate() {
                prefetch_row(next, r, d);
                for (g, q) in queries.chunks_exact(d).enumerate() {
                    scratch.scores[g * n + key - first + r] = dot(q, k) * self.params.scale;
                }
            }
        }
        if let Some(cap) = self.params.soft_cap {
            for s in &mut scratch.scores {
                *s = cap * (*s / cap).tanh();
            }
        }
        scratch.denominators.clear();
        for (g, weights) in scratch.scores.chunks_exact_mut(n).enumerate() {
            let sink = self.params.sinks.map(|sinks| sinks[head * group + g]);
            // f32::max skips a NaN score; it still reaches the sum through its weight.
            let mut m = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if let Some(sink) = sink {
                m = m.max(sink);
            }
            for w in weights.iter_mut() {
                *w -= m;
            }
            exp_in_place(weights);
            let extra = sink.map_or(0.0, |sink| (sink - m).exp());
            scratch.denominators.push(sum(weights) + extra);
        }
        out.fill(0.0);
        for (i, &(key, offset, rows)) in scratch.runs.iter().enumerate() {
            let next = scratch
                .runs
                .get(i + 1)
                .map(|&(_, o, r)| (value_cache, o, r));
            let values = &value_cache[offset..offset + rows * d];
            for (r, v) in values.chunks_exact(d).enumerate() {
                if let Some(next) = next {
                    prefetch_row(next, r, d);
                }
                for (g, acc) in out.chunks_exact_mut(d).enumerate() {
                    axpy(acc, scratch.scores[g * n + key - first + r], v);
                }
            }
        }
        for (acc, &denominator) in out.chunks_exact_mut(d).zip(&scratch.denominators) {
            let inverse = 1.0 / denominator;
            for a in acc {
                *a *= inverse;
            }
        }
    }
}

/// Whether the running CPU has AVX2 (checked once per call).
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Per-thread buffers reused across items.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    denominators: Vec<f32>,
    /// The item's runs (first key, element offset, rows), walked by both passes.
    runs: Vec<(usize, usize, usize)>,
}

/// Ask for row `r` of a run (`(cache, element offset, rows)`) to be brought into the cache
/// ahead of its use; nothing past the run's rows. A hint only: no value changes.
#[inline(always)]
fn prefetch_row((cache, offset, rows): (&[f32], usize, usize), r: usize, d: usize) {
    if r >= rows {
        return;
    }
    let row = &cache[offset + r * d..offset + (r + 1) * d];
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // 16 f32 = one 64-byte cache line.
        // SAFETY: SSE (the intrinsic's feature) is part of the x86-64 baseline, and a
        // prefetch of an address inside a live slice changes no memory and cannot fault.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast::<i8>(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Iterator over the contiguous cache runs of one sequence's keys (see [`Plan::runs`]).
struct Runs<'p> {
    plan: &'p Plan<'p>,
    table: usize,
    head: usize,
    next: usize,
    end: usize,
}

impl Iterator for Runs<'_> {
    type Item = (usize, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let PagedShape {
            num_kv_heads,
            head_size,
            block_size,
            ..
        } = self.plan.shape;
        let block = self.plan.batch.block_tables[self.table + self.next / block_size] as usize;
        let within = self.next % block_size;
        let rows = (block_size - within).min(self.end - self.next);
        let offset = ((block * num_kv_heads + self.head) * block_size + within) * head_size;
        let key = self.next;
        self.next += rows;
        Some((key, offset, rows))
    }
}

/// Contiguous item ranges, one per thread, of about equal key counts.
fn split_by_work(plan: &Plan<'_>, items: usize, threads: usize) -> Vec<(usize, usize)> {
    let weight = |item: usize| {
        let (first, len) = plan.key_range(item);
        len - first + 1 // +1: an item costs something even with no keys
    };
    let total: usize = (0..items).map(weight).sum();
    let mut ranges = Vec::with_capacity(threads);
    let (mut start, mut done) = (0, 0);
    for t in 1..=threads {
        let target = total * t / threads;
        let mut end = start;
        while end < items && (done < target || t == threads) {
            done += weight(end);
            end += 1;
        }
        if end > start {
            ranges.push((start, end));
        }
        start = end;
    }
    if ranges.is_empty() {
        ranges.push((0, 0));
    }
    ranges
}

const LANES: usize = 8;

/// `<a, b>` with `LANES` independent partial sums, so the compiler can vectorise it.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut partial = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..LANES {
            partial[lane] += x[lane] * y[lane];
        }
    }
    partial.iter().sum::<f32>() + tail
}

/// `sum(xs)` with `LANES` independent partial sums.
#[inline(always)]
fn sum(xs: &[f32]) -> f32 {
    let mut partial = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for x in chunks {
        for lane in 0..LANES {
            partial[lane] += x[lane];
        }
    }
    partial.iter().sum::<f32>() + tail
}

/// `acc += w * v`.
#[inline(always)]
fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// `exp` of every element, in place: Cephes' `expf` (range reduction by `ln 2`, a
/// degree-7 polynomial), branch-free so that it vectorises; within 2 ulp of `f32::exp`
/// on `[-87, 88]`. Inputs below `-87.3` give about `1e-38` rather than 0 (a weight that
/// small is lost in any sum with a weight of 1), NaN stays NaN.
#[inline(always)]
pub fn exp_in_place(xs: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    for x in xs {
        // clamp keeps NaN.
        let v = x.clamp(-87.3, 88.3);
        let n = (v * LOG2E + ROUND) - ROUND;
        let r = v - n * LN2_HI - n * LN2_LO;
        let mut p = P[0];
        for c in &P[1..] {
            p = p * r + c;
        }
        let poly = p * r * r + r + 1.0;
        // 2^n for n in [-126, 127]: the exponent field.
        let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
        *x = poly * scale;
    }
}

#[cfg(test)]
mod tests {
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
                let denominator: f64 =
                    scores.iter().sum::<f64>() + sink.map_or(0.0, |x| (x - m).exp());
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
}
