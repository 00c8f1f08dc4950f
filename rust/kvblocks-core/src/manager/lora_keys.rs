//! The manager's block hasher: LoRA ids to vLLM's LoRA hash keys (for
//! `hash_algo="sha256_cbor"`), and copies of the hasher for hashing outside the manager.

use std::sync::Arc;

use super::KVCacheManager;
use crate::block_hash::BlockHasher;
use crate::config::HashAlgo;
use crate::events::{LoraKey, SeqExtraKeys};

impl KVCacheManager {
    /// Map `lora_id` to the adapter's `lora_name` and `lora_path` (vLLM's `LoRARequest`
    /// fields): vLLM's block hash keys a LoRA by `("lora", lora_name, lora_path)`, not by
    /// its numeric id, so `sha256_cbor` needs the mapping before a sequence with that id is
    /// added (`add_sequence` fails with `InvalidArgument` otherwise). Re-mapping an id
    /// applies to sequences added afterwards. The other hash algorithms key a LoRA by its
    /// id; with any algorithm, the `BlockStored` events of sequences added afterwards
    /// carry the name (`lora_name`), and with `sha256_cbor` the keys (`extra_keys`).
    pub fn register_lora(&mut self, lora_id: u64, lora_name: &str, lora_path: &str) {
        self.hasher.register_lora(lora_id, lora_name, lora_path);
        self.loras.insert(
            lora_id,
            LoraKey {
                name: lora_name.into(),
                path: lora_path.into(),
            },
        );
    }

    /// The registered name of `lora_id`, for events.
    pub(super) fn lora_name(&self, lora_id: Option<u64>) -> Option<Arc<str>> {
        Some(self.loras.get(&lora_id?)?.name.clone())
    }

    /// vLLM's extra keys of a sequence (`sha256_cbor` with prefix caching only; the
    /// hasher has validated the salt and the LoRA before this is called).
    pub(super) fn extra_keys(
        &mut self,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Option<Arc<SeqExtraKeys>> {
        if self.config.hash_algo != HashAlgo::Sha256Cbor || !self.pools.caching {
            return None;
        }
        let keys = SeqExtraKeys {
            lora: lora_id.and_then(|id| self.loras.get(&id).cloned()),
            // vLLM ignores an empty salt; a salt that is not UTF-8 failed in the hasher.
            cache_salt: cache_salt
                .filter(|s| !s.is_empty())
                .and_then(|s| std::str::from_utf8(s).ok())
                .map(Arc::from),
        };
        match &self.recent_extra_keys {
            Some(recent) if **recent == keys => Some(recent.clone()),
            _ => {
                let keys = Arc::new(keys);
                self.recent_extra_keys = Some(keys.clone());
                Some(keys)
            }
        }
    }

    /// A copy of the manager's block hasher: its algorithm, seed and registered LoRAs, so
    /// [`BlockHasher::prompt_hashes`] gives the hashes this manager gives a prompt (LoRAs
    /// registered afterwards are not in the copy).
    pub fn block_hasher(&self) -> BlockHasher {
        self.hasher.clone()
    }

    /// vLLM's `NONE_HASH`, the parent hash of every first block, with `sha256_cbor`.
    pub fn none_hash(&self) -> Option<&[u8; 32]> {
        self.hasher.none_hash()
    }
}
