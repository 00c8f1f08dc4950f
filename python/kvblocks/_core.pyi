"""Type stubs for ``kvblocks._core``, the compiled Rust block manager.

This file is the contract of the Python API. ``tests/core/test_stubs.py`` checks it
against the compiled module with ``mypy.stubtest``; keep the two in sync.

Conventions shared by every method:

* Sequence ids are Python ints in ``[0, 2**63)``; batch methods take them as a 1-D
  integer array (any NumPy integer dtype or a list).
* Token ids are ints in ``[0, 2**32)``; they may be passed as a list or a 1-D NumPy
  integer array.
* Arrays are returned as NumPy arrays built in Rust: block ids ``int32``, cache slots
  and swap/copy mappings ``int64``.
* Block id ``0`` is the *null block* (:attr:`KVCacheManager.null_block`): it is never
  allocated, so every entry of a block table, padding included, indexes valid cache
  memory. A pool of ``num_blocks`` therefore has ``num_blocks - 1`` usable blocks.
* Every error is a :class:`kvblocks.KVBlocksError` subclass, and a call that raises
  (or returns ``None`` for lack of blocks) leaves the manager exactly as it was,
  free-queue order included.
* The object is safe to share between threads; long calls release the GIL.
"""

from collections.abc import Sequence
from typing import ClassVar, Literal, final

import numpy as np
import numpy.typing as npt

_TokenIds = Sequence[int] | npt.NDArray[np.integer]
_SeqIds = Sequence[int] | npt.NDArray[np.integer]
_IntOrArray = int | Sequence[int] | npt.NDArray[np.integer]

__all__ = [
    "AllBlocksCleared",
    "AllocStatus",
    "BatchAllocation",
    "Blake3",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "BlockTableDelta",
    "GroupSpec",
    "KVCacheManager",
    "StateMapping",
    "__version__",
    "blake3_derive_key",
    "gather_row_prefixes",
    "paged_decode_attention",
]

__version__: str

