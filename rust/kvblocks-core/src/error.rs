//! The single error type of the core.

use thiserror::Error;

/// Everything that can go wrong in a [`crate::KVCacheManager`] call.
///
/// A call that returns an error leaves the manager exactly as it was (free-queue
/// order included): every operation checks all its preconditions before mutating.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    /// An argument is out of range or inconsistent with the sequence.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A block pool cannot serve the request.
    #[error("out of blocks: {0}")]
    OutOfBlocks(String),
    /// The sequence id is not held by the manager.
    #[error("unknown sequence id {0}")]
    UnknownSequence(u64),
    /// The sequence id is already held by the manager.
    #[error("sequence id {0} already exists")]
    DuplicateSequence(u64),
    /// The operation is not allowed in the sequence's current state.
    #[error("sequence state: {0}")]
    SequenceState(String),
    /// An internal invariant does not hold (a bug, reported by `check_invariants`).
    #[error("invariant violated: {0}")]
    InvariantViolation(String),
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, KvError>;
