//! KV cache groups: which past tokens the layers of one group attend to, or the
//! recurrent state they keep.
//!
//! A hybrid model mixes layer kinds (full attention, sliding windows, chunked local
//! attention, recurrent layers such as Mamba). The engine puts the same number of layers
//! in every group, so that one block id names the same bytes in each group's layers and
//! all groups draw from one pool (see `docs/hybrid-groups.md` for the memory arithmetic).
//! Each sequence keeps one block table per group; an attention group holds only the
//! blocks its future queries can see, a recurrent-state group one block: the state after
//! the sequence's computed tokens.

use std::fmt;

use crate::error::KvError;

/// Most groups a manager takes (a block's group is kept in one byte).
pub const MAX_GROUPS: usize = 64;

/// The attention of one KV cache group's layers, or their recurrent state.
///
/// For the attention kinds the only rule the manager needs is
/// [`GroupSpec::first_visible`]: the first position a query at a given position (or any
/// later one) attends to. Blocks wholly before it are released to the pool (their table
/// entries become the null block), and a prefix hit needs only the blocks from it on.
///
/// A [`GroupSpec::Recurrent`] group keeps no per-token KV: its table entry `j` holds, in
/// one block, the layers' state after the tokens `[0, min(computed, (j + 1) *
/// block_size))` (see [`GroupSpec::state_entry`]), so a sequence holds one block there
/// (plus those a step writes); every `checkpoint_every_blocks`-th full block's state is
/// offered to the prefix cache, and a prefix hit must end on such a boundary.
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
    /// Recurrent layers (Mamba's conv and SSM state): one fixed-size state per sequence,
    /// kept in one block; the state at every `checkpoint_every_blocks`-th block boundary
    /// is cached (vLLM's `"mamba"` kind).
    Recurrent {
        /// Blocks between cached states (`>= 1`): the states after `k * block_size`,
        /// `2 * k * block_size`, ... tokens enter the prefix cache.
        checkpoint_every_blocks: usize,
    },
}

