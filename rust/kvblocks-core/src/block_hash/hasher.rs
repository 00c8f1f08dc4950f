//! [`BlockHasher`]: the namespaces of extra keys and the chained hashes of full blocks,
//! with BLAKE3 and xxh3-128 (vLLM's `sha256_cbor` is in the `vllm` module).

use sha2::{Digest, Sha256};

use super::vllm::VllmKeys;
use super::BlockHash;
use crate::cbor;
use crate::config::{check_hash_seed, HashAlgo, VLLM_DEFAULT_HASH_SEED};
use crate::error::KvError;

const BLOCK_TAG: &[u8] = b"kvblocks/block/v1";
const NAMESPACE_TAG: &[u8] = b"kvblocks/namespace/v1";
const BLAKE3_NAMESPACE_CONTEXT: &str = "kvblocks 2026 namespace v1";

/// Computes block and namespace hashes with one algorithm, reusing a scratch buffer.
///
/// Every field is tagged and length-prefixed (or sits in a fixed-size slot of the hash
/// function) so that no two different field sequences can feed the same input to the
/// hash function. The extra keys are encoded once per sequence into a *namespace*:
///
/// ```text
/// extra = salt: 0x00 | 0x01 len:u64le bytes     (None and b"" differ)
///         lora: 0x00 | 0x01 id:u64le            (None and Some(0) differ)
/// ```
///
/// * BLAKE3: namespace = `derive_key("kvblocks 2026 namespace v1", extra)`, a 32-byte key;
///   hash = `keyed_hash(key, token:u32le*)` where the key is the parent block's digest,
///   or the namespace for the first block. The parent rides in BLAKE3's 32-byte key slot
///   and the token count in BLAKE3's own length encoding, so a 16-token block (64 bytes)
///   is exactly one compression. A first block and a child block cannot be confused: the
///   one's key is a `derive_key` output, the other's a `keyed_hash` output (different
///   domain flags), and the chain of keys carries the namespace to every block.
/// * xxh3-128 (no key input): namespace = `xxh3_128("kvblocks/namespace/v1" extra)`;
///   hash = `xxh3_128("kvblocks/block/v1" 0x10 namespace block)` with
///
///   ```text
///   block = parent: 0x00                        (first block of a sequence)
///                 | 0x01 len:u8 parent-digest   (otherwise)
///           tokens: count:u32le token:u32le*
///   ```
///
/// So blocks of different salts or LoRA ids never share a hash.
///
/// * sha256_cbor is vLLM's block hash, bit for bit (`hash_block_tokens` with
///   `sha256_cbor` in `vllm/v1/core/kv_cache_utils.py`):
///
///   ```text
///   hash = sha256(cbor((parent or NONE_HASH, tuple(tokens), extra_keys)))
///   NONE_HASH = sha256(cbor(seed))      seed: PYTHONHASHSEED or "vllm-none-hash"
///   extra_keys = None | (("lora", name, path)?, ("cache_salt", salt)?)
///   ```
///
///   with canonical CBOR (`cbor2.dumps(x, canonical=True)`, see [`crate::cbor`]). The
///   cache salt is a key of the first block only (an empty salt is none), and the LoRA
///   key carries the adapter's *name and path*, not its id: a LoRA id must be mapped
///   with [`BlockHasher::register_lora`] first. The namespace is then a SHA-256 digest
///   of the two encoded extra keys (first block, later blocks), which the hasher keeps
///   in a table to encode each block: one entry per distinct (salt, LoRA) pair hashed.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    pub(super) algo: HashAlgo,
    pub(super) buf: Vec<u8>,
    /// Namespace of no salt and no LoRA id, derived once: most sequences use it, and
    /// deriving a BLAKE3 key costs two compressions.
    default_namespace: BlockHash,
    /// The last other namespace derived, with its extra keys (requests of one tenant or
    /// adapter tend to arrive together).
    recent: Option<RecentNamespace>,
    /// vLLM's extra state, for `sha256_cbor` only (boxed: the other algorithms pay one
    /// pointer for it).
    pub(super) vllm: Option<Box<VllmKeys>>,
}

