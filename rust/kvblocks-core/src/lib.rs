//! # kvblocks-core
//!
//! A paged KV-cache block manager with vLLM's block-manager semantics, in plain Rust:
//! block pools with reference counts and an eviction-ordered free queue, a content-hash
//! prefix cache (BLAKE3, xxh3-128, or vLLM's own `sha256_cbor` block hashes) with namespaces for cache salts and LoRA ids,
//! copy-on-write for forked sequences, block tables and slot mappings for the model
//! step, CPU swap, a sliding window, KV cache events and an invariant checker.
//!
//! The API is a 1:1 mirror of the Python contract `python/kvblocks/_core.pyi` (the
//! `kvblocks-py` crate wraps [`KVCacheManager`] in a mutex). Key conventions:
//!
//! * **Null block.** GPU block id 0 ([`NULL_BLOCK`]) is reserved and never allocated, so a
//!   pool of `num_blocks` has `num_blocks - 1` usable blocks and `num_free_blocks()`
//!   starts at `num_blocks - 1`. Block tables are padded with it and sliding-window
//!   releases replace table entries by it. The CPU pool has no null block.
//! * **Transactions.** A call that returns an error (or `None` for lack of blocks) leaves
//!   the manager exactly as it was, free-queue order included.
//! * **Free order.** Freed blocks are processed last block first: unhashed blocks go to
//!   the front of the free queue (reused first), cached blocks to the back (evicted last,
//!   a prompt's tail before its head) of their [`RetentionPriority`]'s level: lower
//!   priorities are evicted first (one priority for all, the default, is vLLM's order).
//!   Sliding-window releases inside one `commit` follow the same rule (last released
//!   block first). The CPU pool has a single rule: freed
//!   blocks go to the front, last first.
//! * **Prefix cache.** Block hashes chain the parent hash and the extra keys (cache salt,
//!   LoRA id); see [`BlockHasher`] for the exact, domain-separated encoding. Eviction is
//!   lazy: a freed cached block keeps its hash (and counts as free) until it is popped
//!   for reuse, which records a `BlockRemoved` event. A block whose content is already
//!   cached (a prefix computed again) is cached as one more copy, as vLLM does: the hash
//!   stays a hit while any copy is cached, a claim prefers a copy in use, and an evicted
//!   copy is offloaded to the host tier only if it was the last. `BlockStored` events
//!   cover runs of consecutive blocks stored by one `commit` (copies included; a block
//!   already cached or released ends a run); `BlockRemoved` events carry one hash each. Blocks enter the cache only at `commit`;
//!   `probe_in_flight` reports the prompt blocks other sequences' pending reservations are
//!   computing, so a scheduler can hold a request back a step instead of recomputing them.
//! * **Host tier.** With `host_cache_blocks > 0`, prefix blocks evicted from the GPU
//!   cache (or, write-through, every cached block) are offloaded to host slots keyed by
//!   hash, evicted by [`RetentionPriority`] (lowest first, LRU among equals), and a probe
//!   continues into the tier: a hit there is claimed by taking a
//!   fresh GPU block and queuing a load. Every block move (swaps, copies, offloads,
//!   loads) goes into one ordered list, `take_memory_ops`; tier slots stay pinned until
//!   `confirm_memory_ops` (see the `host_tier` module).
//! * **KV cache groups.** A hybrid model's layers form groups of equally many layers,
//!   one attention kind each ([`GroupSpec`]: full, sliding window, chunked local), so that
//!   a block id names the same bytes in every group and all groups share one pool. Each
//!   sequence has one table per group (all of one length); `commit` releases, in window
//!   and chunked groups, the blocks no future query sees. The prefix cache and the host
//!   tier are keyed by group and hash, and a hit is the longest prefix every group serves
//!   (found as a fixed point, see the `manager::hit` module). Memory ops name pool block
//!   ids and move a block in every group's layers. Without groups a manager is one
//!   full-attention group (or one window group with `sliding_window`).
//! * **Recurrent-state groups.** `GroupSpec::Recurrent` keeps one state per sequence
//!   (Mamba's conv and SSM state) in one block of its table, updated in place by each
//!   step (copied first when a fork shares it); every `checkpoint_every_blocks`-th block
//!   boundary's state is cached, and a prefix hit ends on a cached boundary.
//!   [`KVCacheManager::state_mapping`] tells the engine where each step reads the state
//!   and where it saves the states it crosses (see the `manager::state` module). Such a
//!   manager refuses lookahead slots and commits of part of a reservation.
//! * **Limits.** Pools hold at most [`MAX_BLOCKS`] blocks; ids are `u32` inside and
//!   `i32`/`i64` in the step inputs.
//!
//! Rust-side details the `.pyi` leaves open:
//!
//! * Batch integer arguments are [`BatchArg`] (`i64` scalar or slice), so NumPy `int64`
//!   arrays pass through without conversion; negative counts are `InvalidArgument`.
//! * `allocate_slots` copies a shared block (copy-on-write) only when the call reserves at
//!   least one slot (`num_new_tokens + num_lookahead_tokens > 0`): with nothing to write,
//!   nothing needs a private copy.
//! * `block_table(s)` and `slot_mapping` raise `SequenceState` for swapped sequences
//!   (their tables hold CPU ids, which must not reach the model step).
//! * Batch methods reject a sequence id listed twice (`InvalidArgument`).
//! * `seq_ids()` is sorted ascending.
//! * `sync_block_table` keeps a caller's persistent block table up to date by writing
//!   only the entries that changed since the last sync (see its docs for when a row is
//!   written whole); the Python names are `update_block_table` (in place) and
//!   `block_table_delta` (the writes only).
//!
//! Beside the manager, [`paged_decode_attention`] is the CPU engine's decode kernel: fp32
//! attention of one query per sequence read in place through the block tables (see the
//! `paged_attention` module).

mod alloc_status;
mod batch_allocation;
mod batch_arg;
mod block_hash;
mod block_pool;
mod block_table_delta;
pub mod cbor;
mod config;
mod error;
mod events;
mod group;
mod host_tier;
mod manager;
mod paged_attention;
mod prefix_cache;
mod priority_lru;
mod retention;
mod row_prefixes;
mod sequence;
mod state_mapping;
mod stats;

pub use alloc_status::AllocStatus;
pub use batch_allocation::BatchAllocation;
pub use batch_arg::BatchArg;
pub use block_hash::{BlockHash, BlockHasher};
pub use block_table_delta::BlockTableDelta;
pub use config::{
    check_block_size, HashAlgo, ManagerConfig, MAX_BLOCKS, MAX_BLOCK_SIZE, VLLM_DEFAULT_HASH_SEED,
};
pub use error::{KvError, Result};
pub use events::{BlockRemoved, BlockStored, KvCacheEvent, LoraKey, SeqExtraKeys};
pub use group::{GroupSpec, MAX_GROUPS};
pub use host_tier::{Medium, MemoryOp, MemoryOpKind, OffloadPolicy, TierStats};
pub use manager::{BlockTables, DecodeStep, KVCacheManager};
pub use paged_attention::{
    exp_in_place, paged_decode_attention, AttentionParams, DecodeBatch, PagedShape,
};
pub use retention::RetentionPriority;
pub use row_prefixes::gather_row_prefixes;
pub use state_mapping::StateMapping;
pub use stats::Stats;

/// The reserved GPU block id used for padding and released sliding-window blocks.
pub const NULL_BLOCK: u32 = 0;
