//! The prefix hit: the longest prefix of whole blocks that every KV cache group serves.
//!
//! A hit of `k` blocks means the sequence's next query sits at position `k * bs`. Group
//! `g` can serve it when it has cached (in the GPU prefix cache or written in the host
//! tier) every block that query sees: blocks `[released_blocks(k * bs), k)` of its spec
//! (all `k` blocks for full attention; those covering the last `W - 1` tokens for a
//! window of `W`; the current chunk's for chunked local attention). Blocks before are
//! not needed: the claim puts the null block there. A recurrent-state group needs the
//! state after the `k * bs` tokens: its block `k - 1`, cached only when `k` is a multiple
//! of its `checkpoint_every_blocks` (the candidate shortens to the last cached
//! checkpoint boundary at or below it).
//!
//! Full attention is downward closed (if `k` works, every smaller `k` does), so its
//! longest hit is one left-to-right scan. The other kinds are not (a window group may
//! serve `k` and not `k - 1`), so the hit is found as a fixed point: starting from the
//! longest candidate, each group lowers it to the longest length `<=` it that the group
//! serves, until no group lowers it. Every length a group rejects is rejected by it for
//! good, and the longest length all groups serve is never skipped, so the fixed point is
//! that longest length. A group's search scans its blocks right to left and jumps below
//! the highest missing block it meets, so it reads each block at most once per round.

use super::pools::Pools;
use crate::block_hash::BlockHash;
use std::ops::Range;

impl Pools {
    /// Whether block `hash` of `group` can be claimed: in the GPU prefix cache or written
    /// in the host tier.
    #[inline]
    fn is_hit(&self, group: usize, hash: &BlockHash) -> bool {
        self.cache.lookup(group, hash).is_some()
            || self
                .tier
                .as_ref()
                .is_some_and(|t| t.lookup_ready(group, hash).is_some())
    }

    /// Blocks of `group` a hit of `n` blocks claims (the ones before are null).
    #[inline]
    pub fn hit_range(&self, group: usize, n: usize) -> Range<usize> {
        let bs = self.block_size;
        self.groups[group].released_blocks(n * bs, bs).min(n)..n
    }

    /// Leading blocks of `hashes` that `group` has cached.
    #[inline]
    fn leading(&self, group: usize, hashes: &[BlockHash]) -> usize {
        match &self.tier {
            None => hashes
                .iter()
                .take_while(|h| self.cache.lookup(group, h).is_some())
                .count(),
            Some(tier) => hashes
                .iter()
                .take_while(|h| {
                    self.cache.lookup(group, h).is_some() || tier.lookup_ready(group, h).is_some()
                })
                .count(),
        }
    }

    /// The longest hit `<= k` blocks that `group` serves on its own.
    fn longest_served(&self, group: usize, hashes: &[BlockHash], mut k: usize) -> usize {
        if let Some(every) = self.groups[group].checkpoint_every_blocks() {
            // A recurrent group serves a hit only on a checkpoint boundary whose state
            // it cached (or no hit): the last such boundary at or below k.
            k -= k % every;
            while k > 0 && !self.is_hit(group, &hashes[k - 1]) {
                k -= every;
            }
            return k;
        }
        'candidate: loop {
            let range = self.hit_range(group, k);
            for i in range.rev() {
                if !self.is_hit(group, &hashes[i]) {
                    // No length above i can be served: each needs block i.
                    k = i;
                    continue 'candidate;
                }
            }
            return k;
        }
    }

    /// Leading blocks of the hash chain a claim serves now, at most `cap`: the longest
    /// hit every group serves (see the module docs).
    #[inline]
    pub fn probe(&self, hashes: &[BlockHash], cap: usize) -> usize {
        if !self.caching {
            return 0;
        }
        let mut k = cap.min(hashes.len());
        for (g, spec) in self.groups.iter().enumerate() {
            if spec.is_full() {
                k = self.leading(g, &hashes[..k]);
            }
        }
        if self.all_full {
            return k;
        }
        loop {
            let before = k;
            for (g, spec) in self.groups.iter().enumerate() {
                if !spec.is_full() {
                    k = self.longest_served(g, hashes, k);
                }
            }
            if k == before {
                return k;
            }
        }
    }

    /// Of a hit of `n` blocks, the blocks claimed from the host tier (not in the GPU
    /// cache), over all groups: the loads a claim would queue.
    #[inline]
    pub fn probe_tier(&self, hashes: &[BlockHash], n: usize) -> usize {
        if self.tier.is_none() {
            return 0;
        }
        (0..self.groups.len())
            .map(|g| {
                hashes[self.hit_range(g, n)]
                    .iter()
                    .filter(|h| self.cache.lookup(g, h).is_none())
                    .count()
            })
            .sum()
    }

    /// Of a hit of `n` blocks, the block positions some group loads from the host tier
    /// (the tokens counted as served by the tier).
    pub fn tier_positions(&self, hashes: &[BlockHash], n: usize) -> usize {
        if self.tier.is_none() {
            return 0;
        }
        if self.groups.len() == 1 {
            return self.probe_tier(hashes, n);
        }
        (0..n)
            .filter(|&i| {
                (0..self.groups.len()).any(|g| {
                    self.hit_range(g, n).contains(&i) && self.cache.lookup(g, &hashes[i]).is_none()
                })
            })
            .count()
    }

    /// Of a hit of `n` blocks, the GPU-cached blocks claimed that sit in the free queue,
    /// over all groups (a claim takes them out of the pool).
    #[inline]
    pub fn probe_free(&self, hashes: &[BlockHash], n: usize) -> usize {
        (0..self.groups.len())
            .map(|g| {
                hashes[self.hit_range(g, n)]
                    .iter()
                    .filter(|h| {
                        self.cached_block(g, h)
                            .is_some_and(|b| self.gpu.ref_count(b) == 0)
                    })
                    .count()
            })
            .sum()
    }

    /// The longest hit `<= hit` (itself a hit) whose claim loads at most `max_loads`
    /// blocks from the host tier.
    pub fn limit_loads(&self, hashes: &[BlockHash], hit: usize, max_loads: usize) -> usize {
        if self.tier.is_none() {
            return hit;
        }
        if self.all_full {
            // Every group claims every block: the loads grow with the cut, so the cut is
            // right before the block whose loads exceed the limit.
            let mut loads = 0;
            for (i, h) in hashes[..hit].iter().enumerate() {
                let here = (0..self.groups.len())
                    .filter(|&g| self.cache.lookup(g, h).is_none())
                    .count();
                if loads + here > max_loads {
                    return i;
                }
                loads += here;
            }
            return hit;
        }
        // A window group's loads are not monotone in the cut: try shorter hits until one
        // fits (a hit of 0 blocks loads nothing).
        let mut k = hit;
        while k > 0 && self.probe_tier(hashes, k) > max_loads {
            k = self.probe(hashes, k - 1);
        }
        k
    }
}
