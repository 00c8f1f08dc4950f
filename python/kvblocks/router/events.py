"""KV cache events as plain records, whatever stream they came from.

The prefix index (:class:`~kvblocks.router.index.PrefixIndex`) takes these records, not
the binding's event objects, so any source can feed it: an in-process
:meth:`KVCacheManager.take_events` drain (:func:`records_from_manager`), or a subscriber
decoding vLLM's ZMQ wire format (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, each with an optional ``medium``), which only has to build the same
three records.

A record keeps the event's KV cache group (``group_idx``, vLLM 0.33): a block leaving one
group (a sliding-window group drops blocks a full-attention group keeps) must not erase
another group's copy from the index. A ``BlockStored`` record also keeps the group's kind
and window (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) and the block size,
from which the index learns what the group needs to serve a hit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvblocks._core import AllBlocksCleared, BlockRemoved, BlockStored
from kvblocks.errors import InvalidTypeError
from kvblocks.validation import check_iterable

__all__ = [
    "DEFAULT_MEDIUM",
    "AllBlocksClearedRecord",
    "BlockHash",
    "BlockRemovedRecord",
    "BlockStoredRecord",
    "EventRecord",
    "records_from_manager",
]

BlockHash = bytes | int
"""A block hash as events carry it: the whole digest (``bytes``), or vLLM's default wire
form, the low 64 bits as an ``int`` (see :mod:`kvblocks.router.wire`)."""

DEFAULT_MEDIUM = "GPU"
"""Tier of an event that names none (vLLM's ``medium=None`` means the GPU pool)."""


@dataclass(frozen=True)
class BlockStoredRecord:
    """Full blocks entered ``instance``'s cache in tier ``medium``.

    Attributes:
        instance: the instance that stored them (any hashable id; the simulation uses ints).
        block_hashes: the blocks' hashes, prefix order (each chains its parent's).
        parent_block_hash: hash of the block before the first one, ``None`` at the start.
        medium: the tier (``"GPU"``, ``"CPU"``, ``"DISK"``, ...).
        group_idx: the KV cache group (0 for a single-group model, vLLM's ``None``).
        kv_cache_spec_kind: what the group's layers attend to (vLLM 0.33's
            ``"full_attention"``, ``"sliding_window"``, ``"chunked_local_attention"``,
            ``"mamba"``); ``None`` when the event names none (taken as full attention).
        kv_cache_spec_sliding_window: the group's window in tokens (window groups).
        block_size: tokens per block (the index needs it for a window group's rule).
    """

    instance: int
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    medium: str = DEFAULT_MEDIUM
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class BlockRemovedRecord:
    """Blocks left ``instance``'s cache in tier ``medium``, KV cache group ``group_idx``."""

    instance: int
    block_hashes: tuple[BlockHash, ...]
    medium: str = DEFAULT_MEDIUM
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksClearedRecord:
    """``instance`` dropped every cached block (all tiers)."""

    instance: int


EventRecord = BlockStoredRecord | BlockRemovedRecord | AllBlocksClearedRecord


def records_from_manager(
    instance: int,
    events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared],
    medium: str | None = None,
) -> list[EventRecord]:
    """Convert events drained from ``KVCacheManager.take_events()`` into records.

    Each record keeps its event's tier (``"GPU"``, or ``"CPU"`` for the host tier): a
    block leaving the host tier must not erase the GPU copy from a router's index.
    ``medium``, when given, is recorded for every event instead (only right for a manager
    without a host tier, whose events are all on the GPU).

    Raises:
        InvalidTypeError: ``events`` is not a sequence, or an item is not one of the
            binding's three event classes.
    """
    out: list[EventRecord] = []
    for ev in check_iterable(events, "events", "KV cache events"):
        if isinstance(ev, BlockStored):
            out.append(
                BlockStoredRecord(
                    instance,
                    tuple(ev.block_hashes),
                    ev.parent_block_hash,
                    ev.medium if medium is None else medium,
                    ev.group_idx,
                    ev.kv_cache_spec_kind,
                    ev.kv_cache_spec_sliding_window,
                    ev.block_size,
                )
            )
        elif isinstance(ev, BlockRemoved):
            out.append(
                BlockRemovedRecord(
                    instance,
                    tuple(ev.block_hashes),
                    ev.medium if medium is None else medium,
                    ev.group_idx,
                )
            )
        elif isinstance(ev, AllBlocksCleared):
            out.append(AllBlocksClearedRecord(instance))
        else:
            raise InvalidTypeError(f"not a KV cache event: {type(ev).__name__}")
    return out
