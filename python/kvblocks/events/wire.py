"""vLLM's KV-event wire format: the msgspec structs and the conversion from kvblocks' events.

The structs mirror ``vllm/distributed/kv_events.py`` of vLLM 0.33 field for field, so a
subscriber built from vLLM's own classes decodes what
:class:`~kvblocks.events.ZmqEventPublisher` sends, and the bytes are the ones vLLM 0.33
sends for the same blocks (``tests/events/data`` holds vLLM's own encoding to compare):

* the batch, ``KVEventBatch(ts, events, data_parallel_rank)``, is a positional msgpack
  array (``array_like``), as in every vLLM release;
* each event is a msgpack map tagged ``"type": "BlockStored" | "BlockRemoved" |
  "AllBlocksCleared"`` (``wire_format="map"``, vLLM since its PR #42892, v0.26 and later),
  or a positional array whose first element is the tag (``wire_format="array"``, older
  vLLM and the subscribers written for it). Trailing fields an older subscriber does not
  know are skipped by msgspec, so the array form carries the fields up to ``lora_name``.

Block hashes are vLLM's ``ExternalBlockHash`` (``bytes | int``). vLLM publishes the low 64
bits of each digest as an unsigned int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
and the whole digest as bytes otherwise; ``hash_format="int"``/``"bytes"`` picks the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec

from kvblocks._core import AllBlocksCleared as CoreAllBlocksCleared
from kvblocks._core import BlockRemoved as CoreBlockRemoved
from kvblocks._core import BlockStored as CoreBlockStored
from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.validation import check_iterable

WireFormat = Literal["map", "array"]
HashFormat = Literal["int", "bytes"]

#: vLLM's ``medium`` for blocks in the GPU pool.
MEDIUM_GPU = "GPU"

ExternalBlockHash = bytes | int


class KVEventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    """One step's events: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base of the map-encoded events (tag field ``"type"``, value the class name)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache (vLLM's field order and defaults)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # vLLM 0.33's fields for offloading tiers, sessions and lookahead hashing: kvblocks
    # sends none of them (left at None, they are not encoded), a subscriber may.
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped."""


class ArrayKVCacheEvent(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
    tag=True,
    tag_field="type",
):
    """Base of the positional events of vLLM before its PR #42892."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    """``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium,
    lora_name]``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    """``["BlockRemoved", block_hashes, medium]``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    """``["AllBlocksCleared"]``."""


WireEvent = (
    BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | ArrayBlockStored
    | ArrayBlockRemoved
    | ArrayAllBlocksCleared
)


_EVENT_TYPES = (
    CoreBlockStored,
    CoreBlockRemoved,
    CoreAllBlocksCleared,
    KVCacheEvent,
    ArrayKVCacheEvent,
)
# The concrete classes: one set lookup per element, in C, for the usual batch.
_EVENT_CLASSES = frozenset(
    {
        CoreBlockStored,
        CoreBlockRemoved,
        CoreAllBlocksCleared,
        BlockStored,
        BlockRemoved,
        AllBlocksCleared,
        ArrayBlockStored,
        ArrayBlockRemoved,
        ArrayAllBlocksCleared,
    }
)


def check_events(events: object) -> Sequence[Any]:
    """``events`` when it is a sequence (a list, a tuple) of kvblocks or wire events, the
    input of :func:`to_wire_events`; else :class:`InvalidTypeError` naming what was given.

    A type check per element and nothing more: :meth:`ZmqEventPublisher.publish` runs it on
    the step's thread, so a bad argument raises at its caller instead of failing later on
    the sending thread.
    """
    if isinstance(events, (str, bytes, bytearray)) or not isinstance(events, Sequence):
        raise InvalidTypeError(
            f"events must be a list of KV cache events, got {type(events).__name__}"
        )
    if not _EVENT_CLASSES.issuperset(map(type, events)):
        # A subclass of a wire struct is an event too; anything else is named.
        for i, ev in enumerate(events):
            if not isinstance(ev, _EVENT_TYPES):
                raise InvalidTypeError(f"events[{i}] is not a KV cache event: {type(ev).__name__}")
    return events


def convert_hash(digest: bytes, hash_format: HashFormat) -> ExternalBlockHash:
    """A kvblocks block hash as vLLM publishes it: the low 64 bits (the digest's last 8
    bytes, big-endian, unsigned) or the digest itself."""
    if hash_format == "int":
        # low64 without its type check: the digests are the core's bytes, one per block
        # of every published event.
        return int.from_bytes(digest[-8:], "big")
    return bytes(digest)


def check_formats(wire_format: str, hash_format: str) -> None:
    """Raise :class:`InvalidArgumentError` for an unknown wire or hash format."""
    if not isinstance(wire_format, str) or wire_format not in ("map", "array"):
        raise InvalidArgumentError(f"wire_format must be 'map' or 'array', got {wire_format!r}")
    if not isinstance(hash_format, str) or hash_format not in ("int", "bytes"):
        raise InvalidArgumentError(f"hash_format must be 'int' or 'bytes', got {hash_format!r}")


def to_wire_events(
    events: Iterable[Any],
    *,
    wire_format: WireFormat = "map",
    hash_format: HashFormat = "int",
) -> list[WireEvent]:
    """Convert :meth:`KVCacheManager.take_events` output to vLLM's event structs.

    Events that already are wire structs pass through unchanged. Every field comes from
    the event: ``medium`` (``"GPU"`` or the host tier's ``"CPU"``), ``lora_name``,
    ``extra_keys`` (vLLM's untagged per-block keys, ``hash_algo="sha256_cbor"`` only),
    ``group_idx`` and the group's ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``.
    The array form stops at ``lora_name``, as the subscribers of older vLLM expect.

    Raises:
        InvalidArgumentError: an unknown ``wire_format`` or ``hash_format``.
        InvalidTypeError: ``events`` is not a sequence, or an event that is neither a
            kvblocks nor a wire event.
    """
    check_formats(wire_format, hash_format)
    array = wire_format == "array"
    out: list[WireEvent] = []
    for ev in check_iterable(events, "events", "KV cache events"):
        if isinstance(ev, CoreBlockStored):
            hashes = [convert_hash(h, hash_format) for h in ev.block_hashes]
            parent = ev.parent_block_hash
            parent_w = None if parent is None else convert_hash(parent, hash_format)
            medium = ev.medium
            tokens = list(ev.token_ids)
            lora_name = ev.lora_name
            if array:
                out.append(
                    ArrayBlockStored(
                        hashes, parent_w, tokens, ev.block_size, ev.lora_id, medium, lora_name
                    )
                )
            else:
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=parent_w,
                        token_ids=tokens,
                        block_size=ev.block_size,
                        lora_id=ev.lora_id,
                        medium=medium,
                        lora_name=lora_name,
                        extra_keys=ev.extra_keys,
                        group_idx=ev.group_idx,
                        kv_cache_spec_kind=ev.kv_cache_spec_kind,
                        kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window,
                    )
                )
        elif isinstance(ev, CoreBlockRemoved):
            hashes = [convert_hash(h, hash_format) for h in ev.block_hashes]
            medium = ev.medium
            if array:
                out.append(ArrayBlockRemoved(hashes, medium))
            else:
                out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=ev.group_idx))
        elif isinstance(ev, CoreAllBlocksCleared):
            out.append(ArrayAllBlocksCleared() if array else AllBlocksCleared())
        elif isinstance(ev, (KVCacheEvent, ArrayKVCacheEvent)):
            out.append(ev)  # type: ignore[arg-type]
        else:
            raise InvalidTypeError(f"not a KV cache event: {type(ev).__name__}")
    return out
