//! KV cache groups: which past tokens the layers of one group attend to.
//!
//! A hybrid model mixes layer kinds (full attention, sliding windows, chunked local
//! attention). The engine puts the same number of layers in every group, so that one
//! block id names the same bytes in each group's layers and all groups draw from one
//! pool (see `docs/hybrid-groups.md` for the memory arithmetic). Each sequence keeps one
//! block table per group; a group holds only the blocks its future queries can see.

use std::fmt;

use crate::error::KvError;

/// Most groups a manager takes (a block's group is kept in one byte).
pub const MAX_GROUPS: usize = 64;

/// The attention of one KV cache group's layers.
///
/// The only rule the manager needs is [`GroupSpec::first_visible`]: the first position a
/// query at a given position (or any later one) attends to. Blocks wholly before it are
/// released to the pool (their table entries become the null block), and a prefix hit
/// needs only the blocks from it on. A recurrent-state kind (one fixed-size state per
/// sequence) is another variant with its own rule, not a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GroupSpec {
    /// Every earlier token.
    #[default]
    FullAttention,
    /// The last `window` tokens: a query at `p` sees `[p - window + 1, p]`.
    SlidingWindow {
        /// Tokens in the window (`>= 1`, the query's own included).
        window: usize,
    },
    /// The query's own chunk: a query at `p` sees `[p / chunk * chunk, p]`.
    ChunkedLocalAttention {
        /// Tokens per chunk (`>= 1`).
        chunk: usize,
    },
}

impl GroupSpec {
    /// vLLM's `kv_cache_spec_kind` name: `"full_attention"`, `"sliding_window"` or
    /// `"chunked_local_attention"`.
    pub fn kind(self) -> &'static str {
        match self {
            GroupSpec::FullAttention => "full_attention",
            GroupSpec::SlidingWindow { .. } => "sliding_window",
            GroupSpec::ChunkedLocalAttention { .. } => "chunked_local_attention",
        }
    }

    /// The sliding window in tokens, if this is a window group.
    pub fn sliding_window(self) -> Option<usize> {
        match self {
            GroupSpec::SlidingWindow { window } => Some(window),
            _ => None,
        }
    }

    /// The chunk size in tokens, if this is a chunked local group.
    pub fn chunk_size(self) -> Option<usize> {
        match self {
            GroupSpec::ChunkedLocalAttention { chunk } => Some(chunk),
            _ => None,
        }
    }

    /// Whether every earlier token stays visible (nothing is ever released).
    #[inline]
    pub fn is_full(self) -> bool {
        matches!(self, GroupSpec::FullAttention)
    }

    /// The first position a query at `position`, or at any later one, attends to
    /// (non-decreasing in `position`).
    #[inline]
    pub fn first_visible(self, position: usize) -> usize {
        match self {
            GroupSpec::FullAttention => 0,
            GroupSpec::SlidingWindow { window } => (position + 1).saturating_sub(window),
            GroupSpec::ChunkedLocalAttention { chunk } => position / chunk * chunk,
        }
    }

    /// Leading blocks no query at `position` or later sees: the blocks a group holding
    /// `position` computed tokens has released (`block_size` tokens per block).
    #[inline]
    pub fn released_blocks(self, position: usize, block_size: usize) -> usize {
        match self {
            GroupSpec::FullAttention => 0,
            _ => self.first_visible(position) / block_size,
        }
    }

    /// Check the spec's size.
    pub fn validate(self) -> Result<(), KvError> {
        match self {
            GroupSpec::SlidingWindow { window: 0 } => Err(KvError::InvalidArgument(
                "a sliding window must be >= 1 tokens, got 0".to_string(),
            )),
            GroupSpec::ChunkedLocalAttention { chunk: 0 } => Err(KvError::InvalidArgument(
                "a chunked local attention chunk must be >= 1 tokens, got 0".to_string(),
            )),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for GroupSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            GroupSpec::FullAttention => f.write_str("full_attention"),
            GroupSpec::SlidingWindow { window } => write!(f, "sliding_window({window})"),
            GroupSpec::ChunkedLocalAttention { chunk } => {
                write!(f, "chunked_local_attention({chunk})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GroupSpec;

    #[test]
    fn first_visible_follows_each_rule() {
        let full = GroupSpec::FullAttention;
        let w3 = GroupSpec::SlidingWindow { window: 3 };
        let c4 = GroupSpec::ChunkedLocalAttention { chunk: 4 };
        assert_eq!((0..9).map(|p| full.first_visible(p)).max(), Some(0));
        let w: Vec<usize> = (0..7).map(|p| w3.first_visible(p)).collect();
        assert_eq!(w, vec![0, 0, 0, 1, 2, 3, 4]);
        let c: Vec<usize> = (0..9).map(|p| c4.first_visible(p)).collect();
        assert_eq!(c, vec![0, 0, 0, 0, 4, 4, 4, 4, 8]);
        // A window of one sees only the query itself.
        assert_eq!(GroupSpec::SlidingWindow { window: 1 }.first_visible(5), 5);
        // Released blocks: wholly before the first visible position.
        assert_eq!(w3.released_blocks(9, 2), 3); // visible from 7: blocks 0..3 gone
        assert_eq!(c4.released_blocks(9, 3), 2); // chunk starts at 8: blocks 0, 1 gone
        assert_eq!(full.released_blocks(100, 1), 0);
    }

    #[test]
    fn zero_sizes_are_refused() {
        assert!(GroupSpec::SlidingWindow { window: 0 }.validate().is_err());
        assert!(GroupSpec::ChunkedLocalAttention { chunk: 0 }
            .validate()
            .is_err());
        assert!(GroupSpec::SlidingWindow { window: 1 }.validate().is_ok());
    }
}
