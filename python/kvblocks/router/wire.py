"""Records from vLLM-format KV events, as a ZMQ subscriber decodes them.

vLLM's publishers (and :class:`kvblocks.events.ZmqEventPublisher`) send msgpack
``KVEventBatch`` payloads whose events are maps tagged ``"type"`` (vLLM v0.26+) or
positional arrays led by the tag (older vLLM). :func:`records_from_wire` takes the events
of one batch in any of the forms a subscriber holds them: decoded with plain
``msgspec.msgpack.decode`` (dicts or lists), or decoded into msgspec structs named
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (vLLM's own classes or
:mod:`kvblocks.events.wire`'s). Block hashes stay as sent: ``bytes`` (whole digests), or
``int`` (vLLM's default, the low 64 bits) — hash prompts with
``PromptHasher.block_hashes(..., hash_format="int")`` to match the latter.

vLLM 0.33's fields are read where the index needs them (``group_idx``, ``None`` meaning
group 0; ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``, the group's hit
rule; ``block_size``) and type-checked where a record keeps them; the others
(``extra_keys``, ``locality``, ``session_id``, ...) are accepted and not used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvblocks.errors import InvalidArgumentError
from kvblocks.router.events import (
    DEFAULT_MEDIUM,
    AllBlocksClearedRecord,
    BlockRemovedRecord,
    BlockStoredRecord,
    EventRecord,
)
from kvblocks.validation import check_block_hashes, check_int, check_iterable

__all__ = ["records_from_wire"]

# Positional layouts of the array form (after the tag).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip
# vLLM 0.33's group fields (map and struct forms only).
_GROUP_FIELDS = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def _fields(event: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(event, dict):
        kind = event.get("type")
        return str(kind), event
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        kind = event[0]
        names = _ARRAY_FIELDS.get(kind, ())
        return kind, dict(zip(names, event[1:], strict=False))
    kind = type(event).__name__.removeprefix("Array")
    if kind not in _ARRAY_FIELDS:
        raise InvalidArgumentError(f"not a KV cache event: {type(event).__name__}")
    return kind, {n: getattr(event, n, None) for n in (*_ARRAY_FIELDS[kind], *_GROUP_FIELDS)}


def _group_idx(value: Any) -> int:
    if value is None:
        return 0
    return check_int(value, "group_idx", minimum=0, expected="None or an int >= 0")


def _optional_positive(value: Any, name: str) -> int | None:
    if value is None:
        return None
    return check_int(value, name, minimum=1, expected="None or an int >= 1")


def _hashes(values: Any) -> tuple[bytes | int, ...]:
    if not isinstance(values, (list, tuple)):
        raise InvalidArgumentError(f"block_hashes must be a list, got {type(values).__name__}")
    check_block_hashes(values, "block_hashes")
    return tuple(values)


def records_from_wire(instance: int, events: Iterable[Any]) -> list[EventRecord]:
    """Records for one instance's events (one ``KVEventBatch.events``), in order.

    Raises:
        InvalidArgumentError: an event of another type or with malformed fields (nothing
            is returned for the batch).
    """
    if not isinstance(events, Iterable):
        # A decoded batch's events field is untrusted: null or a scalar on the wire.
        raise InvalidArgumentError(f"events must be a list of events, got {type(events).__name__}")
    out: list[EventRecord] = []
    for event in check_iterable(events, "events", "events"):  # a 0-d array is Iterable
        kind, f = _fields(event)
        medium = f.get("medium") or DEFAULT_MEDIUM
        if not isinstance(medium, str):
            raise InvalidArgumentError(f"medium must be a string, got {medium!r}")
        if kind == "BlockStored":
            parent = f.get("parent_block_hash")
            if parent is not None:
                _hashes([parent])
            hashes = _hashes(f.get("block_hashes"))
            group = _group_idx(f.get("group_idx"))
            spec_kind = f.get("kv_cache_spec_kind")
            if spec_kind is not None and not isinstance(spec_kind, str):
                raise InvalidArgumentError(
                    f"kv_cache_spec_kind must be a string or None, got {spec_kind!r}"
                )
            window = _optional_positive(
                f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
            )
            # 0 (host-tier events of blocks offloaded at eviction) says nothing.
            block_size = _optional_positive(f.get("block_size") or None, "block_size")
            out.append(
                BlockStoredRecord(
                    instance, hashes, parent, medium, group, spec_kind, window, block_size
                )
            )
        elif kind == "BlockRemoved":
            hashes = _hashes(f.get("block_hashes"))
            group = _group_idx(f.get("group_idx"))
            out.append(BlockRemovedRecord(instance, hashes, medium, group))
        elif kind == "AllBlocksCleared":
            out.append(AllBlocksClearedRecord(instance))
        else:
            raise InvalidArgumentError(f"not a KV cache event: {kind!r}")
    return out
