//! Content hashes of full blocks: the prefix-cache key.
//!
//! See [`BlockHasher`] for the encoding. The digest type is here; the hasher (BLAKE3 and
//! xxh3-128, the namespace cache, the chains of a prompt) is in `hasher`, vLLM's
//! `sha256_cbor` encoding in `vllm`.

mod hasher;
#[cfg(test)]
mod tests;
mod vllm;

use std::fmt;
use std::hash::{Hash, Hasher};

pub use hasher::BlockHasher;

/// A digest (32 bytes for BLAKE3 and SHA-256, 16 for xxh3-128), stored inline.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct BlockHash {
    bytes: [u8; 32],
    len: u8,
}

impl BlockHash {
    /// The digest bytes (16 or 32 of them).
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// A digest given as bytes (e.g. read back from a remote store): `None` unless it has
    /// 16 or 32 bytes.
    pub fn from_digest(digest: &[u8]) -> Option<Self> {
        matches!(digest.len(), 16 | 32).then(|| Self::from_slice(digest))
    }

    fn from_slice(digest: &[u8]) -> Self {
        let mut bytes = [0u8; 32];
        bytes[..digest.len()].copy_from_slice(digest);
        BlockHash {
            bytes,
            len: digest.len() as u8,
        }
    }
}

impl Hash for BlockHash {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The digest is already uniformly distributed: its first 8 bytes are a
        // perfectly good hash-map key, no need to feed all 32 bytes to the hasher.
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.bytes[..8]);
        state.write_u64(u64::from_le_bytes(head));
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
