//! The attention of one work item, a (sequence, KV head) pair: scores, softmax and the
//! weighted sum of the values, in a portable build and, where the CPU has it, an AVX2 one.

use super::plan::Plan;
use super::runs::{prefetch_row, Scratch};
use super::vector_math::{axpy, dot, exp_in_place, sum};

impl Plan<'_> {
    /// Attend the query heads of one (sequence, KV head) item into `out` (`[group, D]`).
    pub(super) fn attend(&self, item: usize, out: &mut [f32], scratch: &mut Scratch) {
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
