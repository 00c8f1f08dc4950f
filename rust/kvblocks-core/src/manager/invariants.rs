//! The structural invariant checker.

use super::KVCacheManager;
use crate::error::Result;

impl KVCacheManager {
    /// Verify every structural invariant; `InvariantViolation` names the first that fails.
    pub fn check_invariants(&self) -> Result<()> {
        todo!()
    }
}
