//! Construction parameters of a manager and the hash algorithm choice.

use std::fmt;
use std::str::FromStr;

use crate::error::KvError;
use crate::group::{GroupSpec, MAX_GROUPS};

/// Content hash used for the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgo {
    /// BLAKE3, full 32-byte digest (cryptographic; safe for multi-tenant caches).
    #[default]
    Blake3,
    /// xxh3-128, 16-byte digest (faster, not collision resistant against adversaries).
    Xxh3_128,
    /// vLLM's `sha256_cbor`: SHA-256 of the canonical CBOR encoding of
    /// `(parent_hash, tuple(token_ids), extra_keys)`, 32-byte digest. Bit-for-bit the
    /// hashes vLLM computes, so routers that hash prompts the vLLM way match kvblocks.
    Sha256Cbor,
}

/// The seed vLLM derives its first block's parent (`NONE_HASH`) from when
/// `PYTHONHASHSEED` is not set and the hash is cryptographic
/// (`vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED`).
pub const VLLM_DEFAULT_HASH_SEED: &str = "vllm-none-hash";

impl HashAlgo {
    /// The name used by the Python API (`"blake3"` / `"xxh3_128"`).
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Blake3 => "blake3",
            HashAlgo::Xxh3_128 => "xxh3_128",
            HashAlgo::Sha256Cbor => "sha256_cbor",
        }
    }

    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Blake3 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::Xxh3_128 => 16,
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "blake3" => Ok(HashAlgo::Blake3),
            "xxh3_128" => Ok(HashAlgo::Xxh3_128),
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            other => Err(KvError::InvalidArgument(format!(
                "hash_algo must be \"blake3\", \"xxh3_128\" or \"sha256_cbor\", got {other:?}"
            ))),
        }
    }
}

/// A seed is `sha256_cbor`'s only (the other algorithms have no `NONE_HASH`).
pub(crate) fn check_hash_seed(algo: HashAlgo, seed: Option<&str>) -> Result<(), KvError> {
    if seed.is_some() && algo != HashAlgo::Sha256Cbor {
        return Err(KvError::InvalidArgument(format!(
            "hash_seed applies to hash_algo=\"sha256_cbor\" only, not {:?}",
            algo.as_str()
        )));
    }
    Ok(())
}

/// Largest pool (GPU or CPU) a manager accepts: 2**26 blocks, far beyond any real KV
/// cache, small enough that the per-block bookkeeping always fits in host memory.
pub const MAX_BLOCKS: usize = 1 << 26;

/// Largest `block_size` (tokens per block) a manager, and so a hasher that must agree with
/// one, accepts: 2**20.
pub const MAX_BLOCK_SIZE: usize = 1 << 20;

/// `block_size` in `[1, MAX_BLOCK_SIZE]`, or the error every constructor gives.
pub fn check_block_size(block_size: usize) -> Result<(), KvError> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return Err(KvError::InvalidArgument(format!(
            "block_size must be in [1, 2**20], got {block_size}"
        )));
    }
    Ok(())
}

/// Parameters of [`crate::KVCacheManager::new`]; mirrors the Python constructor.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagerConfig {
    /// GPU blocks in the pool, the null block included (so `>= 2`).
    pub num_blocks: usize,
    /// Tokens per block (`>= 1`).
    pub block_size: usize,
    /// Blocks of the CPU pool used by swap_out/swap_in (no null block there).
    pub num_cpu_blocks: usize,
    /// Share full blocks between sequences by content hash.
    pub enable_prefix_caching: bool,
    /// Hash algorithm of the prefix cache.
    pub hash_algo: HashAlgo,
    /// `sha256_cbor` only: the seed of vLLM's `NONE_HASH` (the first block's parent),
    /// `sha256_cbor(seed)`; `None` is vLLM's fixed default [`VLLM_DEFAULT_HASH_SEED`].
    /// vLLM takes it from `PYTHONHASHSEED` when set; the Python binding does the same.
    pub hash_seed: Option<String>,
    /// Fraction of GPU blocks kept free at admission, in `[0, 1)`.
    pub watermark: f64,
    /// Attention window in tokens (`>= 1`), if any: short for one sliding-window group
    /// (only without `groups`).
    pub sliding_window: Option<usize>,
    /// The KV cache groups, all drawing from the one pool (see [`crate::GroupSpec`]);
    /// empty: one group, full attention or the `sliding_window`.
    pub groups: Vec<GroupSpec>,
    /// Queue KV cache events for `take_events` (default true). Events accumulate until
    /// drained, so a deployment that never calls `take_events` should turn this off
    /// (as vLLM's `enable_kv_cache_events`); caching itself is unaffected.
    pub record_events: bool,
    /// Slots of the host tier below the GPU pool (0: no tier; see `crate::host_tier`).
    pub host_cache_blocks: usize,
    /// When blocks are copied to the host tier.
    pub host_offload: crate::host_tier::OffloadPolicy,
}