/// A derived namespace with the extra keys it was derived from.
#[derive(Debug, Clone)]
struct RecentNamespace {
    cache_salt: Option<Box<[u8]>>,
    lora_id: Option<u64>,
    namespace: BlockHash,
}

impl PartialEq for BlockHasher {
    fn eq(&self, other: &Self) -> bool {
        // The scratch buffer and the namespace caches are not state.
        self.algo == other.algo && self.none_hash() == other.none_hash()
    }
}

impl BlockHasher {
    /// A hasher for `algo` (with vLLM's default seed for `sha256_cbor`).
    pub fn new(algo: HashAlgo) -> Self {
        Self::with_seed(algo, None)
    }

    /// A hasher for `algo`; `sha256_cbor` derives vLLM's `NONE_HASH` from `seed`
    /// (`None`: vLLM's default, [`VLLM_DEFAULT_HASH_SEED`]). Other algorithms ignore it.
    pub fn with_seed(algo: HashAlgo, seed: Option<&str>) -> Self {
        let vllm = (algo == HashAlgo::Sha256Cbor).then(|| {
            let mut buf = Vec::new();
            cbor::push_text(&mut buf, seed.unwrap_or(VLLM_DEFAULT_HASH_SEED));
            Box::new(VllmKeys {
                none_hash: Sha256::digest(&buf).into(),
                ..VllmKeys::default()
            })
        });
        let mut hasher = BlockHasher {
            algo,
            buf: Vec::with_capacity(256),
            default_namespace: BlockHash::default(),
            recent: None,
            vllm,
        };
        // No salt and no LoRA is a valid namespace for every algorithm.
        hasher.default_namespace = hasher.derive_namespace(None, None).unwrap_or_default();
        hasher
    }

    /// [`BlockHasher::with_seed`] that refuses a seed for an algorithm without one, as
    /// the manager's configuration does.
    pub fn checked(algo: HashAlgo, seed: Option<&str>) -> Result<Self, KvError> {
        check_hash_seed(algo, seed)?;
        Ok(Self::with_seed(algo, seed))
    }

    /// vLLM's `NONE_HASH` (`sha256_cbor` only): the parent hash of first blocks.
    pub fn none_hash(&self) -> Option<&[u8; 32]> {
        self.vllm.as_ref().map(|v| &v.none_hash)
    }

    /// Map `lora_id` to vLLM's LoRA key, the adapter's `lora_name` and `lora_path` (as
    /// in vLLM's `LoRARequest`). Only `sha256_cbor` hashes these; for the other
    /// algorithms the id itself is the key and this does nothing. Re-mapping an id
    /// affects namespaces derived afterwards.
    pub fn register_lora(&mut self, lora_id: u64, lora_name: &str, lora_path: &str) {
        let Some(vllm) = self.vllm.as_mut() else {
            return;
        };
        let mut key = Vec::new();
        cbor::push_array(&mut key, 3);
        cbor::push_text(&mut key, "lora");
        cbor::push_text(&mut key, lora_name);
        cbor::push_text(&mut key, lora_path);
        vllm.loras.insert(lora_id, key.into());
        if self
            .recent
            .as_ref()
            .is_some_and(|r| r.lora_id == Some(lora_id))
        {
            self.recent = None;
        }
    }

