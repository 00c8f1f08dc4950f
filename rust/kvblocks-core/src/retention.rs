//! Retention priorities: which cached blocks are kept when the GPU pool or the host tier
//! is full.

use crate::error::{KvError, Result};

/// A sequence's retention priority, `0..=100` (TensorRT-LLM's scale, default 35).
///
/// The blocks a sequence commits or claims carry its priority (the highest one when
/// several sequences share a block); the GPU free queue and the host tier evict the
/// lowest priority first and the least recently used block among equals, and an offload
/// of lower priority than every evictable tier block is skipped. A newtype so an
/// unchecked integer never reaches the queues: [`RetentionPriority::new`] is the only way
/// in from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RetentionPriority(u8);

impl RetentionPriority {
    /// The lowest priority (evicted first).
    pub const MIN: Self = RetentionPriority(0);
    /// The highest priority (evicted last).
    pub const MAX: Self = RetentionPriority(100);
    /// The default, TensorRT-LLM's.
    pub const DEFAULT: Self = RetentionPriority(35);

    /// A priority in `0..=100`; `InvalidArgument` otherwise.
    pub fn new(value: i64) -> Result<Self> {
        if (0..=i64::from(Self::MAX.0)).contains(&value) {
            Ok(RetentionPriority(value as u8))
        } else {
            Err(KvError::InvalidArgument(format!(
                "retention_priority must be in [0, 100], got {value}"
            )))
        }
    }

    /// The value, `0..=100`.
    #[inline]
    pub fn get(self) -> u8 {
        self.0
    }
}

impl Default for RetentionPriority {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_is_checked() {
        assert_eq!(RetentionPriority::new(0).unwrap(), RetentionPriority::MIN);
        assert_eq!(RetentionPriority::new(100).unwrap().get(), 100);
        assert_eq!(RetentionPriority::default().get(), 35);
        assert!(RetentionPriority::new(101).is_err());
        assert!(RetentionPriority::new(-1).is_err());
    }
}
