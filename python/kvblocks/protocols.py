"""The interfaces kvblocks' layers meet at, free of dependencies.

The scheduler and the engine take a block manager, an event publisher and a remote tier
from the caller; their types live here, not beside the implementations (the compiled
manager, the ZeroMQ publisher, the Valkey tier), so that typing an argument never imports
pyzmq, valkey or torch. The implementations' packages import this module, never the other
way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing this module needs none of them
    import numpy as np
    import numpy.typing as npt
    import torch

    from kvblocks._core import (
        AllBlocksCleared,
        AllocStatus,
        BatchAllocation,
        BlockRemoved,
        BlockStored,
        BlockTableDelta,
        GroupSpec,
        StateMapping,
    )
    from kvblocks.tiers.codec import Payload
    from kvblocks.tiers.layout import KVLayout
    from kvblocks.tiers.stats import TierStats

__all__ = ["BlockManager", "EventPublisher", "RemoteTier", "TierStore"]

_Ids: TypeAlias = "Sequence[int] | npt.NDArray[np.integer]"
_IntOrArray: TypeAlias = "int | Sequence[int] | npt.NDArray[np.integer]"


class BlockManager(Protocol):
    """The block manager the scheduler drives: :class:`kvblocks.KVCacheManager`, or a
    model of it (the tests' pure-Python reference manager). Each member means what the
    compiled manager's does (``kvblocks/_core.pyi``)."""

    @property
    def num_blocks(self) -> int:
        """GPU blocks in the pool (block 0 is the reserved null block)."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of the swap space."""
        ...

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are shared by hash."""
        ...

    @property
    def record_events(self) -> bool:
        """Whether ``take_events`` has events to give."""
        ...

    @property
    def host_cache_blocks(self) -> int:
        """Slots of the host tier (0: no tier)."""
        ...

    @property
    def groups(self) -> list[GroupSpec]:
        """The KV cache groups, in order (one unless built with several)."""
        ...

    @property
    def num_groups(self) -> int:
        """How many KV cache groups (``len(groups)``)."""
        ...

    def seq_ids(self) -> npt.NDArray[np.int64]:
        """The ids of the sequences held."""
        ...

    def num_free_blocks(self) -> int:
        """GPU blocks free now."""
        ...

    def usage(self) -> float:
        """The fraction of usable GPU blocks in use."""
        ...

    def stats(self) -> dict[str, int | float]:
        """The manager's counters."""
        ...

    def add_sequence(
        self,
        seq_id: int,
        token_ids: _Ids,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        retention_priority: int | None = None,
    ) -> int:
        """Hold a new sequence; its prefix-cache hit in tokens."""
        ...

    def num_tokens(self, seq_id: int) -> int:
        """The sequence's tokens."""
        ...

    def num_computed_tokens(self, seq_id: int) -> int:
        """The sequence's tokens whose KV is computed (or cached)."""
        ...

    def num_tier_tokens(self, seq_id: int) -> int:
        """The sequence's tokens to be loaded from the host tier."""
        ...

    def num_tier_loads(self, seq_id: int) -> int:
        """The host-tier blocks a waiting sequence's claim would load, over all groups."""
        ...

    def token_ids(self, seq_id: int) -> npt.NDArray[np.uint32]:
        """The sequence's tokens (prompt, then the committed outputs)."""
        ...

    def limit_tier_loads(self, seq_id: int, max_loads: int) -> int:
        """Cap the sequence's pending tier loads; the loads kept."""
        ...

    def refresh_prefixes(self, seq_ids: _Ids) -> npt.NDArray[np.int64]:
        """Look the waiting sequences' prefixes up again; their new hits."""
        ...

    def probe_in_flight(self, seq_ids: _Ids) -> npt.NDArray[np.int64]:
        """Per sequence, blocks still in flight to the host tier."""
        ...

    def can_allocate(
        self, seq_id: int, *, num_lookahead_tokens: int = 0, num_new_tokens: int | None = None
    ) -> AllocStatus:
        """Whether the sequence's prompt (or its next ``num_new_tokens``) fits now, later
        or never."""
        ...

    def allocate_slots(
        self, seq_id: int, num_new_tokens: int, *, num_lookahead_tokens: int = 0
    ) -> npt.NDArray[np.int32] | None:
        """Slots for the sequence's next tokens, or None when the pool is short."""
        ...

    def allocate_slots_batch(
        self, seq_ids: _Ids, num_new_tokens: _IntOrArray, *, num_lookahead_tokens: int = 0
    ) -> BatchAllocation:
        """``allocate_slots`` for many sequences at once."""
        ...

    def commit(self, seq_id: int, num_new_computed_tokens: int, new_token_ids: _Ids = ()) -> None:
        """Record computed tokens (and sampled ones)."""
        ...

    def commit_batch(
        self,
        seq_ids: _Ids,
        num_new_computed_tokens: _IntOrArray,
        new_token_ids: _IntOrArray | None = None,
    ) -> None:
        """``commit`` for many sequences at once."""
        ...

    def fork(self, parent_id: int, child_id: int) -> None:
        """A child sharing every block of the parent."""
        ...

    def free(self, seq_id: int) -> None:
        """Release the sequence and its blocks."""
        ...

    def can_swap_out(self, seq_ids: _Ids) -> bool:
        """Whether the swap space holds the sequences' blocks."""
        ...

    def can_swap_in(self, seq_ids: _Ids) -> bool:
        """Whether the GPU pool holds the swapped sequences' blocks."""
        ...

    def swap_out(self, seq_ids: _Ids) -> npt.NDArray[np.int64]:
        """Move the sequences to the swap space; the ``(gpu, cpu)`` rows to copy."""
        ...

    def swap_in(self, seq_ids: _Ids) -> npt.NDArray[np.int64]:
        """Move the sequences back; the ``(cpu, gpu)`` rows to copy."""
        ...

    def take_copy_on_writes(self) -> npt.NDArray[np.int64]:
        """The ``(src, dst)`` block copies owed since the last call."""
        ...

    def take_memory_ops(self) -> list[tuple[str, npt.NDArray[np.int64]]]:
        """Every block move owed since the last call, in order."""
        ...

    def confirm_memory_ops(self) -> None:
        """The taken memory ops were applied."""
        ...

    def discard_memory_ops(self) -> None:
        """The taken memory ops failed: nothing they wrote into the host tier is trusted."""
        ...

    def block_tables(
        self, seq_ids: _Ids, *, max_blocks: int | None = None, group: int = 0
    ) -> npt.NDArray[np.int32]:
        """The sequences' block tables, padded."""
        ...

    def update_block_table(
        self,
        block_table: npt.NDArray[np.int32],
        seq_ids: _Ids,
        rows: _Ids,
        *,
        full: bool | None = None,
        group: int = 0,
    ) -> BlockTableDelta:
        """Write the sequences' changed block-table entries into ``block_table``."""
        ...

    def update_group_block_tables(
        self,
        block_tables: npt.NDArray[np.int32],
        seq_ids: _Ids,
        rows: _Ids,
        *,
        full: bool | None = None,
    ) -> list[BlockTableDelta]:
        """``update_block_table`` of every group in one call, on a ``[num_groups,
        max_rows, max_blocks]`` table; one delta per group."""
        ...

    def slot_mapping(
        self, seq_ids: _Ids, num_tokens: _IntOrArray | None = None, *, group: int = 0
    ) -> npt.NDArray[np.int64]:
        """The slots of the sequences' last ``num_tokens`` tokens."""
        ...

    def group_slot_mappings(
        self, seq_ids: _Ids, num_tokens: _IntOrArray | None = None
    ) -> npt.NDArray[np.int64]:
        """``slot_mapping`` of every group in one call, ``[num_groups, num_tokens]`` (a
        recurrent-state group's row is ``-1``)."""
        ...

    def state_mapping(self, seq_ids: _Ids, *, group: int) -> StateMapping:
        """Where the pending step of each sequence reads and writes the states of
        recurrent-state group ``group``."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no sequence holds; whether it could."""
        ...

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The KV events recorded since the last call."""
        ...


class EventPublisher(Protocol):
    """What the scheduler and ``LLM`` need of a KV-event publisher: ``publish`` one step's
    events, ``close``. :class:`kvblocks.events.ZmqEventPublisher` is one."""

    def publish(self, events: Sequence[Any]) -> None:
        """Queue one step's events (``KVCacheManager.take_events()`` output)."""

    def close(self) -> bool:
        """Flush and release the publisher; whether everything it ran in the background
        ended in time."""
        ...


@runtime_checkable
class TierStore(Protocol):
    """A store of KV block payloads keyed by block hash, below the GPU pool.

    Every tier holds payloads of one :class:`~kvblocks.tiers.layout.KVLayout`, stores each
    with a self-checking header (:mod:`kvblocks.tiers.codec`), evicts in LRU order within a
    retention priority when full, and never fails a caller because of its medium: a full
    tier evicts, a value that fails validation reads as a miss (counted in
    ``stats().rejected``), an unreachable backend reads as misses and drops puts (and logs
    it on the ``kvblocks.tiers`` logger). Only bad arguments raise
    (:class:`~kvblocks.errors.InvalidArgumentError`), and a call that raises changes
    nothing. A tier is not thread-safe: one per engine thread.
    """

    layout: KVLayout

    @property
    def capacity_blocks(self) -> int | None:
        """Blocks the tier holds at most (None: bounded by the backend, e.g. Valkey's
        ``maxmemory`` with an LRU ``maxmemory-policy``)."""
        ...

    def __len__(self) -> int:
        """Blocks stored now (as far as this client knows)."""
        ...

    def put(self, block_hash: bytes, kv: Payload, *, priority: int = 0) -> bool:
        """Store one block; True if stored. Evicts to make room; never raises for a full
        or failed medium."""
        ...

    def put_many(
        self, block_hashes: Sequence[bytes], kvs: Sequence[Payload], *, priority: int = 0
    ) -> int:
        """Store several blocks (pipelined where the backend allows); how many were stored."""
        ...

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each block's payload as a CPU uint8 ``[payload_nbytes]`` tensor, or None on a miss.

        Reads are batched (one gather, one MGET); a hit marks the block recently used.
        """
        ...

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is stored (no payload transfer, no recency change)."""
        ...

    def evict(self, block_hash: bytes) -> bool:
        """Remove one block; True if it was stored."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""
        ...

    def close(self) -> bool:
        """Release the tier's resources (files, connections); contents persist where the
        medium does. Whether everything it ran in the background ended in time (True for
        a tier with no background work)."""
        ...


RemoteTier: TypeAlias = "TierStore | Callable[[KVLayout], TierStore]"
"""What ``LLM(remote_tier=)`` takes: a store, or a factory called with the engine's host
layout (for a store whose layout depends on the model)."""