    /// The algorithm in use.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    fn xxh3_buf(&self) -> BlockHash {
        BlockHash::from_slice(&xxhash_rust::xxh3::xxh3_128(&self.buf).to_le_bytes())
    }

    /// Digest of a sequence's extra keys (cache salt and LoRA id).
    ///
    /// Errors (`sha256_cbor` only, where vLLM's keys are text): a cache salt that is not
    /// UTF-8, or a LoRA id without [`BlockHasher::register_lora`].
    pub fn namespace(
        &mut self,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<BlockHash, KvError> {
        if cache_salt.is_none() && lora_id.is_none() {
            return Ok(self.default_namespace);
        }
        if let Some(r) = &self.recent {
            if r.cache_salt.as_deref() == cache_salt && r.lora_id == lora_id {
                return Ok(r.namespace);
            }
        }
        let namespace = self.derive_namespace(cache_salt, lora_id)?;
        self.recent = Some(RecentNamespace {
            cache_salt: cache_salt.map(Box::from),
            lora_id,
            namespace,
        });
        Ok(namespace)
    }

    /// Compute the namespace digest (no cache).
    pub(super) fn derive_namespace(
        &mut self,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<BlockHash, KvError> {
        if self.algo == HashAlgo::Sha256Cbor {
            return self.derive_vllm_namespace(cache_salt, lora_id);
        }
        self.buf.clear();
        if self.algo == HashAlgo::Xxh3_128 {
            self.buf.extend_from_slice(NAMESPACE_TAG);
        }
        match cache_salt {
            None => self.buf.push(0),
            Some(salt) => {
                self.buf.push(1);
                self.buf
                    .extend_from_slice(&(salt.len() as u64).to_le_bytes());
                self.buf.extend_from_slice(salt);
            }
        }
        match lora_id {
            None => self.buf.push(0),
            Some(id) => {
                self.buf.push(1);
                self.buf.extend_from_slice(&id.to_le_bytes());
            }
        }
        Ok(match self.algo {
            HashAlgo::Blake3 => {
                BlockHash::from_slice(&blake3::derive_key(BLAKE3_NAMESPACE_CONTEXT, &self.buf))
            }
            _ => self.xxh3_buf(),
        })
    }

    /// Hash of one full block given its parent's hash (None for the first block).
    pub fn block(
        &mut self,
        parent: Option<&BlockHash>,
        namespace: &BlockHash,
        tokens: &[u32],
    ) -> BlockHash {
        self.buf.clear();
        match self.algo {
            HashAlgo::Blake3 => {
                push_tokens(&mut self.buf, tokens);
                let key: &[u8; 32] = &parent.unwrap_or(namespace).bytes;
                BlockHash::from_slice(blake3::keyed_hash(key, &self.buf).as_bytes())
            }
            HashAlgo::Sha256Cbor => self.vllm_block(parent, namespace, tokens),
            HashAlgo::Xxh3_128 => {
                self.buf.extend_from_slice(BLOCK_TAG);
                self.buf.push(namespace.len);
                self.buf.extend_from_slice(namespace.as_bytes());
                match parent {
                    None => self.buf.push(0),
                    Some(p) => {
                        self.buf.push(1);
                        self.buf.push(p.len);
                        self.buf.extend_from_slice(p.as_bytes());
                    }
                }
                self.buf
                    .extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                push_tokens(&mut self.buf, tokens);
                self.xxh3_buf()
            }
        }
    }

    /// The hashes of every full block of a prompt, as a sequence added with this
    /// `cache_salt` and `lora_id` gets them (a partial last block has none).
    ///
    /// Errors: a `block_size` outside `[1, MAX_BLOCK_SIZE]` (what a manager accepts), and
    /// those of [`BlockHasher::namespace`].
    pub fn prompt_hashes(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<Vec<BlockHash>, KvError> {
        crate::config::check_block_size(block_size)?;
        let namespace = self.namespace(cache_salt, lora_id)?;
        let mut hashes = Vec::new();
        self.extend_chain(&mut hashes, &namespace, tokens, block_size);
        Ok(hashes)
    }

    /// Append the hashes of the full blocks of `tokens` past those already in `hashes`.
    pub fn extend_chain(
        &mut self,
        hashes: &mut Vec<BlockHash>,
        namespace: &BlockHash,
        tokens: &[u32],
        block_size: usize,
    ) {
        let full = tokens.len() / block_size;
        hashes.reserve(full.saturating_sub(hashes.len()));
        for i in hashes.len()..full {
            let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
            let h = self.block(
                parent.as_ref(),
                namespace,
                &tokens[i * block_size..(i + 1) * block_size],
            );
            hashes.push(h);
        }
    }
}

/// Append the tokens as little-endian `u32`s.
#[inline]
fn push_tokens(buf: &mut Vec<u8>, tokens: &[u32]) {
    buf.reserve(tokens.len() * 4);
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
}
