//! Answer of an admission check.

/// Answer of [`crate::KVCacheManager::can_allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocStatus {
    /// Enough free blocks now, with the watermark kept free.
    Ok = 0,
    /// Not enough free blocks now; may fit once others finish.
    Later = 1,
    /// Can never fit: needs more blocks than the pool minus the watermark.
    Never = 2,
}

impl AllocStatus {
    /// Upper-case name as in the Python API (`"OK"`, `"LATER"`, `"NEVER"`).
    pub fn name(self) -> &'static str {
        match self {
            AllocStatus::Ok => "OK",
            AllocStatus::Later => "LATER",
            AllocStatus::Never => "NEVER",
        }
    }
}