impl GroupSpec {
    /// vLLM's `kv_cache_spec_kind` name: `"full_attention"`, `"sliding_window"`,
    /// `"chunked_local_attention"` or `"mamba"`.
    pub fn kind(self) -> &'static str {
        match self {
            GroupSpec::FullAttention => "full_attention",
            GroupSpec::SlidingWindow { .. } => "sliding_window",
            GroupSpec::ChunkedLocalAttention { .. } => "chunked_local_attention",
            GroupSpec::Recurrent { .. } => "mamba",
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

    /// The blocks between cached states, if this is a recurrent-state group.
    pub fn checkpoint_every_blocks(self) -> Option<usize> {
        match self {
            GroupSpec::Recurrent {
                checkpoint_every_blocks,
            } => Some(checkpoint_every_blocks),
            _ => None,
        }
    }

    /// Whether every earlier token stays visible (nothing is ever released).
    #[inline]
    pub fn is_full(self) -> bool {
        matches!(self, GroupSpec::FullAttention)
    }

    /// Whether this is a recurrent-state group.
    #[inline]
    pub fn is_recurrent(self) -> bool {
        matches!(self, GroupSpec::Recurrent { .. })
    }

    /// The first position a query at `position`, or at any later one, attends to
    /// (non-decreasing in `position`). A recurrent layer attends to no earlier position
    /// (its state summarises them): `position`.
    #[inline]
    pub fn first_visible(self, position: usize) -> usize {
        match self {
            GroupSpec::FullAttention => 0,
            GroupSpec::SlidingWindow { window } => (position + 1).saturating_sub(window),
            GroupSpec::ChunkedLocalAttention { chunk } => position / chunk * chunk,
            GroupSpec::Recurrent { .. } => position,
        }
    }

    /// Leading table entries a group holding `position` computed tokens has released
    /// (`block_size` tokens per block): for attention, the blocks no query at `position`
    /// or later sees; for a recurrent group, every entry before the one holding the
    /// state after `position` tokens ([`GroupSpec::state_entry`]).
    #[inline]
    pub fn released_blocks(self, position: usize, block_size: usize) -> usize {
        match self {
            GroupSpec::FullAttention => 0,
            GroupSpec::Recurrent { .. } => position.div_ceil(block_size).saturating_sub(1),
            _ => self.first_visible(position) / block_size,
        }
    }

    /// Recurrent groups: the table entry holding the state after `position` tokens,
    /// `ceil(position / block_size) - 1` (the block whose tokens end there, filled up to
    /// `position`); `None` for `position == 0` (the initial state, zeros, in no block).
    #[inline]
    pub fn state_entry(position: usize, block_size: usize) -> Option<usize> {
        position.div_ceil(block_size).checked_sub(1)
    }

    /// Recurrent groups: whether table entry `entry` is a checkpoint, a block whose full
    /// state (after `(entry + 1) * block_size` tokens) is cached. `false` for other kinds.
    #[inline]
    pub fn is_checkpoint(self, entry: usize) -> bool {
        match self {
            GroupSpec::Recurrent {
                checkpoint_every_blocks,
            } => (entry + 1) % checkpoint_every_blocks == 0,
            _ => false,
        }
    }

    /// Recurrent groups: the states a step computing tokens `[computed, end)` writes, as
    /// `(table entry, tokens the state covers)` in ascending order: the state at every
    /// checkpoint boundary in `(computed, end]`, then the state after `end` tokens (the
    /// one the next step reads), unless that boundary was the last checkpoint. Empty when
    /// `end <= computed` or for other kinds.
    pub fn state_writes(
        self,
        computed: usize,
        end: usize,
        block_size: usize,
    ) -> impl Iterator<Item = (usize, usize)> {
        let every = self.checkpoint_every_blocks().unwrap_or(0);
        let active = every > 0 && end > computed;
        // Saturating: a checkpoint interval past the address space (2**62 blocks of 8)
        // would wrap to 0; no position reaches such a boundary, only the end is saved.
        let stride = every.max(1).saturating_mul(block_size);
        // Checkpoint boundaries m * stride in (computed, end].
        let first = if active { computed / stride + 1 } else { 1 };
        let last = if active { end / stride } else { 0 };
        let boundaries = (first..=last).map(move |m| (m * every - 1, m * stride));
        let tail = (active && end % stride != 0).then(|| (end.div_ceil(block_size) - 1, end));
        boundaries.chain(tail)
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
            GroupSpec::Recurrent {
                checkpoint_every_blocks: 0,
            } => Err(KvError::InvalidArgument(
                "a recurrent group's checkpoint_every_blocks must be >= 1, got 0".to_string(),
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
            GroupSpec::Recurrent {
                checkpoint_every_blocks,
            } => write!(
                f,
                "recurrent(checkpoint_every_blocks={checkpoint_every_blocks})"
            ),
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
    fn a_recurrent_group_keeps_the_state_at_the_last_entry() {
        let r2 = GroupSpec::Recurrent {
            checkpoint_every_blocks: 2,
        };
        assert_eq!(r2.kind(), "mamba");
        // Entry ceil(p / bs) - 1 holds the state after p tokens; entries before it go.
        assert_eq!(GroupSpec::state_entry(0, 4), None);
        assert_eq!(GroupSpec::state_entry(1, 4), Some(0));
        assert_eq!(GroupSpec::state_entry(4, 4), Some(0));
        assert_eq!(GroupSpec::state_entry(5, 4), Some(1));
        let released: Vec<usize> = [0, 1, 4, 5, 8, 9]
            .iter()
            .map(|&p| r2.released_blocks(p, 4))
            .collect();
        assert_eq!(released, vec![0, 0, 0, 1, 1, 2]);
        assert!(!r2.is_checkpoint(0) && r2.is_checkpoint(1) && r2.is_checkpoint(3));
        assert!(!GroupSpec::FullAttention.is_checkpoint(1));
    }

    #[test]
    fn a_step_writes_every_checkpoint_it_crosses_and_its_end() {
        let r2 = GroupSpec::Recurrent {
            checkpoint_every_blocks: 2,
        };
        let w = |c, e| r2.state_writes(c, e, 4).collect::<Vec<_>>();
        // Checkpoints at 8, 16, 24 tokens (entries 1, 3, 5).
        assert_eq!(w(0, 5), vec![(1, 5)]);
        assert_eq!(w(0, 8), vec![(1, 8)]);
        assert_eq!(w(0, 20), vec![(1, 8), (3, 16), (4, 20)]);
        assert_eq!(w(8, 9), vec![(2, 9)]);
        assert_eq!(w(5, 6), vec![(1, 6)]);
        assert_eq!(w(7, 8), vec![(1, 8)]);
        assert_eq!(w(7, 7), vec![]);
        assert_eq!(w(3, 16), vec![(1, 8), (3, 16)]);
        let r1 = GroupSpec::Recurrent {
            checkpoint_every_blocks: 1,
        };
        let w1: Vec<_> = r1.state_writes(2, 9, 4).collect();
        assert_eq!(w1, vec![(0, 4), (1, 8), (2, 9)]);
        assert_eq!(GroupSpec::FullAttention.state_writes(0, 9, 4).count(), 0);
    }

    #[test]
    fn zero_sizes_are_refused() {
        assert!(GroupSpec::Recurrent {
            checkpoint_every_blocks: 0
        }
        .validate()
        .is_err());
        assert!(GroupSpec::SlidingWindow { window: 0 }.validate().is_err());
        assert!(GroupSpec::ChunkedLocalAttention { chunk: 0 }
            .validate()
            .is_err());
        assert!(GroupSpec::SlidingWindow { window: 1 }.validate().is_ok());
    }
}
