"""The records of the reference block manager (:mod:`oracle.reference_manager`): its
batch-allocation result and KV cache events (mirrors of the core's), a sequence's state,
the free queue, and the content hash of a full block."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

_NULL_BLOCK = 0
_HASH_ALGOS = ("blake3", "xxh3_128")
# The root "parent" of a sequence's first block; any fixed value distinct from real digests.
_ROOT_HASH = b"\x00" * 32


@dataclass(frozen=True)
class RefBatchAllocation:
    """``BatchAllocation`` of the reference model."""

    num_served: int
    num_cached_tokens: npt.NDArray[np.int64]
    block_ids: npt.NDArray[np.int32]
    block_indptr: npt.NDArray[np.int64]


@dataclass(frozen=True)
class RefBlockStored:
    """Full blocks entered the prefix cache (mirrors :class:`kvblocks.BlockStored`)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


@dataclass(frozen=True)
class RefBlockRemoved:
    """Blocks left the prefix cache (mirrors :class:`kvblocks.BlockRemoved`)."""

    block_hashes: list[bytes]


@dataclass(frozen=True)
class RefAllBlocksCleared:
    """The prefix cache was cleared (mirrors :class:`kvblocks.AllBlocksCleared`)."""


RefEvent = RefBlockStored | RefBlockRemoved | RefAllBlocksCleared


@dataclass
class _Sequence:
    """Everything the manager knows about one sequence."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    salt: bytes | None
    lora_id: int | None
    # Content hashes of the sequence's full blocks (of known tokens), extended as blocks fill.
    hashes: list[bytes]
    # Blocks of cached prefix found by add_sequence: the claim may shrink, never grow past it.
    probe_cap: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    # Slots reserved by the last allocate_slots (computed + new + lookahead); None after commit.
    reserved: int | None = None
    # Tokens the pending reservation's new tokens reach (computed + new, no lookahead).
    reserved_known: int = 0
    allocated: bool = False
    swapped: bool = False
    num_cached_tokens: int = 0
    # Leading blocks already offered to the prefix cache (cached or claimed).
    num_committed_blocks: int = 0
    # Leading table entries released by the sliding window (all null).
    num_released: int = 0


class _FreeQueue:
    """Free blocks in eviction order: pop from the front, push to either end, remove on hit."""

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def pop_front(self) -> int:
        return self._order.popitem(last=False)[0]

    def push_front(self, block_id: int) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id, last=False)

    def push_back(self, block_id: int) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]


def _block_hash(
    parent: bytes | None, salt: bytes | None, lora_id: int | None, tokens: Sequence[int]
) -> bytes:
    """Content hash of one full block; every field tagged and length-prefixed."""
    h = hashlib.sha256()
    h.update(b"kvblocks.block.v1")
    h.update(b"P" + (parent if parent is not None else _ROOT_HASH))
    if salt is None:
        h.update(b"S0")
    else:
        h.update(b"S1" + struct.pack("<Q", len(salt)) + salt)
    if lora_id is None:
        h.update(b"L0")
    else:
        h.update(b"L1" + struct.pack("<Q", lora_id))
    h.update(b"T" + struct.pack("<Q", len(tokens)))
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return h.digest()
