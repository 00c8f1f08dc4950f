//! LoRA ids to vLLM's LoRA hash keys, for `hash_algo="sha256_cbor"`.

use super::KVCacheManager;

impl KVCacheManager {
    /// Map `lora_id` to the adapter's `lora_name` and `lora_path` (vLLM's `LoRARequest`
    /// fields): vLLM's block hash keys a LoRA by `("lora", lora_name, lora_path)`, not by
    /// its numeric id, so `sha256_cbor` needs the mapping before a sequence with that id is
    /// added (`add_sequence` fails with `InvalidArgument` otherwise). Re-mapping an id
    /// applies to sequences added afterwards. The other hash algorithms key a LoRA by its
    /// id and ignore this.
    pub fn register_lora(&mut self, lora_id: u64, lora_name: &str, lora_path: &str) {
        self.hasher.register_lora(lora_id, lora_name, lora_path);
    }

    /// vLLM's `NONE_HASH`, the parent hash of every first block, with `sha256_cbor`.
    pub fn none_hash(&self) -> Option<&[u8; 32]> {
        self.hasher.none_hash()
    }
}
