//! The least a sequence's computation needs: the most blocks it holds in all groups
//! together while its known tokens past a first step are computed one a step
//! (`can_allocate_step`'s `Never` bound).
//!
//! The query at position `p` reserves `T(p) = ceil((p + 1 + lookahead) / bs)` table entries
//! and group `g` has released the first `r_g(p) = released_blocks(p)` of them (never fewer
//! than its claim's: `r_g` is non-decreasing and `p` is past the claim), so the sequence
//! holds `F(p) = sum_g (T(p) - r_g(p))`. Three facts bound where `F` peaks on
//! `[cached, known)`:
//!
//! 1. `F` rises only where `T` does (every `r_g` is non-decreasing): at the positions
//!    `p` with `(p + lookahead) % bs == 0`, the *rises*. Between rises it does not grow,
//!    so the peak is at the range's start or at a rise.
//! 2. From one rise to the next (`bs` positions), a full-attention group's count grows by
//!    one, a window or recurrent group's does not shrink (it releases at most one block
//!    as `T` grows by one), and a chunked group's grows by one unless one of its chunk
//!    boundaries lies in between. So the peak is at the start, the last rise, or the last
//!    rise before some chunk boundary.
//! 3. With `P` the least common multiple of `bs` and every chunked group's
//!    `lcm(chunk, bs)`, `F(p + P) >= F(p)` (each group's count repeats after `P`, a full
//!    group's grows), so only the last `P` positions of the range matter.
//!
//! The candidates are the start, the last rise and, per chunked group, one rise per chunk
//! boundary in the last `P` positions: `O(groups)` positions without chunked groups, and
//! `bs / gcd(chunk, bs)` more per position of a single chunked group (the scan it replaces
//! read every one of `lcm(chunk, bs)` positions, and with two chunked groups read only
//! the largest group's period: it under-counted, see the tests).

use crate::group::GroupSpec;

/// `F(p)`: blocks held in all groups by the query at `p` (see the module docs).
fn held_at(
    groups: &[GroupSpec],
    bs: usize,
    lookahead: usize,
    claim_start: &impl Fn(usize) -> usize,
    p: usize,
) -> usize {
    let table_len = (p + 1 + lookahead).div_ceil(bs);
    groups
        .iter()
        .enumerate()
        .map(|(g, spec)| {
            let first = spec.released_blocks(p, bs).max(claim_start(g));
            table_len - first.min(table_len)
        })
        .sum()
}

/// Least common multiple, `None` past `limit` (or on overflow).
fn lcm_within(a: usize, b: usize, limit: usize) -> Option<usize> {
    let l = (a / gcd(a, b)).checked_mul(b)?;
    (l <= limit).then_some(l)
}

