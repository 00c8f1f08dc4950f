//! vLLM's block hash, `sha256_cbor`: the state it needs beyond a block's parent and
//! tokens, the encoding of a sequence's extra keys, and the hash of one block.

use rustc_hash::FxHashMap;
use sha2::{Digest, Sha256};

use super::{BlockHash, BlockHasher};
use crate::cbor;
use crate::error::KvError;

const SHA256_CBOR_NAMESPACE_TAG: &[u8] = b"kvblocks/sha256_cbor/namespace/v1";

/// What `sha256_cbor` needs beyond the block's parent and tokens.
#[derive(Debug, Clone, Default)]
pub(super) struct VllmKeys {
    /// vLLM's `NONE_HASH`: the parent of every first block.
    pub(super) none_hash: [u8; 32],
    /// LoRA id -> the CBOR of vLLM's key `("lora", lora_name, lora_path)`.
    pub(super) loras: FxHashMap<u64, Box<[u8]>>,
    /// Namespace -> the CBOR of its `extra_keys`.
    pub(super) extra: FxHashMap<BlockHash, ExtraKeys>,
}

/// The CBOR of vLLM's `extra_keys` (`null` or an array) for a sequence's first block and
/// for the blocks after it (the cache salt is a key of the first block only).
#[derive(Debug, Clone)]
pub(super) struct ExtraKeys {
    first: Box<[u8]>,
    rest: Box<[u8]>,
}

impl BlockHasher {
    /// Encode vLLM's extra keys of a sequence and file them under their digest.
    pub(super) fn derive_vllm_namespace(
        &mut self,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<BlockHash, KvError> {
        let Some(vllm) = self.vllm.as_mut() else {
            return Err(KvError::InvalidArgument(
                "sha256_cbor hasher without its vLLM state".to_string(),
            ));
        };
        let lora = match lora_id {
            None => None,
            Some(id) => Some(vllm.loras.get(&id).ok_or_else(|| {
                KvError::InvalidArgument(format!(
                    "lora_id {id} has no LoRA name: hash_algo=\"sha256_cbor\" hashes vLLM's \
                     (lora_name, lora_path); call register_lora({id}, name, path) first"
                ))
            })?),
        };
        // vLLM adds the salt only when it is truthy: b"" is no salt.
        let salt = match cache_salt {
            Some(s) if !s.is_empty() => Some(std::str::from_utf8(s).map_err(|_| {
                KvError::InvalidArgument(
                    "hash_algo=\"sha256_cbor\" needs a UTF-8 cache_salt (vLLM's salt is a str)"
                        .to_string(),
                )
            })?),
            _ => None,
        };
        let encode = |lora: Option<&Box<[u8]>>, salt: Option<&str>| -> Box<[u8]> {
            let n = usize::from(lora.is_some()) + usize::from(salt.is_some());
            if n == 0 {
                return Box::new([cbor::NULL]);
            }
            let mut buf = Vec::new();
            cbor::push_array(&mut buf, n);
            if let Some(key) = lora {
                buf.extend_from_slice(key);
            }
            if let Some(salt) = salt {
                cbor::push_array(&mut buf, 2);
                cbor::push_text(&mut buf, "cache_salt");
                cbor::push_text(&mut buf, salt);
            }
            buf.into()
        };
        let keys = ExtraKeys {
            first: encode(lora, salt),
            rest: encode(lora, None),
        };
        // Each encoding is one self-delimiting CBOR item: the concatenation is unambiguous.
        let mut h = Sha256::new();
        h.update(SHA256_CBOR_NAMESPACE_TAG);
        h.update(&keys.first);
        h.update(&keys.rest);
        let namespace = BlockHash::from_slice(h.finalize().as_slice());
        vllm.extra.entry(namespace).or_insert(keys);
        Ok(namespace)
    }
    /// vLLM's `hash_block_tokens(sha256_cbor, parent, tokens, extra_keys)`.
    pub(super) fn vllm_block(
        &mut self,
        parent: Option<&BlockHash>,
        namespace: &BlockHash,
        tokens: &[u32],
    ) -> BlockHash {
        let Some(vllm) = self.vllm.as_deref() else {
            return BlockHash::default();
        };
        let buf = &mut self.buf;
        // Head bytes: 1 (tuple) + 2 + 32 (parent) + 5 (array) + up to 5 per token.
        buf.reserve(48 + tokens.len() * 5);
        cbor::push_array(buf, 3);
        cbor::push_bytes(buf, parent.map_or(&vllm.none_hash[..], BlockHash::as_bytes));
        cbor::push_array(buf, tokens.len());
        for &t in tokens {
            cbor::push_uint(buf, u64::from(t));
        }
        // Namespaces only come from `namespace`, which files their keys; a stranger
        // hashes as "no extra keys" rather than panicking.
        match vllm.extra.get(namespace) {
            Some(keys) if parent.is_none() => buf.extend_from_slice(&keys.first),
            Some(keys) => buf.extend_from_slice(&keys.rest),
            None => buf.push(cbor::NULL),
        }
        BlockHash::from_slice(Sha256::digest(&self.buf).as_slice())
    }
}
