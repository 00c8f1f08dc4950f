//! [`Medium`]: where a block lives, as KV events name it.

/// Where a block lives, for the `medium` of KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Medium {
    /// The GPU pool's prefix cache.
    #[default]
    Gpu,
    /// The host tier.
    Cpu,
}

impl Medium {
    /// vLLM's medium names (`"GPU"`, `"CPU"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}