/// Greatest common divisor (`gcd(a, 0) = a`).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The most blocks held while positions `cached..known` are computed one a step, each
/// step reserving `lookahead` more; `claim_start(g)` is group `g`'s first claimed entry.
/// 0 for an empty range.
pub(super) fn peak_held(
    groups: &[GroupSpec],
    bs: usize,
    known: usize,
    cached: usize,
    lookahead: usize,
    claim_start: impl Fn(usize) -> usize,
) -> usize {
    if cached >= known {
        return 0;
    }
    let span = known - cached;
    // Fact 3: the last P positions (the whole range when P is longer).
    let period = groups.iter().try_fold(bs, |acc, spec| match *spec {
        GroupSpec::ChunkedLocalAttention { chunk } => {
            lcm_within(chunk, bs, span).and_then(|c| lcm_within(acc, c, span))
        }
        _ => Some(acc),
    });
    let from = period.map_or(cached, |p| known - p.min(span));
    let at = |p: usize| held_at(groups, bs, lookahead, &claim_start, p);
    // The last rise strictly below `end` and after `from` (fact 1).
    let rise_below = |end: usize| -> Option<usize> {
        let p = end.checked_sub(1)?;
        let p = p.checked_sub((p + lookahead) % bs)?;
        (p > from).then_some(p)
    };
    let mut peak = at(from);
    if let Some(p) = rise_below(known) {
        peak = peak.max(at(p));
    }
    // Fact 2: the last rise before each chunk boundary in (from, known).
    for spec in groups {
        if let GroupSpec::ChunkedLocalAttention { chunk } = *spec {
            let mut boundary = (from / chunk + 1) * chunk;
            while boundary < known {
                if let Some(p) = rise_below(boundary) {
                    peak = peak.max(at(p));
                }
                boundary += chunk;
            }
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition: every position of the range.
    fn every_position(
        groups: &[GroupSpec],
        bs: usize,
        known: usize,
        cached: usize,
        lookahead: usize,
        claim_start: impl Fn(usize) -> usize,
    ) -> usize {
        (cached..known)
            .map(|p| held_at(groups, bs, lookahead, &claim_start, p))
            .max()
            .unwrap_or(0)
    }

    /// The scan this module replaces: every position of the last `max` over the groups
    /// of `lcm(chunk, bs)` (or `bs`) positions.
    fn previous_scan(
        groups: &[GroupSpec],
        bs: usize,
        known: usize,
        cached: usize,
        lookahead: usize,
        claim_start: impl Fn(usize) -> usize,
    ) -> usize {
        let period = groups
            .iter()
            .map(|spec| match *spec {
                GroupSpec::ChunkedLocalAttention { chunk } => chunk / gcd(chunk, bs) * bs,
                _ => bs,
            })
            .max()
            .unwrap_or(bs);
        let from = cached.max(known.saturating_sub(period));
        (from..known)
            .map(|p| held_at(groups, bs, lookahead, &claim_start, p))
            .max()
            .unwrap_or(0)
    }

    fn spec() -> impl Strategy<Value = GroupSpec> {
        prop_oneof![
            Just(GroupSpec::FullAttention),
            (1usize..40).prop_map(|window| GroupSpec::SlidingWindow { window }),
            (1usize..40).prop_map(|chunk| GroupSpec::ChunkedLocalAttention { chunk }),
            (1usize..4).prop_map(|k| GroupSpec::Recurrent {
                checkpoint_every_blocks: k
            }),
        ]
    }

    /// A claim of `cached / bs` blocks: each group's first claimed entry, as `hit_range`.
    fn claim(groups: &[GroupSpec], bs: usize, cached: usize) -> impl Fn(usize) -> usize + '_ {
        let n = cached / bs;
        move |g| groups[g].released_blocks(n * bs, bs).min(n)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn the_candidates_find_the_peak_of_every_position(
            groups in prop::collection::vec(spec(), 1..5),
            bs in 1usize..9,
            known in 1usize..400,
            cached_frac in 0.0f64..1.0,
            lookahead in 0usize..4,
        ) {
            let cached = ((known - 1) as f64 * cached_frac) as usize;
            let want = every_position(&groups, bs, known, cached, lookahead, claim(&groups, bs, cached));
            let got = peak_held(&groups, bs, known, cached, lookahead, claim(&groups, bs, cached));
            prop_assert_eq!(got, want);
            // The previous scan was right with at most one chunked group.
            let chunked = groups.iter().filter(|g| matches!(g, GroupSpec::ChunkedLocalAttention { .. })).count();
            if chunked <= 1 {
                let old = previous_scan(&groups, bs, known, cached, lookahead, claim(&groups, bs, cached));
                prop_assert_eq!(got, old);
            }
        }
    }

    #[test]
    fn two_chunk_sizes_peak_outside_the_larger_period() {
        // Window 12, chunks 12 and 8, blocks of 1, 38 tokens: the query at 23 holds
        // 12 + 12 + 8 = 32 blocks; the last 12 positions peak at 28.
        let groups = [
            GroupSpec::SlidingWindow { window: 12 },
            GroupSpec::ChunkedLocalAttention { chunk: 12 },
            GroupSpec::ChunkedLocalAttention { chunk: 8 },
        ];
        let none = |_: usize| 0;
        assert_eq!(peak_held(&groups, 1, 38, 0, 0, none), 32);
        assert_eq!(every_position(&groups, 1, 38, 0, 0, none), 32);
        assert_eq!(previous_scan(&groups, 1, 38, 0, 0, none), 28);
    }

    #[test]
    fn an_empty_range_holds_nothing() {
        assert_eq!(peak_held(&[GroupSpec::FullAttention], 4, 8, 8, 0, |_| 0), 0);
    }
}
