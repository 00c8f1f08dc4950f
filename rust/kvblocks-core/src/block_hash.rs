//! Content hashes of full blocks: the prefix-cache key.
//!
//! See [`BlockHasher`] for the encoding.

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::config::HashAlgo;

const BLOCK_TAG: &[u8] = b"kvblocks/block/v1";
const NAMESPACE_TAG: &[u8] = b"kvblocks/namespace/v1";
const BLAKE3_NAMESPACE_CONTEXT: &str = "kvblocks 2026 namespace v1";

/// A digest (32 bytes for BLAKE3, 16 for xxh3-128), stored inline.
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
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    buf: Vec<u8>,
    /// Namespace of no salt and no LoRA id, derived once: most sequences use it, and
    /// deriving a BLAKE3 key costs two compressions.
    default_namespace: BlockHash,
    /// The last other namespace derived, with its extra keys (requests of one tenant or
    /// adapter tend to arrive together).
    recent: Option<RecentNamespace>,
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
        self.algo == other.algo
    }
}

impl BlockHasher {
    /// A hasher for `algo`.
    pub fn new(algo: HashAlgo) -> Self {
        let mut hasher = BlockHasher {
            algo,
            buf: Vec::with_capacity(256),
            default_namespace: BlockHash::default(),
            recent: None,
        };
        hasher.default_namespace = hasher.derive_namespace(None, None);
        hasher
    }