impl ManagerConfig {
    /// A config with the Python defaults for everything but the pool shape.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        ManagerConfig {
            num_blocks,
            block_size,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            hash_algo: HashAlgo::Blake3,
            hash_seed: None,
            watermark: 0.01,
            sliding_window: None,
            groups: Vec::new(),
            record_events: true,
            host_cache_blocks: 0,
            host_offload: crate::host_tier::OffloadPolicy::OnEvict,
        }
    }

    /// The groups the manager keeps: `groups`, or the one group `sliding_window` names.
    pub fn resolved_groups(&self) -> Vec<GroupSpec> {
        if !self.groups.is_empty() {
            return self.groups.clone();
        }
        vec![match self.sliding_window {
            Some(window) => GroupSpec::SlidingWindow { window },
            None => GroupSpec::FullAttention,
        }]
    }

    /// Check every field; the manager is built only from a valid config.
    pub fn validate(&self) -> Result<(), KvError> {
        if self.num_blocks < 2 {
            return Err(KvError::InvalidArgument(format!(
                "num_blocks must be >= 2 (block 0 is the reserved null block), got {}",
                self.num_blocks
            )));
        }
        if self.num_blocks > MAX_BLOCKS || self.num_cpu_blocks > MAX_BLOCKS {
            return Err(KvError::InvalidArgument(format!(
                "num_blocks and num_cpu_blocks must be <= {MAX_BLOCKS} (the manager keeps 13 \
                 bytes of host memory per block, plus up to ~80 per GPU block with prefix \
                 caching), got {} and {}",
                self.num_blocks, self.num_cpu_blocks
            )));
        }
        check_block_size(self.block_size)?;
        if (self.num_blocks as u128) * (self.block_size as u128) > i64::MAX as u128 {
            return Err(KvError::InvalidArgument(
                "num_blocks * block_size must fit in int64 cache slots".to_string(),
            ));
        }
        if !(self.watermark >= 0.0 && self.watermark < 1.0) {
            return Err(KvError::InvalidArgument(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        check_hash_seed(self.hash_algo, self.hash_seed.as_deref())?;
        if self.host_cache_blocks > MAX_BLOCKS {
            return Err(KvError::InvalidArgument(format!(
                "host_cache_blocks must be <= {MAX_BLOCKS}, got {}",
                self.host_cache_blocks
            )));
        }
        if self.host_cache_blocks > 0 && !self.enable_prefix_caching {
            return Err(KvError::InvalidArgument(
                "host_cache_blocks > 0 needs enable_prefix_caching=True (the host tier is keyed \
                 by block hash)"
                    .to_string(),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(KvError::InvalidArgument(
                "sliding_window must be >= 1 tokens or None, got 0".to_string(),
            ));
        }
        if !self.groups.is_empty() && self.sliding_window.is_some() {
            return Err(KvError::InvalidArgument(
                "sliding_window is short for groups=[a sliding-window group]; give the window \
                 in groups instead of both"
                    .to_string(),
            ));
        }
        if self.groups.len() > MAX_GROUPS {
            return Err(KvError::InvalidArgument(format!(
                "at most {MAX_GROUPS} KV cache groups, got {}",
                self.groups.len()
            )));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if let Err(KvError::InvalidArgument(msg)) = g.validate() {
                return Err(KvError::InvalidArgument(format!("groups[{i}]: {msg}")));
            }
        }
        Ok(())
    }
}