@final
class AllocStatus:
    """Answer of :meth:`KVCacheManager.can_allocate`."""

    OK: ClassVar[AllocStatus]
    """Enough free blocks now, with the watermark kept free."""
    LATER: ClassVar[AllocStatus]
    """Not enough free blocks now; may fit once others finish."""
    NEVER: ClassVar[AllocStatus]
    """Can never fit: the sequence needs more blocks than the pool minus the watermark."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __int__(self) -> int: ...
    def __hash__(self) -> int: ...

@final
class BlockTableDelta:
    """The block-table entries one :meth:`KVCacheManager.update_block_table` (or
    :meth:`KVCacheManager.block_table_delta`) call wrote, in CSR form.

    Entry ``k``: row ``rows[k]`` got ``block_ids[indptr[k]:indptr[k + 1]]`` at columns
    ``start_cols[k]`` onwards; if ``reset[k]`` the rest of the row is the null block
    (the row was written whole). Rows without a change are left out. An engine keeping
    the table on a device applies the same writes with one scatter
    (see :func:`kvblocks.scheduler.block_table.delta_indices`).
    """

    @property
    def rows(self) -> npt.NDArray[np.int32]:
        """``[n]`` rows written."""
    @property
    def start_cols(self) -> npt.NDArray[np.int32]:
        """``[n]`` first column written in each row."""
    @property
    def indptr(self) -> npt.NDArray[np.int64]:
        """``[n + 1]`` offsets into ``block_ids``."""
    @property
    def block_ids(self) -> npt.NDArray[np.int32]:
        """The block ids written, row after row."""
    @property
    def reset(self) -> npt.NDArray[np.bool_]:
        """``[n]`` whether the row was written whole (null block outside the written ids)."""
    def __len__(self) -> int:
        """``n``: rows written."""

@final
class BatchAllocation:
    """What one :meth:`KVCacheManager.allocate_slots_batch` call did for the sequences it
    served.

    Serving an earlier entry can evict blocks of a later entry's cached prefix, so the
    cached tokens are reported as claimed, not as probed before the call.
    """

    @property
    def num_served(self) -> int:
        """Sequences served: the first ``num_served`` of the batch, in order."""
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int64]:
        """``[num_served]`` cached prompt tokens each served sequence claimed in this call
        (non-zero only on a sequence's first allocation)."""
    @property
    def block_ids(self) -> npt.NDArray[np.int32]:
        """Block ids taken from the free pool, sequence after sequence; per sequence as
        :meth:`KVCacheManager.allocate_slots` returns them (a copy-on-write replacement of
        table entry ``num_computed // block_size`` first, then appended blocks)."""
    @property
    def block_indptr(self) -> npt.NDArray[np.int64]:
        """``[num_served + 1]`` offsets: sequence ``i`` got
        ``block_ids[block_indptr[i]:block_indptr[i + 1]]``."""

@final
class StateMapping:
    """Where one step reads and writes the states of one recurrent-state group
    (:meth:`KVCacheManager.state_mapping`), in CSR form. A state "after ``p`` tokens" is
    the group's layers' state once tokens ``[0, p)`` went through them."""

    @property
    def read_blocks(self) -> npt.NDArray[np.int64]:
        """``[S]`` the block holding each sequence's state after its computed tokens, or
        ``-1`` before any token is computed (the zero state)."""
    @property
    def write_indptr(self) -> npt.NDArray[np.int64]:
        """``[S + 1]`` sequence ``i`` writes entries ``write_indptr[i]:write_indptr[i + 1]``."""
    @property
    def write_positions(self) -> npt.NDArray[np.int64]:
        """The tokens each saved state covers, ascending per sequence; a sequence's last
        one is the end of its reserved tokens."""
    @property
    def write_blocks(self) -> npt.NDArray[np.int64]:
        """The block each state is saved in."""
    def __len__(self) -> int: ...

@final
class BlockStored:
    """KV cache event: full blocks entered the prefix cache (one event per block run)."""

    @property
    def block_hashes(self) -> list[bytes]: ...
    @property
    def parent_block_hash(self) -> bytes | None: ...
    @property
    def token_ids(self) -> list[int]:
        """Tokens of all stored blocks, concatenated (``block_size`` per block)."""
    @property
    def block_size(self) -> int: ...
    @property
    def lora_id(self) -> int | None: ...
    @property
    def lora_name(self) -> str | None:
        """Name of the sequence's LoRA when its id was registered (``register_lora``)."""
    @property
    def extra_keys(self) -> list[tuple[str, ...] | None] | None:
        """vLLM's ``extra_keys`` as vLLM 0.33 publishes them (``to_event_extra_keys``):
        one entry per block, the untagged keys hashed into it (the LoRA's ``lora_name`` on
        every block of a LoRA sequence, then the cache salt on the chain's first block),
        or ``None`` for a block with neither. ``None`` as a whole unless
        ``hash_algo="sha256_cbor"`` (the keys are vLLM's), and for blocks offloaded at
        eviction (hashes only). The hash itself keys ``("lora", lora_name, lora_path)``
        and ``("cache_salt", salt)``."""
    @property
    def medium(self) -> Literal["GPU", "CPU"]:
        """``"GPU"`` (the prefix cache) or ``"CPU"`` (the host tier, announced by the
        ``confirm_memory_ops`` that completes the block's write, from which it is a hit;
        blocks offloaded at eviction carry hashes only: no parent, no tokens, no LoRA)."""
    @property
    def group_idx(self) -> int:
        """The KV cache group of the blocks (vLLM's ``group_idx``; 0 with one group)."""
    @property
    def kv_cache_spec_kind(
        self,
    ) -> Literal["full_attention", "sliding_window", "chunked_local_attention", "mamba"]:
        """What the group's layers attend to (the group's ``GroupSpec.kind``)."""
    @property
    def kv_cache_spec_sliding_window(self) -> int | None:
        """The group's sliding window in tokens; ``None`` for other groups."""

@final
class BlockRemoved:
    """KV cache event: blocks left the prefix cache (evicted or reset)."""

    @property
    def block_hashes(self) -> list[bytes]: ...
    @property
    def medium(self) -> Literal["GPU", "CPU"]:
        """``"GPU"`` or ``"CPU"`` (the host tier)."""
    @property
    def group_idx(self) -> int:
        """The KV cache group whose blocks these are (vLLM's ``group_idx``; 0 with one
        group)."""

@final
class AllBlocksCleared:
    """KV cache event: ``reset_prefix_cache`` dropped every cached block, on every medium
    (GPU and the host tier): no ``BlockRemoved`` follows for what it dropped."""

@final
class BlockHasher:
    """Block hashes of prompts, computed by the Rust core exactly as a ``KVCacheManager``
    computes them (the hashes its ``BlockStored`` events carry), without a manager.

    ``KVCacheManager.block_hasher()`` gives one with a manager's settings and registered
    LoRAs. Thread-safe; prompts of 2,048 tokens or more hash with the GIL released.

    Args:
        block_size: tokens per block (``>= 1``).
        hash_algo: ``"blake3"``, ``"xxh3_128"`` or ``"sha256_cbor"`` (see
            ``KVCacheManager``).
        hash_seed: ``sha256_cbor`` only: the seed of vLLM's ``NONE_HASH``; ``None`` reads
            ``PYTHONHASHSEED`` when set, else vLLM's ``"vllm-none-hash"`` (as the manager).

    Raises:
        InvalidArgumentError: a bad block size, algorithm or seed.
    """

    def __new__(
        cls,
        block_size: int,
        *,
        hash_algo: Literal["blake3", "xxh3_128", "sha256_cbor"] = "blake3",
        hash_seed: str | None = None,
    ) -> BlockHasher: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_algo(self) -> str: ...
    @property
    def none_hash(self) -> bytes | None:
        """vLLM's ``NONE_HASH`` (the parent hash of first blocks) with ``sha256_cbor``."""
    def register_lora(self, lora_id: int, lora_name: str, lora_path: str | None = None) -> None:
        """Map ``lora_id`` to vLLM's LoRA hash key ``("lora", lora_name, lora_path)``, as
        ``KVCacheManager.register_lora`` does (``sha256_cbor`` needs it before hashing
        with that id; the other algorithms key a LoRA by its id)."""
    def block_hashes(
        self,
        token_ids: _TokenIds,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> list[bytes]:
        """Hashes of the prompt's full blocks, in chain order (a partial last block has
        none): what ``add_sequence(seq_id, token_ids, cache_salt=, lora_id=)`` on a manager
        with these settings hashes. One call for the whole prompt.

        Raises:
            InvalidArgumentError: token ids out of ``[0, 2^32)`` or not 1-D; with
                ``sha256_cbor``, a salt that is not UTF-8 or an unregistered ``lora_id``.
        """

@final
class GroupSpec:
    """The attention of one KV cache group's layers (which past tokens a query sees), or
    their recurrent state.

    A hybrid model's layers are put in groups of equal size, one kind per group, so that
    one block id names the same bytes in every group and all groups share one pool
    (``docs/hybrid-groups.md``). Each sequence keeps one block table per group; an
    attention group holds only the blocks its future queries can see, a recurrent-state
    group one block: the state after the sequence's computed tokens.
    """

    @staticmethod
    def full_attention() -> GroupSpec:
        """Full attention: a query sees every earlier token."""
    @staticmethod
    def sliding_window(window: int) -> GroupSpec:
        """A window of ``window >= 1`` tokens: a query at ``p`` sees ``[p - window + 1, p]``."""
    @staticmethod
    def chunked_local_attention(chunk: int) -> GroupSpec:
        """Chunked local attention (Llama 4): a query at ``p`` sees its own chunk of
        ``chunk >= 1`` tokens, ``[p // chunk * chunk, p]``."""
    @staticmethod
    def recurrent(checkpoint_every_blocks: int) -> GroupSpec:
        """Recurrent layers (Mamba's conv and SSM state): one state per sequence in one
        block of its table (entry ``ceil(computed / block_size) - 1`` holds the state after
        the computed tokens), updated in place by each step and copied first when a fork
        shares it. The state after every ``checkpoint_every_blocks >= 1``-th block is
        cached (vLLM's ``"mamba"`` kind), and a prefix hit ends on a cached one
        (:meth:`KVCacheManager.state_mapping` says where a step reads and writes)."""
    @property
    def kind(
        self,
    ) -> Literal["full_attention", "sliding_window", "chunked_local_attention", "mamba"]:
        """vLLM's ``kv_cache_spec_kind`` name (``"mamba"``: a recurrent-state group)."""
    @property
    def window(self) -> int | None:
        """The window of a sliding-window group, else ``None``."""
    @property
    def chunk(self) -> int | None:
        """The chunk of a chunked local group, else ``None``."""
    @property
    def checkpoint_every_blocks(self) -> int | None:
        """Blocks between cached states of a recurrent-state group, else ``None``."""
    def first_visible(self, position: int) -> int:
        """The first position a query at ``position`` (or any later one) attends to
        (``position`` itself for a recurrent-state group)."""
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class KVCacheManager:
    """Paged KV-cache block manager: block pools, prefix cache, block tables, CoW, swap.

    Args:
        num_blocks: GPU blocks in the pool, the null block included (so ``>= 2``).
        block_size: tokens per block (``>= 1``).
        num_cpu_blocks: blocks in the CPU pool used by ``swap_out``/``swap_in``.
        enable_prefix_caching: share full blocks between sequences by content hash.
        hash_algo: ``"blake3"`` (cryptographic, the default), ``"xxh3_128"`` (faster,
            for single-tenant deployments) or ``"sha256_cbor"``: exactly vLLM's
            ``sha256_cbor`` block hashes (SHA-256 of the canonical CBOR of
            ``(parent_hash, tuple(token_ids), extra_keys)``, ``NONE_HASH`` as the first
            block's parent), so routers that compute vLLM hashes from prompts recognise
            kvblocks' ``BlockStored`` events. vLLM keys a LoRA by its name and path:
            ``register_lora`` maps a ``lora_id`` first. The cache salt must be UTF-8 and
            keys the first block only (``b""`` is no salt). Multimodal and prompt-embeds
            keys are not supported.
        hash_seed: ``sha256_cbor`` only: the seed of vLLM's ``NONE_HASH``
            (``sha256_cbor(seed)``). ``None`` reads ``PYTHONHASHSEED`` at construction, as
            vLLM does, and falls back to vLLM's fixed default ``"vllm-none-hash"``; set it
            to the fleet's ``PYTHONHASHSEED`` when this process's differs.
        watermark: fraction of GPU blocks kept free at admission (``can_allocate`` and
            ``can_swap_in``) so running sequences can keep growing; in ``[0, 1)``.
        sliding_window: if set, blocks wholly outside the attention window of every
            future query are released at ``commit`` and replaced by the null block.
        record_events: queue KV cache events for ``take_events``. Events accumulate
            until drained: turn this off when nothing calls ``take_events``.
        host_cache_blocks: slots of a host tier below the GPU pool (0: none; needs
            prefix caching). Evicted prefix blocks are kept there (LRU, keyed by block
            hash) and loaded back on a prefix hit; the manager only decides, the engine
            moves the bytes by the ops of ``take_memory_ops``.
        host_offload: ``"evict"`` (copy a cached GPU block to the tier when it is
            evicted for reuse) or ``"commit"`` (write-through: copy every block when it
            enters the prefix cache).
        groups: the KV cache groups of a hybrid model (:class:`GroupSpec`, one per group
            of equally many layers), all drawing from the one pool; ``None``: one group,
            full attention or ``sliding_window`` (which is short for
            ``[GroupSpec.sliding_window(w)]`` and may not be given with ``groups``).
            Every sequence has one block table per group, all of the same length;
            ``allocate_slots`` reserves in every group, ``commit`` releases the blocks no
            future query of a window or chunked group sees (the null block takes their
            place), and a prefix hit is the longest prefix every group can serve (full
            attention: every block cached; a window of ``W``: the blocks of the last
            ``W - 1`` tokens before the hit; chunked: the current chunk's). Per-group
            accessors take ``group=`` (default 0); ``group_block_tables``,
            ``group_slot_mappings``, ``update_group_block_tables`` and
            ``group_block_table_deltas`` give every group in one call. Memory ops name
            block ids of the one pool: a copy, swap, offload or load moves a block's
            bytes in every group's layers. A recurrent-state group
            (:meth:`GroupSpec.recurrent`) holds one state block per sequence, serves a hit
            only on a cached checkpoint boundary, and makes the manager refuse
            ``num_lookahead_tokens > 0`` and a commit of part of a reservation (the
            engine saves the state after the reserved tokens only): see
            :meth:`state_mapping`.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        hash_algo: Literal["blake3", "xxh3_128", "sha256_cbor"] = "blake3",
        hash_seed: str | None = None,
        watermark: float = 0.01,
        sliding_window: int | None = None,
        record_events: bool = True,
        host_cache_blocks: int = 0,
        host_offload: Literal["evict", "commit"] = "evict",
        groups: Sequence[GroupSpec] | None = None,
    ) -> KVCacheManager: ...

    # -- configuration ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def hash_algo(self) -> str: ...
    @property
    def none_hash(self) -> bytes | None:
        """vLLM's ``NONE_HASH`` (the parent hash of first blocks) with ``sha256_cbor``."""
    def register_lora(self, lora_id: int, lora_name: str, lora_path: str | None = None) -> None:
        """Map ``lora_id`` to vLLM's LoRA hash key ``("lora", lora_name, lora_path)``.

        The fields of vLLM's ``LoRARequest`` (``lora_path`` defaults to ``""``). With
        ``hash_algo="sha256_cbor"`` a sequence with a ``lora_id`` is added only after its
        id is registered (else ``InvalidArgumentError``); re-registering applies to
        sequences added afterwards. The other algorithms key a LoRA by its id and ignore
        this.
        """
    def block_hasher(self) -> BlockHasher:
        """A ``BlockHasher`` with this manager's block size, algorithm, seed and registered
        LoRAs: hashes prompts as ``add_sequence`` does, without the manager's lock. A copy:
        LoRAs registered afterwards are not in it."""
    @property
    def watermark(self) -> float: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def groups(self) -> list[GroupSpec]:
        """The KV cache groups, in order (one unless built with several)."""
    @property
    def num_groups(self) -> int: ...
    @property
    def record_events(self) -> bool: ...
    @property
    def host_cache_blocks(self) -> int: ...
    @property
    def host_offload(self) -> str: ...
    @property
    def null_block(self) -> int:
        """The reserved block id (0) used for padding and released window blocks."""

    # -- pool state ------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Free GPU blocks, cached-but-unreferenced ones included (at most ``num_blocks - 1``)."""
    def num_free_cpu_blocks(self) -> int: ...
    def usage(self) -> float:
        """Fraction of usable GPU blocks referenced by some sequence."""
    def __len__(self) -> int:
        """Number of sequences held (running and swapped)."""
    def __contains__(self, seq_id: object, /) -> bool:
        """Whether ``seq_id`` is held (``False`` for anything that is not a valid id)."""
    def seq_ids(self) -> npt.NDArray[np.int64]: ...

    # -- sequences -------------------------------------------------------------------
    def add_sequence(
        self,
        seq_id: int,
        token_ids: _TokenIds,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        retention_priority: int | None = None,
    ) -> int:
        """Register a sequence and its prompt; return how many leading tokens are cached.

        Hashes the prompt's full blocks once (released GIL) and probes the prefix cache
        without claiming anything. The hit is whole blocks and never the whole prompt:
        at most ``floor((len(token_ids) - 1) / block_size)`` blocks, so the last prompt
        token is always computed. ``retention_priority``: see
        :meth:`set_retention_priority` (``None``: 35); out of range raises
        ``InvalidArgumentError`` before anything is added.
        """
    def set_retention_priority(self, seq_id: int, priority: int) -> None:
        """Set the sequence's retention priority, an int in ``[0, 100]`` (default 35, as
        TensorRT-LLM's).

        The blocks the sequence commits or claims from now on carry it into the host
        tier (a block shared by several sequences keeps the highest), where the lowest
        priority is evicted first, the least recently used among equals, and an offload
        of lower priority than every evictable block is skipped
        (``host_offloads_skipped``). The GPU prefix cache evicts in the same order
        (uncached blocks first, then cached ones by priority, LRU among equals; with one
        priority for every sequence this is vLLM's order). Forks inherit it.

        Raises:
            InvalidArgumentError: ``priority`` outside ``[0, 100]`` (nothing changes).
            UnknownSequenceError: ``seq_id`` is not held.
        """
    def retention_priority(self, seq_id: int) -> int:
        """The sequence's retention priority (see :meth:`set_retention_priority`)."""
    def num_tokens(self, seq_id: int) -> int:
        """Known tokens of the sequence: prompt plus committed sampled tokens."""
    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is in the cache.

        Before the first ``allocate_slots`` this is the cached prefix the sequence would
        claim now (it can shrink through eviction, never grow past what ``add_sequence``
        returned); afterwards the committed count.
        """
    def num_cached_tokens(self, seq_id: int) -> int:
        """Prompt tokens served from the prefix cache (claimed, or the probe before the claim).

        With a host tier this includes the tokens loaded from it (``num_tier_tokens``).
        """
    def num_tier_tokens(self, seq_id: int) -> int:
        """Of ``num_cached_tokens``, the tokens loaded from the host tier: what a scheduler
        charges as loads instead of recompute (0 without a tier)."""
    def num_tier_loads(self, seq_id: int) -> int:
        """The host-tier blocks a waiting sequence's claim would load, over all groups
        (each group loads the hit's blocks its queries see; ``num_tier_tokens`` counts
        positions). ``SequenceStateError`` once allocated."""
    def limit_tier_loads(self, seq_id: int, max_loads: int) -> int:
        """Cap a waiting sequence's claim so that it loads at most ``max_loads`` blocks
        from the host tier; return the cached tokens it would claim now.

        The cached prefix is cut right before its ``max_loads + 1``-th host-tier block;
        the blocks past the cut are computed instead of loaded. How a scheduler bounds a
        step's host-to-GPU transfers (``SchedulerConfig.max_load_blocks_per_step``);
        ``refresh_prefixes`` restores the full hit. No change without a tier or when the
        loads fit.

        Raises:
            InvalidArgumentError: ``max_loads`` is negative or not an int.
            UnknownSequenceError: ``seq_id`` is not held.
            SequenceStateError: the sequence is already allocated, or swapped.
        """
    def token_ids(self, seq_id: int) -> npt.NDArray[np.uint32]: ...
    def is_swapped(self, seq_id: int) -> bool: ...
    def probe_prefixes(self, seq_ids: _SeqIds) -> npt.NDArray[np.int64]:
        """Batch form of ``num_computed_tokens`` for ordering waiting sequences (lpm)."""

    def refresh_prefixes(self, seq_ids: _SeqIds) -> npt.NDArray[np.int64]:
        """Re-probe the prefix cache for waiting sequences; return their cached-token counts.

        A waiting (not yet allocated) sequence's cached prefix is probed at
        ``add_sequence`` and can only shrink through eviction after that. This call
        re-probes the current cache with each sequence's stored block hashes (no
        re-hashing) and resets its cap to the hit found now, so a request that waited
        while another one cached the same prefix claims those blocks when admitted. The
        hit is whole blocks and never the whole prompt, as at ``add_sequence``.

        Nothing is claimed: refcounts, the free queue and eviction order are unchanged,
        and the count can still shrink through eviction before the first
        ``allocate_slots``. Ids may repeat. Every id is checked before any cap changes:
        an unknown id raises ``UnknownSequenceError``; a sequence that is already
        allocated (or swapped out) raises ``SequenceStateError``.

        Returns the new ``num_computed_tokens`` of each listed sequence, in order (int64).
        """

    def probe_in_flight(self, seq_ids: _SeqIds) -> npt.NDArray[np.int64]:
        """Prompt tokens past each waiting sequence's cached prefix being computed now.

        A block enters the prefix cache only at ``commit``, after the model wrote its KV,
        so a request admitted in the same step as the one computing its prefix would
        compute that prefix again. For each listed waiting (not yet allocated) sequence
        this returns ``block_size`` times the number of consecutive blocks right after
        its current hit (``num_computed_tokens``) whose content — same tokens, same
        preceding blocks, same cache salt and LoRA id — a pending reservation of another
        sequence fills completely: blocks between that sequence's ``allocate_slots`` and
        its ``commit``, counting only its ``num_new_tokens`` (not lookahead slots) and only
        blocks whose hashes are known (prompt blocks, and blocks hashed by earlier
        commits). Like the hit, the count never reaches the prompt's last token. With
        chunked prefill only the chunk being computed is in flight.

        Nothing is claimed or registered: the blocks enter the cache only if their writer
        commits them (an aborted, preempted or short commit leaves them out), so a
        scheduler that holds the sequence back a step and then calls
        ``refresh_prefixes`` claims only KV that was written. 0 with prefix caching off.

        Read-only; ids may repeat. An unknown id raises ``UnknownSequenceError``; an
        allocated or swapped-out sequence raises ``SequenceStateError``.

        Returns the in-flight token count of each listed sequence, in order (int64).
        """

    def can_allocate(
        self, seq_id: int, *, num_lookahead_tokens: int = 0, num_new_tokens: int | None = None
    ) -> AllocStatus:
        """Can the whole known sequence (plus lookahead) get blocks, keeping the watermark free?

        Blocks of its cached prefix that other sequences already use cost nothing; cached
        blocks sitting in the free queue count as taken. ``NEVER`` when the sequence needs
        more blocks than ``num_blocks - 1 - watermark_blocks``.

        With ``num_new_tokens``: can the next step, that many tokens past the cached
        prefix, get the blocks its ``allocate_slots`` takes in every group? This is the
        real need of a step (a sliding-window or chunked group holds only the blocks from
        its claim on; earlier steps' blocks it released are not counted). ``NEVER`` when
        the pool minus the watermark holds less than this step keeps, or than the least
        any schedule of the known tokens after it needs (computed one a step: every block
        of a full-attention group, a window group's worst window; a recurrent group's
        first step from position 0 reads no state, so the step's own positions count
        only as the step). ``InvalidArgumentError``
        as :meth:`allocate_slots` (more tokens than known past the cached prefix).
        """

    def allocate_slots(
        self, seq_id: int, num_new_tokens: int, *, num_lookahead_tokens: int = 0
    ) -> npt.NDArray[np.int32] | None:
        """Reserve KV slots for ``computed + num_new_tokens + num_lookahead_tokens`` tokens.

        The first call claims the cached prefix. ``computed + num_new_tokens`` must not
        exceed ``num_tokens`` (speculative drafts go through ``num_lookahead_tokens``).
        If the next write would land in a block that is shared (forked) the block is
        copied first and the ``(src, dst)`` pair queued for ``take_copy_on_writes``.

        Returns the block ids this call took from the free pool (CoW replacements, then
        appended blocks, in table order; with several groups, group after group),
        possibly empty; or ``None`` with the state unchanged when the pool is short. The
        watermark does not apply here. With several groups every group gets its blocks
        (a claim takes, in each group, only the cached blocks its next query sees).
        """
    def allocate_slots_batch(
        self, seq_ids: _SeqIds, num_new_tokens: _IntOrArray, *, num_lookahead_tokens: int = 0
    ) -> BatchAllocation:
        """``allocate_slots`` for many sequences in one call.

        Sequences are served in order and the call stops at the first one the pool cannot
        serve: the first ``k`` (``result.num_served``) have their slots, the rest are
        untouched, so a scheduler can preempt and retry from ``k``. The result also gives,
        per served sequence, the cached tokens it claimed and the blocks it got (what an
        engine needs to keep its own block table). Arguments are validated for the whole
        batch before anything changes.
        """
    def commit(
        self, seq_id: int, num_new_computed_tokens: int, new_token_ids: _TokenIds = ()
    ) -> None:
        """The model wrote KV for ``num_new_computed_tokens`` more tokens; append sampled tokens.

        ``num_new_computed_tokens`` is a delta; the computed count may not exceed the
        reserved slots nor the tokens known before this call. Blocks that became full enter
        the prefix cache (in every group); blocks no future query of a sliding-window or
        chunked group sees are released (their entries become the null block).
        Ends the allocate/commit round (uncommitted lookahead reservations are dropped).
        With a recurrent-state group it must be the whole reservation (the step ran) or
        0 (it did not), else :class:`InvalidArgumentError`; the step's states other than
        the one after the computed tokens are then released (checkpoints cached first).
        """
    def commit_batch(
        self,
        seq_ids: _SeqIds,
        num_new_computed_tokens: _IntOrArray,
        new_token_ids: _IntOrArray | None = None,
    ) -> None:
        """``commit`` for many sequences: at most one new token each (``< 0`` means none).

        All-or-nothing: every entry is validated before any sequence changes.
        """
    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share the tokens of ``parent_id`` and the blocks holding its
        computed KV (refcounts + 1).

        Only the first ``ceil(num_computed_tokens / block_size)`` blocks are shared: spare
        blocks past the computed tokens (left by lookahead, or by a commit smaller than the
        reservation) stay the parent's. The one block both may then write, the partially
        filled last one, is copied by whichever calls ``allocate_slots`` (copy-on-write),
        so no write lands in a block another sequence holds. Commit the parent's KV first;
        forking a sequence between ``allocate_slots`` and ``commit`` raises
        :class:`SequenceStateError`.
        """
    def take_copy_on_writes(self) -> npt.NDArray[np.int64]:
        """Drain the memory-op journal as copy-on-write ``(src, dst)`` block pairs, shape
        ``[n, 2]``: a view of ``take_memory_ops`` for a caller that applies swaps from the
        rows ``swap_out``/``swap_in`` return (their journal entries are dropped).

        Raises :class:`SequenceStateError`, changing nothing, while host-tier offloads or
        loads are queued (they are ordered with the copies): use ``take_memory_ops``.
        """
    def take_memory_ops(self) -> list[tuple[str, npt.NDArray[np.int64]]]:
        """Drain every queued block move in issue order, as runs of one kind: the one
        memory-op protocol, with or without a host tier.

        Kinds: ``"swap_out"`` (gpu, cpu), ``"swap_in"`` (cpu, gpu), ``"copy"`` (src,
        dst GPU blocks), ``"offload"`` (gpu block, tier slot), ``"load"`` (tier slot, gpu
        block); each run an ``int64 [n, 2]`` array, and no offload or load run names a
        destination twice (a block loaded into twice before the ops are taken gets a run
        per load: applied as one index copy, the two would race on CUDA). Apply them in
        order before the step's attention. Host-tier slots named by the ops stay pinned
        (an offloaded slot is no prefix hit, a load source is not evicted) until
        ``confirm_memory_ops``.
        """
    def confirm_memory_ops(self) -> None:
        """Every op taken by ``take_memory_ops`` so far has completed: unpin their
        host-tier slots (the blocks written into them become hits, and their
        ``BlockStored`` events, medium ``"CPU"``, are queued now). Ops queued since stay
        pinned. A no-op without a tier."""
    def discard_memory_ops(self) -> None:
        """The engine could not finish the ops taken by ``take_memory_ops`` so far (a copy
        into the host pool raised, a fetched block could not be written): release their
        host-tier pins without trusting what they wrote. The slots offloads and
        ``import_tier_blocks`` were writing become empty (never prefix hits; their
        ``BlockStored`` events are never queued); a load's source keeps its block. Ops
        queued since stay pinned. GPU blocks the failed ops wrote (loads, swaps, copies)
        are the engine's to drop: free their sequences and ``reset_prefix_cache``. A
        no-op without a tier."""
    def tier_slot_hashes(self, slots: Sequence[int] | npt.ArrayLike) -> list[bytes | None]:
        """The block hash each host-tier slot holds or is being written with (None: an
        empty slot, an id out of range, or no tier). Read it before confirming an offload
        (its slot cannot be reused until then) to key the slot's row in a shared store
        (with several groups, keyed by :meth:`tier_slot_groups` too)."""
    def tier_slot_groups(self, slots: Sequence[int] | npt.ArrayLike) -> list[int | None]:
        """The KV cache group of the block each host-tier slot holds (as
        :meth:`tier_slot_hashes`): each group's block of the same tokens is that group's
        KV."""
    def num_cached_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the hash chain a prompt would hit now (GPU prefix cache or
        written host-tier slots; with several groups, what every group serves by the hit
        rule), without side effects; hashes of another length never hit.

        Raises:
            InvalidArgumentError: an item that is not bytes.
        """
    def import_tier_blocks(
        self,
        block_hashes: Sequence[bytes],
        *,
        retention_priority: int | None = None,
        group: int = 0,
    ) -> npt.NDArray[np.int64]:
        """Reserve host-tier slots for blocks of ``group`` fetched from a shared remote
        store.

        One int64 per hash: the slot whose host-pool row the engine writes the block's KV
        into, or -1 when there is nothing to write (already in the GPU prefix cache or the
        tier, or no slot free: every one pinned or holding a block of higher retention
        priority than ``retention_priority``). The imported blocks keep that priority in
        the tier (``None``: the default, 35), as the requesting sequence's own blocks
        would. Reserved slots are pinned and no prefix hit until ``confirm_memory_ops``;
        then probes find them and claims load them like offloaded blocks. Emits
        ``BlockStored`` with medium ``"CPU"`` per reserved slot at that
        ``confirm_memory_ops``.

        Raises:
            InvalidArgumentError: no host tier or no prefix caching, a hash that is not
                bytes of the hash algorithm's digest length, a priority outside
                ``[0, 100]`` or a group out of range (nothing is reserved).
        """
    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (groups last to first, each last block first) and
        forget it.

        Unhashed blocks go to the front of the free queue (reused first); cached blocks to
        the back (of their retention priority's level, see ``set_retention_priority``), so
        a prompt's tail is evicted before its head. Works on swapped sequences.
        """

    # -- swap ------------------------------------------------------------------------
    def can_swap_out(self, seq_ids: _SeqIds) -> bool: ...
    def can_swap_in(self, seq_ids: _SeqIds) -> bool:
        """Enough free GPU blocks for the sequences' distinct blocks, keeping the watermark."""
    def swap_out(self, seq_ids: _SeqIds) -> npt.NDArray[np.int64]:
        """Move the sequences' blocks to the CPU pool; return ``(gpu, cpu)`` rows ``[n, 2]``.

        A GPU block shared by several of the given sequences maps to one CPU block.
        Raises :class:`OutOfBlocksError` (state unchanged) if the CPU pool is short.
        """
    def swap_in(self, seq_ids: _SeqIds) -> npt.NDArray[np.int64]:
        """Move swapped sequences back; return ``(cpu, gpu)`` rows ``[n, 2]``, sharing kept."""

    # -- step inputs -------------------------------------------------------------------
    def block_table(self, seq_id: int, *, group: int = 0) -> npt.NDArray[np.int32]:
        """The sequence's block table of ``group`` (null entries: blocks no future query
        of a window or chunked group sees)."""
    def block_tables(
        self, seq_ids: _SeqIds, *, max_blocks: int | None = None, group: int = 0
    ) -> npt.NDArray[np.int32]:
        """2-D block tables of ``group``, padded with the null block to the longest (or
        ``max_blocks``).

        ``max_blocks`` must be at least the longest table and at most ``num_blocks`` (or
        the longest table, when released window entries make it longer); else
        :class:`InvalidArgumentError`, as for a group out of range.
        """
    def group_block_tables(
        self, seq_ids: _SeqIds, *, max_blocks: int | None = None
    ) -> npt.NDArray[np.int32]:
        """:meth:`block_tables` of every group in one call, ``[num_groups, len(seq_ids),
        max_blocks]`` (a sequence's tables have the same length in every group)."""
    def update_block_table(
        self,
        block_table: npt.NDArray[np.int32],
        seq_ids: _SeqIds,
        rows: _SeqIds,
        *,
        full: bool | None = None,
        group: int = 0,
    ) -> BlockTableDelta:
        """Bring row ``rows[i]`` of a persistent ``[max_rows, max_blocks]`` table of
        ``group`` up to date with the block table of ``seq_ids[i]`` in that group, in
        place, writing only what changed (each group's table is tracked on its own).

        Each sequence remembers the first entry changed since its last sync (appends,
        copy-on-write replacements, sliding-window releases, a swap-in's new ids) and the
        row it was synced to; the manager remembers which sequence it last wrote into each
        row. A sequence synced to the same row as last time, with no other sequence
        written there since, gets only its changed entries; otherwise (first sync, a new
        row, a reused row, or ``full=True``) its whole table is written and the rest of
        the row set to the null block. The manager cannot see the caller's memory: keep
        one table per manager, or pass ``full=True`` for a table it did not write last
        (e.g. a new buffer). Returns the writes (for a device copy).

        ``block_table`` must be a C-contiguous, writeable 2-D int32 NumPy array at least
        as wide as every listed table; rows must be distinct and in ``[0, max_rows)``,
        sequence ids distinct and not swapped out. Otherwise
        :class:`InvalidArgumentError` / :class:`UnknownSequenceError` /
        :class:`SequenceStateError`, with nothing written and nothing consumed.
        """
    def update_decode_block_table(
        self,
        block_table: npt.NDArray[np.int32],
        seq_ids: _SeqIds,
        rows: _SeqIds,
        positions: _SeqIds,
    ) -> tuple[BlockTableDelta, npt.NDArray[np.int64]]:
        """:meth:`update_block_table` of group 0 (``full=None``) for a step of decodes,
        and the cache slot (``block * block_size + offset``) of each sequence's token at
        ``positions[i]``, read from its row just written (-1 when group 0 is a
        recurrent-state group, as :meth:`slot_mapping`): the scheduler's decode-only step
        in one call. A position past the table's columns or in no block the sequence
        holds (past its table, or in a released window block: the row's null padding
        there would name a slot of the null block), or ``positions`` not one per
        sequence, is :class:`InvalidArgumentError` with nothing written or consumed;
        otherwise the errors of :meth:`update_block_table`."""
    def allocate_decode_step(
        self,
        block_table: npt.NDArray[np.int32],
        seq_ids: _SeqIds,
        rows: _SeqIds,
        positions: _SeqIds,
        *,
        num_lookahead_tokens: int = 0,
    ) -> tuple[int, tuple[BlockTableDelta, npt.NDArray[np.int64]] | None]:
        """A scheduler's steady decode step in one call: :meth:`allocate_slots_batch`
        ``(seq_ids, 1, num_lookahead_tokens=...)`` and, when it served every sequence,
        :meth:`update_decode_block_table` ``(block_table, seq_ids, rows, positions)``,
        with the batch resolved and checked once.

        Returns ``(num_served, synced)``: ``num_served`` as
        :attr:`BatchAllocation.num_served` (the pool running short serves the leading
        sequences it can, as :meth:`allocate_slots_batch` does), and ``synced`` the
        table's delta and each sequence's cache slot of the token at ``positions[i]``;
        ``None`` when not every sequence was served, or when a table (or a position's
        block) does not fit ``block_table``'s columns: nothing was synced then (widen the
        table and call :meth:`update_block_table`).

        Raises:
            InvalidArgumentError: a manager with more than one KV cache group;
                ``rows`` or ``positions`` not one per sequence, a row outside the
                table or listed twice, a position in no block the sequence holds once
                served (past its table or in a released window block); or what
                :meth:`allocate_slots_batch` raises. Nothing changes then.
        """
    def update_group_block_tables(
        self,
        block_tables: npt.NDArray[np.int32],
        seq_ids: _SeqIds,
        rows: _SeqIds,
        *,
        full: bool | None = None,
    ) -> list[BlockTableDelta]:
        """:meth:`update_block_table` of every group in one call: ``block_tables`` is a
        C-contiguous, writeable int32 ``[num_groups, max_rows, max_blocks]`` array (one
        persistent table per group, each sequence in the same row of each); returns one
        delta per group. All or nothing, as the one-group form."""
    def block_table_delta(
        self,
        seq_ids: _SeqIds,
        rows: _SeqIds,
        *,
        max_rows: int,
        max_blocks: int,
        full: bool | None = None,
        group: int = 0,
    ) -> BlockTableDelta:
        """:meth:`update_block_table` for a ``[max_rows, max_blocks]`` table of ``group``
        kept elsewhere (e.g. only on a device): returns the writes without a host buffer
        and consumes the changes the same way."""
    def group_block_table_deltas(
        self,
        seq_ids: _SeqIds,
        rows: _SeqIds,
        *,
        max_rows: int,
        max_blocks: int,
        full: bool | None = None,
    ) -> list[BlockTableDelta]:
        """:meth:`block_table_delta` of every group in one call; one delta per group."""
    def slot_mapping(
        self, seq_ids: _SeqIds, num_tokens: _IntOrArray | None = None, *, group: int = 0
    ) -> npt.NDArray[np.int64]:
        """Cache slots (``block * block_size + offset``) of the tokens computed this step,
        in the tables of ``group`` (each group writes its layers' KV into its own blocks).

        For each sequence the tokens ``[computed, computed + n)`` where ``n`` is its entry of
        ``num_tokens`` (default: every known but uncomputed token), concatenated. Only the
        slots reserved by the pending ``allocate_slots`` (``computed + num_new_tokens +
        num_lookahead_tokens``) can be mapped: they are the slots no other sequence reads
        or writes. Mapping more, or with no reservation pending (e.g. after ``commit``),
        raises :class:`SequenceStateError`.
        """
    def group_slot_mappings(
        self, seq_ids: _SeqIds, num_tokens: _IntOrArray | None = None
    ) -> npt.NDArray[np.int64]:
        """:meth:`slot_mapping` of every group in one call, ``[num_groups, num_tokens]``
        (a recurrent-state group's row is ``-1``: it keeps no per-token KV)."""
    def state_mapping(self, seq_ids: _SeqIds, *, group: int) -> StateMapping:
        """Where the pending step of each sequence reads and writes the states of
        recurrent-state group ``group``.

        The step reads the state after the sequence's computed tokens from
        ``read_blocks[i]`` (``-1``: none computed, start from zeros) and saves, for its
        pending reservation ``[computed, reserved)``, the state after each checkpoint
        boundary it crosses (every ``checkpoint_every_blocks * block_size`` tokens) and
        the state after ``reserved`` tokens, in that order, into the blocks named. A
        state written in place (its block is also the read block) was copied first when
        shared (the reservation's copy-on-write). No pending reservation: no writes.

        Raises:
            InvalidArgumentError: ``group`` out of range or not a recurrent-state group.
            UnknownSequenceError: an id is not held.
            SequenceStateError: a sequence is swapped out.
        """

    # -- prefix cache, events, stats -------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use. Returns success.

        The host tier drops its blocks too, except those pinned by unconfirmed memory ops.
        Events: one ``AllBlocksCleared`` for every medium, then, if the tier kept written
        blocks (sources of unconfirmed loads), one ``BlockStored`` with ``medium="CPU"``
        announcing them again (hashes only); kept blocks still being written are announced
        by the ``confirm_memory_ops`` that makes them hits. So a consumer that clears all
        tiers on ``AllBlocksCleared`` holds exactly the blocks the manager serves.
        """
    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Drain the KV cache events recorded since the last call.

        Always empty without prefix caching or with ``record_events=False``.
        """
    def stats(self) -> dict[str, int | float]:
        """Counters: usage, free blocks, prefix-cache queries/hits (tokens), evictions,
        copy-on-write copies, blocks swapped out/in, sequences.

        With a host tier also ``host_cache_blocks``, ``num_host_cached_blocks``,
        ``num_host_pinned_blocks``, ``host_hits`` (tokens), ``host_loads``,
        ``host_offloads``, ``host_offloads_skipped`` (every slot pinned) and
        ``host_evictions``, ``host_imports`` (blocks). ``prefix_cache_hits`` counts GPU hits only.
        """
    def group_stats(self) -> dict[str, list[int]]:
        """Per KV cache group, one int each: ``num_used_blocks`` (GPU blocks its tables
        reference) and ``num_cached_blocks`` (its prefix-cache entries)."""
    def check_invariants(self) -> None:
        """Verify every structural invariant; raise :class:`InvariantViolationError` on failure."""

def gather_row_prefixes(
    table: npt.NDArray[np.int32], counts: _SeqIds, rows: _SeqIds | None = None
) -> npt.NDArray[np.int32]:
    """``table[rows[i], :counts[i]]`` for every ``i``, concatenated (int32): the ragged
    gather behind FlashInfer's CSR page list (:mod:`kvblocks.page_tables`), one copy per
    row. ``rows`` defaults to ``0 .. len(counts) - 1``; ``table`` must be a C-contiguous
    2-D int32 array. Its rows are its shape's, so an ``(N, 0)`` table has ``N`` rows of no
    pages (counts of 0). A count wider than the table, a row outside it, or mismatched
    lengths raise :class:`InvalidArgumentError` before anything is copied."""

def paged_decode_attention(
    out: npt.NDArray[np.float32],
    query: npt.NDArray[np.float32],
    key_cache: npt.NDArray[np.float32],
    value_cache: npt.NDArray[np.float32],
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: npt.NDArray[np.float32] | None = None,
    threads: int = 1,
) -> None:
    """Decode attention of one query per sequence over the paged KV cache, into ``out``.

    fp32 C-contiguous arrays (zero-copy NumPy views of CPU torch tensors): ``query`` and
    ``out`` ``[num_seqs, num_heads, head_size]``, caches ``[num_blocks, num_kv_heads,
    block_size, head_size]``, int32 ``block_tables`` ``[num_seqs, max_blocks]`` and
    ``seq_lens`` ``[num_seqs]``. The query of sequence ``s`` sits at ``seq_lens[s] - 1``
    and reads its keys in place through its table row (window, soft-cap and per-head
    ``sinks`` as in :mod:`kvblocks.ops.reference`); a length of 0 gives a zero row.
    ``threads`` threads share the work, the GIL released. Bad shapes, a block id outside
    the cache, a length past the table, or an ``out`` sharing memory with an input raise
    :class:`InvalidArgumentError` before anything is written. What
    :mod:`kvblocks.ops.cpu_attention` runs for fp32 decodes."""

@final
class Blake3:
    """An incremental BLAKE3 hash (the core's SIMD implementation; the GIL is released
    while data is hashed); a keyed hash (a MAC) when built with a 32-byte ``key``.

    Raises :class:`InvalidArgumentError` for a key of another length.
    """

    def __new__(cls, key: bytes | None = None) -> Blake3: ...
    def update(self, data: bytes | npt.NDArray[np.uint8]) -> None:
        """Hash more bytes: a ``bytes`` object or a C-contiguous 1-D uint8 array (read in
        place: a view of a memory map or a CPU tensor's ``.numpy()``)."""
    def digest(self, length: int = 32) -> bytes:
        """The first ``length`` (1..1024) bytes of the output; the hasher may keep being
        updated."""
    def copy(self) -> Blake3:
        """An independent hasher in the same state."""

def blake3_derive_key(context: str, material: bytes) -> bytes:
    """A 32-byte key derived from ``material`` for ``context`` (BLAKE3's key derivation
    mode: one secret gives unrelated keys to unrelated contexts)."""