    /// The algorithm in use.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    fn xxh3_buf(&self) -> BlockHash {
        BlockHash::from_slice(&xxhash_rust::xxh3::xxh3_128(&self.buf).to_le_bytes())
    }

    /// Digest of a sequence's extra keys (cache salt and LoRA id).
    pub fn namespace(&mut self, cache_salt: Option<&[u8]>, lora_id: Option<u64>) -> BlockHash {
        if cache_salt.is_none() && lora_id.is_none() {
            return self.default_namespace;
        }
        if let Some(r) = &self.recent {
            if r.cache_salt.as_deref() == cache_salt && r.lora_id == lora_id {
                return r.namespace;
            }
        }
        let namespace = self.derive_namespace(cache_salt, lora_id);
        self.recent = Some(RecentNamespace {
            cache_salt: cache_salt.map(Box::from),
            lora_id,
            namespace,
        });
        namespace
    }

    /// Compute the namespace digest (no cache).
    fn derive_namespace(&mut self, cache_salt: Option<&[u8]>, lora_id: Option<u64>) -> BlockHash {
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
        match self.algo {
            HashAlgo::Blake3 => {
                BlockHash::from_slice(&blake3::derive_key(BLAKE3_NAMESPACE_CONTEXT, &self.buf))
            }
            HashAlgo::Xxh3_128 => self.xxh3_buf(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    const ALGOS: [HashAlgo; 2] = [HashAlgo::Blake3, HashAlgo::Xxh3_128];

    #[test]
    fn digest_lengths_follow_the_algorithm() {
        for algo in ALGOS {
            let mut h = BlockHasher::new(algo);
            let ns = h.namespace(None, None);
            assert_eq!(ns.as_bytes().len(), algo.digest_len());
            let b = h.block(None, &ns, &[1, 2, 3, 4]);
            assert_eq!(b.as_bytes().len(), algo.digest_len());
        }
    }

    #[test]
    fn hashing_is_deterministic() {
        for algo in ALGOS {
            let (mut a, mut b) = (BlockHasher::new(algo), BlockHasher::new(algo));
            let (na, nb) = (
                a.namespace(Some(b"s"), Some(3)),
                b.namespace(Some(b"s"), Some(3)),
            );
            assert_eq!(na, nb);
            assert_eq!(a.block(None, &na, &[7, 8]), b.block(None, &nb, &[7, 8]));
        }
    }

    #[test]
    fn extra_keys_are_distinct_namespaces() {
        for algo in ALGOS {
            let mut h = BlockHasher::new(algo);
            let variants: [(Option<&[u8]>, Option<u64>); 7] = [
                (None, None),
                (Some(b""), None),
                (Some(b"\0"), None),
                (Some(b"a"), None),
                (None, Some(0)),
                (None, Some(1)),
                (Some(b""), Some(0)),
            ];
            let namespaces: Vec<BlockHash> =
                variants.iter().map(|(s, l)| h.namespace(*s, *l)).collect();
            for i in 0..namespaces.len() {
                for j in 0..i {
                    assert_ne!(
                        namespaces[i], namespaces[j],
                        "{:?} vs {:?}",
                        variants[i], variants[j]
                    );
                }
            }
            // and the block hashes under them differ too
            let blocks: Vec<BlockHash> = namespaces
                .iter()
                .map(|ns| h.block(None, ns, &[1, 2]))
                .collect();
            for i in 0..blocks.len() {
                for j in 0..i {
                    assert_ne!(blocks[i], blocks[j]);
                }
            }
        }
    }

    #[test]
    fn parent_and_tokens_are_separated() {
        for algo in ALGOS {
            let mut h = BlockHasher::new(algo);
            let ns = h.namespace(None, None);
            let root = h.block(None, &ns, &[1, 2]);
            let child = h.block(Some(&root), &ns, &[1, 2]);
            assert_ne!(root, child);
            assert_ne!(h.block(None, &ns, &[1, 2]), h.block(None, &ns, &[2, 1]));
            assert_ne!(h.block(None, &ns, &[0]), h.block(None, &ns, &[0, 0]));
            assert_ne!(h.block(None, &ns, &[]), h.block(None, &ns, &[0]));
        }
    }

    #[test]
    fn extend_chain_hashes_full_blocks_only_and_resumes() {
        for algo in ALGOS {
            let mut h = BlockHasher::new(algo);
            let ns = h.namespace(None, None);
            let tokens: Vec<u32> = (0..11).collect();
            let mut chain = Vec::new();
            h.extend_chain(&mut chain, &ns, &tokens[..5], 4);
            assert_eq!(chain.len(), 1);
            h.extend_chain(&mut chain, &ns, &tokens, 4);
            assert_eq!(chain.len(), 2);
            let first = h.block(None, &ns, &tokens[..4]);
            let second = h.block(Some(&first), &ns, &tokens[4..8]);
            assert_eq!(chain, vec![first, second]);
        }
    }

    #[test]
    fn cached_namespaces_equal_fresh_derivations() {
        for algo in ALGOS {
            let mut h = BlockHasher::new(algo);
            let variants: [(Option<&[u8]>, Option<u64>); 5] = [
                (None, None),
                (Some(b"t"), None),
                (Some(b"t"), None),
                (None, Some(2)),
                (Some(b"t"), None),
            ];
            for (salt, lora) in variants {
                let fresh = BlockHasher::new(algo).derive_namespace(salt, lora);
                assert_eq!(h.namespace(salt, lora), fresh, "{salt:?} {lora:?}");
            }
        }
    }

    #[test]
    fn blake3_block_is_keyed_by_parent_or_namespace() {
        let mut h = BlockHasher::new(HashAlgo::Blake3);
        let ns = h.namespace(Some(b"s"), None);
        let tokens = [5u32, 6, 7];
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let root = h.block(None, &ns, &tokens);
        let root_bytes: &[u8; 32] = root.as_bytes().try_into().unwrap();
        let ns_bytes: &[u8; 32] = ns.as_bytes().try_into().unwrap();
        assert_eq!(
            root.as_bytes(),
            blake3::keyed_hash(ns_bytes, &bytes).as_bytes()
        );
        let child = h.block(Some(&root), &ns, &tokens);
        assert_eq!(
            child.as_bytes(),
            blake3::keyed_hash(root_bytes, &bytes).as_bytes()
        );
    }

    #[test]
    fn debug_prints_hex() {
        let mut h = BlockHasher::new(HashAlgo::Xxh3_128);
        let ns = h.namespace(None, None);
        let s = format!("{ns:?}");
        assert_eq!(s.len(), 32);
        assert!(s.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
