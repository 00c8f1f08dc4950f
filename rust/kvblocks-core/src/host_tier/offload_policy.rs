//! [`OffloadPolicy`]: when full GPU blocks are copied to the host tier.

/// When full GPU blocks are copied to the host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadPolicy {
    /// When a cached GPU block is evicted for reuse (before it is overwritten): only
    /// blocks that would otherwise be lost are copied.
    #[default]
    OnEvict,
    /// When a block enters the GPU prefix cache at `commit`: every cached block is
    /// copied once, and eviction needs no copy.
    WriteThrough,
}

impl OffloadPolicy {
    /// The Python name (`"evict"` / `"commit"`).
    pub fn as_str(self) -> &'static str {
        match self {
            OffloadPolicy::OnEvict => "evict",
            OffloadPolicy::WriteThrough => "commit",
        }
    }
}

impl std::str::FromStr for OffloadPolicy {
    type Err = crate::KvError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "evict" => Ok(OffloadPolicy::OnEvict),
            "commit" => Ok(OffloadPolicy::WriteThrough),
            other => Err(crate::KvError::InvalidArgument(format!(
                "host_offload must be \"evict\" or \"commit\", got {other:?}"
            ))),
        }
    }
}
