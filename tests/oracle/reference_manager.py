"""A pure-Python model of :class:`kvblocks.KVCacheManager`: a test oracle and benchmark baseline.

Not part of the installed package. The content oracle (``kv_memory.py`` beside this file)
is the primary check of the manager; this model is kept for what the oracle cannot see:
exact block ids, free-queue (eviction) order, events and counters.

:class:`ReferenceKVCacheManager` implements the API of ``kvblocks/_core.pyi`` with the
semantics documented there and in the core crate, in plain Python: dicts, lists and an
``OrderedDict`` as the free queue. It hands out exactly the same block ids as the Rust core
(same free-queue ordering rules), so tests compare the two step by step, and it is the
baseline of the benchmarks in ``benches/core``. Its hashes are SHA-256 digests rather than
the core's BLAKE3/xxh3 ones: the values differ but which blocks hit does not.

It is written for clarity, not speed; use :class:`kvblocks.KVCacheManager` in engines.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvblocks._core import AllocStatus
from kvblocks.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvariantViolationError,
    OutOfBlocksError,
    SequenceStateError,
    UnknownSequenceError,
)

__all__ = [
    "RefAllBlocksCleared",
    "RefBlockRemoved",
    "RefBlockStored",
    "ReferenceKVCacheManager",
]

_NULL_BLOCK = 0
_MAX_SEQ_ID = 2**63
_MAX_TOKEN_ID = 2**32
_MAX_LORA_ID = 2**64
_MAX_COUNT = 2**63
_MAX_BLOCKS = 2**26
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


def _check_int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value < hi:
        raise InvalidArgumentError(f"{name} must be in [{lo}, {hi}), got {value}")
    return value


def _int_list(values: object, name: str, lo: int, hi: int) -> list[int]:
    """A 1-D integer array or sequence as a list of ints in ``[lo, hi)``."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise InvalidArgumentError(f"{name} must be 1-D, got {values.ndim} dimensions")
        if values.size and not np.issubdtype(values.dtype, np.integer):
            raise InvalidArgumentError(f"{name} must have an integer dtype, got {values.dtype}")
        out = [int(v) for v in values.tolist()]
    elif isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(
            f"{name} must be a sequence of ints, got {type(values).__name__}"
        )
    else:
        out = [_check_int(v, name, lo, hi) for v in values]
    for v in out:
        if not lo <= v < hi:
            raise InvalidArgumentError(f"every {name} entry must be in [{lo}, {hi}), got {v}")
    return out


def _per_seq(values: object, n: int, name: str, lo: int, hi: int) -> list[int]:
    """An int broadcast to ``n`` entries, or an array/sequence of exactly ``n`` entries."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, (bool, np.bool_)):
        return [_check_int(values, name, lo, hi)] * n
    out = _int_list(values, name, lo, hi)
    if len(out) != n:
        raise InvalidArgumentError(
            f"{name} has {len(out)} entries, expected one per sequence ({n})"
        )
    return out


class ReferenceKVCacheManager:
    """Pure-Python model of :class:`kvblocks.KVCacheManager` (same arguments and results).

    See ``kvblocks/_core.pyi`` for the documentation of every method.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        hash_algo: str = "blake3",
        watermark: float = 0.01,
        sliding_window: int | None = None,
        record_events: bool = True,
    ) -> None:
        # Same limits as the core: pools of at most 2**26 blocks, blocks of at most 2**20.
        self._num_blocks = _check_int(num_blocks, "num_blocks", 2, _MAX_BLOCKS + 1)
        self._block_size = _check_int(block_size, "block_size", 1, 2**20 + 1)
        self._num_cpu_blocks = _check_int(num_cpu_blocks, "num_cpu_blocks", 0, _MAX_BLOCKS + 1)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise InvalidArgumentError(
                f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}"
            )
        if not isinstance(record_events, (bool, np.bool_)):
            raise InvalidArgumentError(
                f"record_events must be a bool, got {type(record_events).__name__}"
            )
        if not isinstance(hash_algo, str) or hash_algo not in _HASH_ALGOS:
            raise InvalidArgumentError(f"hash_algo must be one of {_HASH_ALGOS}, got {hash_algo!r}")
        if isinstance(watermark, (bool, np.bool_, str)) or not isinstance(
            watermark, (int, float, np.integer, np.floating)
        ):
            raise InvalidArgumentError(f"watermark must be a float, got {type(watermark).__name__}")
        watermark = float(watermark)
        if not 0.0 <= watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window is not None:
            sliding_window = _check_int(sliding_window, "sliding_window", 1, 2**63)
        self._caching = bool(enable_prefix_caching)
        self._record_events = bool(record_events)
        self._hash_algo = hash_algo
        self._watermark = watermark
        self._watermark_blocks = math.floor(watermark * self._num_blocks)
        self._sliding_window = sliding_window

        self._refcount = [0] * self._num_blocks
        self._block_hash: list[bytes | None] = [None] * self._num_blocks
        self._free = _FreeQueue(range(1, self._num_blocks))
        # hash -> every cached block holding it (a prefix computed again is one more
        # copy), the head first; a new copy goes right after the head, as in the core.
        self._cache: dict[bytes, list[int]] = {}
        self._cpu_refcount = [0] * self._num_cpu_blocks
        self._cpu_free = _FreeQueue(range(self._num_cpu_blocks))
        self._seqs: dict[int, _Sequence] = {}
        # Every block move in issue order, as the core journals them: (kind, src, dst).
        self._ops: list[tuple[str, int, int]] = []
        self._events: list[RefEvent] = []
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._evictions = 0
        self._cow_copies = 0
        self._swapped_out = 0
        self._swapped_in = 0

    # -- configuration ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """GPU blocks in the pool, the null block included."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU swap pool."""
        return self._num_cpu_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are shared by content hash."""
        return self._caching

    @property
    def hash_algo(self) -> str:
        """The configured hash algorithm name (the model always uses SHA-256)."""
        return self._hash_algo

    @property
    def watermark(self) -> float:
        """Fraction of GPU blocks kept free at admission."""
        return self._watermark

    @property
    def sliding_window(self) -> int | None:
        """Attention window in tokens, or None."""
        return self._sliding_window

    @property
    def record_events(self) -> bool:
        """Whether KV cache events are queued for ``take_events``."""
        return self._record_events

    @property
    def null_block(self) -> int:
        """The reserved block id used for padding and released window blocks."""
        return _NULL_BLOCK

    # -- pool state ------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Free GPU blocks, cached-but-unreferenced ones included."""
        return len(self._free)

    def num_free_cpu_blocks(self) -> int:
        """Free CPU blocks."""
        return len(self._cpu_free)

    def usage(self) -> float:
        """Fraction of usable GPU blocks referenced by some sequence."""
        usable = self._num_blocks - 1
        return (usable - len(self._free)) / usable

    def __len__(self) -> int:
        """Number of sequences held."""
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        """Whether the manager holds ``seq_id``."""
        return isinstance(seq_id, (int, np.integer)) and int(seq_id) in self._seqs

    def __repr__(self) -> str:
        return (
            f"ReferenceKVCacheManager(num_blocks={self._num_blocks}, "
            f"block_size={self._block_size}, free={len(self._free)}, "
            f"sequences={len(self._seqs)})"
        )

    def seq_ids(self) -> npt.NDArray[np.int64]:
        """Ids of the sequences held, ascending."""
        return np.array(sorted(self._seqs), dtype=np.int64)

    # -- internal helpers ------------------------------------------------------------
    def _get(self, seq_id: object) -> tuple[int, _Sequence]:
        sid = _check_int(seq_id, "seq_id", 0, _MAX_SEQ_ID)
        seq = self._seqs.get(sid)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence id {sid}")
        return sid, seq

    def _get_running(self, seq_id: object, op: str) -> tuple[int, _Sequence]:
        sid, seq = self._get(seq_id)
        self._require_resident(seq, op)
        return sid, seq

    @staticmethod
    def _require_resident(seq: _Sequence, op: str) -> None:
        if seq.swapped:
            raise SequenceStateError(
                f"cannot {op} sequence {seq.seq_id}: it is swapped out (swap it in first)"
            )

    def _batch_seqs(self, ids: list[int]) -> list[_Sequence]:
        """The sequences of a batch call, in order; no id may be listed twice."""
        seen: set[int] = set()
        out = []
        for sid in ids:
            seq = self._seqs.get(sid)
            if seq is None:
                raise UnknownSequenceError(f"unknown sequence id {sid}")
            if sid in seen:
                raise InvalidArgumentError(
                    f"sequence id {sid} is listed twice; expected distinct ids"
                )
            seen.add(sid)
            out.append(seq)
        return out

    def _claim_start(self, n: int) -> int:
        """The first block a hit of ``n`` blocks claims: with a sliding window, the blocks
        before the window of the query at ``n * block_size`` are not needed."""
        if self._sliding_window is None:
            return 0
        visible = max(n * self._block_size + 1 - self._sliding_window, 0)
        return min(visible // self._block_size, n)

    def _probe_blocks(self, seq: _Sequence) -> int:
        """Blocks of the sequence's prompt a claim serves now (capped): the longest hit
        whose claimed blocks are all cached."""
        if not self._caching:
            return 0
        n = min(seq.probe_cap, len(seq.hashes))
        while True:
            missing = [
                i for i in range(self._claim_start(n), n) if seq.hashes[i] not in self._cache
            ]
            if not missing:
                return n
            n = max(missing)

    def _claimed_block(self, h: bytes) -> int:
        """The cached block of ``h`` a claim takes: a copy in use if any (sharing it takes
        nothing from the free queue), else the head."""
        copies = self._cache[h]
        return next((b for b in copies if self._refcount[b] > 0), copies[0])

    def _pop_free(self) -> int:
        """Take the front block of the free queue, evicting its cache entry if it has one."""
        block = self._free.pop_front()
        h = self._block_hash[block]
        if h is not None:
            copies = self._cache.get(h, [])
            if block in copies:
                copies.remove(block)
                if not copies:
                    del self._cache[h]
            self._block_hash[block] = None
            if self._record_events:
                self._events.append(RefBlockRemoved([h]))
            self._evictions += 1
        return block

    def _release(self, block: int) -> None:
        """Drop one reference; a block reaching zero joins the free queue."""
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._block_hash[block] is None:
                self._free.push_front(block)
            else:
                self._free.push_back(block)

    def _release_cpu(self, block: int) -> None:
        self._cpu_refcount[block] -= 1
        if self._cpu_refcount[block] == 0:
            self._cpu_free.push_front(block)

    def _release_table(self, table: list[int]) -> None:
        for block in reversed(table):
            if block != _NULL_BLOCK:
                self._release(block)

    def _seq_hash(self, seq: _Sequence, index: int) -> bytes:
        """Hash of the sequence's ``index``-th full block, computing missing ones."""
        bs = self._block_size
        while len(seq.hashes) <= index:
            i = len(seq.hashes)
            parent = seq.hashes[i - 1] if i else None
            seq.hashes.append(
                _block_hash(parent, seq.salt, seq.lora_id, seq.token_ids[i * bs : (i + 1) * bs])
            )
        return seq.hashes[index]

    # -- sequences -------------------------------------------------------------------
    def add_sequence(
        self,
        seq_id: int,
        token_ids: object,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> int:
        """Register a sequence and its prompt; return how many leading tokens are cached."""
        sid = _check_int(seq_id, "seq_id", 0, _MAX_SEQ_ID)
        tokens = _int_list(token_ids, "token_ids", 0, _MAX_TOKEN_ID)
        if isinstance(cache_salt, str):
            salt: bytes | None = cache_salt.encode()
        elif cache_salt is None or isinstance(cache_salt, bytes):
            salt = cache_salt
        else:
            raise InvalidArgumentError(
                f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__}"
            )
        if lora_id is not None:
            lora_id = _check_int(lora_id, "lora_id", 0, _MAX_LORA_ID)
        if sid in self._seqs:
            raise DuplicateSequenceError(f"sequence id {sid} is already held")
        seq = _Sequence(
            seq_id=sid,
            token_ids=tokens,
            prompt_len=len(tokens),
            salt=salt,
            lora_id=lora_id,
            hashes=[],
            probe_cap=max(len(tokens) - 1, 0) // self._block_size,
        )
        if self._caching:
            full = len(tokens) // self._block_size
            if full:
                self._seq_hash(seq, full - 1)
            seq.probe_cap = self._probe_blocks(seq)
        else:
            seq.probe_cap = 0
        seq.num_cached_tokens = seq.probe_cap * self._block_size
        self._seqs[sid] = seq
        return seq.num_cached_tokens

    def num_tokens(self, seq_id: int) -> int:
        """Known tokens: prompt plus committed sampled tokens."""
        return len(self._get(seq_id)[1].token_ids)

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is in the cache (the current prefix probe before allocation)."""
        seq = self._get(seq_id)[1]
        if not seq.allocated:
            return self._probe_blocks(seq) * self._block_size
        return seq.num_computed

    def num_cached_tokens(self, seq_id: int) -> int:
        """Prompt tokens served from the prefix cache."""
        seq = self._get(seq_id)[1]
        if not seq.allocated:
            return self._probe_blocks(seq) * self._block_size
        return seq.num_cached_tokens

    def token_ids(self, seq_id: int) -> npt.NDArray[np.uint32]:
        """The sequence's known tokens."""
        return np.array(self._get(seq_id)[1].token_ids, dtype=np.uint32)

    def is_swapped(self, seq_id: int) -> bool:
        """Whether the sequence's blocks are in the CPU pool."""
        return self._get(seq_id)[1].swapped

    def probe_prefixes(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """``num_computed_tokens`` of many sequences."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        return np.array([self.num_computed_tokens(s) for s in ids], dtype=np.int64)

    def refresh_prefixes(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """Re-probe the cache for waiting sequences, resetting their caps; new hit counts."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        seqs = []
        for sid in ids:
            seq = self._get(sid)[1]
            self._require_resident(seq, "refresh_prefixes")
            if seq.allocated:
                raise SequenceStateError(
                    f"cannot refresh_prefixes sequence {sid}: it already has slots (its "
                    "cached prefix was claimed); only waiting sequences can be refreshed"
                )
            seqs.append(seq)
        out = []
        for seq in seqs:
            seq.probe_cap = max(seq.prompt_len - 1, 0) // self._block_size
            seq.probe_cap = self._probe_blocks(seq)
            seq.num_cached_tokens = seq.probe_cap * self._block_size
            out.append(seq.num_cached_tokens)
        return np.array(out, dtype=np.int64)

    def probe_in_flight(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """Prompt tokens right past each waiting sequence's hit that pending reservations
        of other sequences fill (blocks whose hashes are known), never the last token."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        seqs = []
        for sid in ids:
            seq = self._get(sid)[1]
            self._require_resident(seq, "probe_in_flight")
            if seq.allocated:
                raise SequenceStateError(
                    f"cannot probe_in_flight sequence {sid}: it already has slots (its cached "
                    "prefix was claimed); only waiting sequences can be probed"
                )
            seqs.append(seq)
        bs = self._block_size
        # Recomputed from every pending reservation on each call: no bookkeeping to trust.
        flights: set[bytes] = set()
        for other in self._seqs.values():
            if self._caching and other.reserved is not None:
                end = min(other.reserved_known // bs, len(other.hashes))
                flights.update(other.hashes[other.num_committed_blocks : end])
        out = []
        for seq in seqs:
            hit = self._probe_blocks(seq)
            limit = min(max(seq.prompt_len - 1, 0) // bs, len(seq.hashes))
            n = hit
            while n < limit and seq.hashes[n] in flights:
                n += 1
            out.append((n - hit) * bs)
        return np.array(out, dtype=np.int64)

    def can_allocate(
        self, seq_id: int, *, num_lookahead_tokens: int = 0, num_new_tokens: int | None = None
    ) -> AllocStatus:
        """Can the whole known sequence get blocks, keeping the watermark free? With
        ``num_new_tokens``: can that step (past the cached prefix) get them, and can the
        known tokens ever be computed (one a step: the window's worst count)?"""
        lookahead = _check_int(num_lookahead_tokens, "num_lookahead_tokens", 0, _MAX_COUNT)
        sid, seq = self._get_running(seq_id, "check admission of")
        if seq.allocated:
            raise SequenceStateError(
                f"can_allocate({sid}) is for sequences not yet allocated; it already holds blocks"
            )
        bs = self._block_size
        hits = self._probe_blocks(seq)
        start = self._claim_start(hits)
        if num_new_tokens is not None:
            new = _check_int(num_new_tokens, "num_new_tokens", 0, _MAX_COUNT)
            _, computed, _, _, taken = self._plan_allocation(sid, seq, new, lookahead)
            held = -(-(computed + new + lookahead) // bs) - start
            for p in range(computed, len(seq.token_ids)):
                first = start
                if self._sliding_window is not None:
                    first = max(first, max(p + 1 - self._sliding_window, 0) // bs)
                held = max(held, -(-(p + 1 + lookahead) // bs) - first)
            if held > self._num_blocks - 1 - self._watermark_blocks:
                return AllocStatus.NEVER
            if len(self._free) - taken < self._watermark_blocks:
                return AllocStatus.LATER
            return AllocStatus.OK
        required = -(-(len(seq.token_ids) + lookahead) // bs) - start
        shared = sum(
            1 for h in seq.hashes[start:hits] if self._refcount[self._claimed_block(h)] > 0
        )
        needed = required - shared
        if required > self._num_blocks - 1 - self._watermark_blocks:
            return AllocStatus.NEVER
        if len(self._free) - needed < self._watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def _plan_allocation(
        self, sid: int, seq: _Sequence, num_new: int, lookahead: int
    ) -> tuple[list[int], int, int, bool, int]:
        """Validate and size one allocation without changing anything.

        Returns (claimed blocks, computed after the claim, blocks to append, whether the
        write block needs a copy, blocks taken from the free pool in all).
        """
        bs = self._block_size
        claim: list[int] = []
        computed = seq.num_computed
        table_len = len(seq.block_table)
        if not seq.allocated:
            hits = self._probe_blocks(seq)
            claim = [self._claimed_block(h) for h in seq.hashes[self._claim_start(hits) : hits]]
            computed = hits * bs
            table_len = hits
        if computed + num_new > len(seq.token_ids):
            raise InvalidArgumentError(
                f"sequence {sid}: computed ({computed}) + num_new_tokens ({num_new}) exceeds its "
                f"{len(seq.token_ids)} known tokens; use num_lookahead_tokens for drafts"
            )
        total = computed + num_new + lookahead
        append = max(0, -(-total // bs) - table_len)
        write_index = computed // bs
        cow = (
            num_new + lookahead > 0
            and write_index < len(seq.block_table)
            and self._refcount[seq.block_table[write_index]] > 1
        )
        from_pool = sum(1 for b in claim if self._refcount[b] == 0) + int(cow) + append
        return claim, computed, append, cow, from_pool

    def _apply_allocation(
        self,
        sid: int,
        seq: _Sequence,
        num_new: int,
        lookahead: int,
        plan: tuple[list[int], int, int, bool, int],
    ) -> list[int]:
        claim, computed, append, cow, _ = plan
        bs = self._block_size
        if not seq.allocated:
            # Blocks before the window of the next query are not claimed.
            seq.num_released = computed // bs - len(claim)
            seq.block_table = [_NULL_BLOCK] * seq.num_released
            for block in claim:
                if self._refcount[block] == 0:
                    self._free.remove(block)
                self._refcount[block] += 1
                seq.block_table.append(block)
            seq.allocated = True
            seq.num_computed = computed
            seq.num_cached_tokens = computed
            seq.num_committed_blocks = computed // bs
            if self._caching:
                self._prefix_queries += seq.prompt_len
                self._prefix_hits += computed
        taken: list[int] = []
        if cow:
            index = computed // bs
            src = seq.block_table[index]
            dst = self._pop_free()
            self._refcount[dst] = 1
            self._refcount[src] -= 1
            seq.block_table[index] = dst
            self._ops.append(("copy", src, dst))
            self._cow_copies += 1
            taken.append(dst)
        for _ in range(append):
            block = self._pop_free()
            self._refcount[block] = 1
            seq.block_table.append(block)
            taken.append(block)
        seq.reserved = computed + num_new + lookahead
        seq.reserved_known = computed + num_new
        return taken

    def allocate_slots(
        self, seq_id: int, num_new_tokens: int, *, num_lookahead_tokens: int = 0
    ) -> npt.NDArray[np.int32] | None:
        """Reserve slots for ``computed + num_new_tokens + num_lookahead_tokens`` tokens."""
        num_new = _check_int(num_new_tokens, "num_new_tokens", 0, _MAX_COUNT)
        lookahead = _check_int(num_lookahead_tokens, "num_lookahead_tokens", 0, _MAX_COUNT)
        sid, seq = self._get_running(seq_id, "allocate slots for")
        plan = self._plan_allocation(sid, seq, num_new, lookahead)
        if plan[4] > len(self._free):
            return None
        taken = self._apply_allocation(sid, seq, num_new, lookahead, plan)
        return np.array(taken, dtype=np.int32)

    def allocate_slots_batch(
        self, seq_ids: object, num_new_tokens: object, *, num_lookahead_tokens: int = 0
    ) -> RefBatchAllocation:
        """``allocate_slots`` for many sequences; reports what the served prefix got."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        news = _per_seq(num_new_tokens, len(ids), "num_new_tokens", 0, _MAX_COUNT)
        lookahead = _check_int(num_lookahead_tokens, "num_lookahead_tokens", 0, _MAX_COUNT)
        seqs = self._batch_seqs(ids)
        for sid, seq, new in zip(ids, seqs, news, strict=True):
            self._require_resident(seq, "allocate slots for")
            self._plan_allocation(sid, seq, new, lookahead)
        cached: list[int] = []
        blocks: list[int] = []
        indptr = [0]
        for sid, seq, new in zip(ids, seqs, news, strict=True):
            plan = self._plan_allocation(sid, seq, new, lookahead)
            if plan[4] > len(self._free):
                break
            first = not seq.allocated
            blocks += self._apply_allocation(sid, seq, new, lookahead, plan)
            cached.append(seq.num_cached_tokens if first else 0)
            indptr.append(len(blocks))
        return RefBatchAllocation(
            num_served=len(cached),
            num_cached_tokens=np.array(cached, dtype=np.int64),
            block_ids=np.array(blocks, dtype=np.int32),
            block_indptr=np.array(indptr, dtype=np.int64),
        )

    def _check_commit(self, sid: int, seq: _Sequence, num_new: int) -> None:
        reserved = seq.num_computed if seq.reserved is None else seq.reserved
        if seq.num_computed + num_new > min(reserved, len(seq.token_ids)):
            raise InvalidArgumentError(
                f"sequence {sid}: computed ({seq.num_computed}) + {num_new} new computed tokens "
                f"exceeds min(reserved slots ({reserved}), known tokens ({len(seq.token_ids)}))"
            )

    def _apply_commit(self, seq: _Sequence, num_new: int, new_tokens: list[int]) -> None:
        bs = self._block_size
        seq.token_ids.extend(new_tokens)
        seq.num_computed += num_new
        seq.reserved = None
        full = seq.num_computed // bs
        if self._caching and full > seq.num_committed_blocks:
            self._cache_full_blocks(seq, seq.num_committed_blocks, full)
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)
        if self._sliding_window is not None:
            self._release_window(seq)

    def _cache_full_blocks(self, seq: _Sequence, start: int, end: int) -> None:
        """Offer the sequence's blocks ``[start, end)`` to the prefix cache, with events."""
        bs = self._block_size
        run: list[int] = []  # indices of the current run of newly stored blocks

        def flush() -> None:
            if run and self._record_events:
                first = run[0]
                self._events.append(
                    RefBlockStored(
                        block_hashes=[seq.hashes[i] for i in run],
                        parent_block_hash=seq.hashes[first - 1] if first else None,
                        token_ids=seq.token_ids[first * bs : (run[-1] + 1) * bs],
                        block_size=bs,
                        lora_id=seq.lora_id,
                    )
                )
            run.clear()

        for i in range(start, end):
            h = self._seq_hash(seq, i)
            block = seq.block_table[i]
            if block == _NULL_BLOCK or self._block_hash[block] is not None:
                flush()
                continue
            self._block_hash[block] = h
            copies = self._cache.setdefault(h, [])
            copies.insert(1, block)
            run.append(i)
        flush()

    def _release_window(self, seq: _Sequence) -> None:
        # Block i is outside every future query's window once
        # (i + 1) * block_size <= computed - window + 1; release them last first.
        assert self._sliding_window is not None
        outside = max(seq.num_computed + 1 - self._sliding_window, 0) // self._block_size
        outside = min(outside, len(seq.block_table))
        for i in reversed(range(seq.num_released, outside)):
            block = seq.block_table[i]
            seq.block_table[i] = _NULL_BLOCK
            if block != _NULL_BLOCK:
                self._release(block)
        seq.num_released = max(seq.num_released, outside)

    def commit(self, seq_id: int, num_new_computed_tokens: int, new_token_ids: object = ()) -> None:
        """The model wrote KV for ``num_new_computed_tokens`` more tokens; append sampled tokens."""
        num_new = _check_int(num_new_computed_tokens, "num_new_computed_tokens", 0, _MAX_COUNT)
        tokens = _int_list(new_token_ids, "new_token_ids", 0, _MAX_TOKEN_ID)
        sid, seq = self._get_running(seq_id, "commit")
        self._check_commit(sid, seq, num_new)
        self._apply_commit(seq, num_new, tokens)

    def commit_batch(
        self, seq_ids: object, num_new_computed_tokens: object, new_token_ids: object = None
    ) -> None:
        """``commit`` for many sequences, at most one new token each (``< 0`` means none)."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        news = _per_seq(num_new_computed_tokens, len(ids), "num_new_computed_tokens", 0, _MAX_COUNT)
        if new_token_ids is None:
            toks = [-1] * len(ids)
        else:
            toks = _per_seq(new_token_ids, len(ids), "new_token_ids", -(2**63), _MAX_TOKEN_ID)
        seqs = self._batch_seqs(ids)
        for sid, seq, new in zip(ids, seqs, news, strict=True):
            self._require_resident(seq, "commit")
            self._check_commit(sid, seq, new)
        for seq, new, tok in zip(seqs, news, toks, strict=True):
            self._apply_commit(seq, new, [tok] if tok >= 0 else [])

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share the tokens and computed blocks of ``parent_id``."""
        cid = _check_int(child_id, "child_id", 0, _MAX_SEQ_ID)
        pid, parent = self._get(parent_id)
        if cid in self._seqs:
            raise DuplicateSequenceError(f"cannot fork into sequence id {cid}: already held")
        if parent.swapped:
            raise SequenceStateError(f"cannot fork sequence {pid}: it is swapped out")
        if parent.reserved is not None:
            raise SequenceStateError(
                f"cannot fork sequence {pid}: it has allocated but uncommitted slots "
                "(commit its KV first)"
            )
        # Spare blocks past the computed tokens stay the parent's (else both would write them).
        shared = parent.block_table[: -(-parent.num_computed // self._block_size)]
        for block in shared:
            if block != _NULL_BLOCK:
                self._refcount[block] += 1
        self._seqs[cid] = _Sequence(
            seq_id=cid,
            token_ids=list(parent.token_ids),
            prompt_len=parent.prompt_len,
            salt=parent.salt,
            lora_id=parent.lora_id,
            hashes=list(parent.hashes),
            probe_cap=parent.probe_cap,
            block_table=list(shared),
            num_computed=parent.num_computed,
            reserved=None,
            allocated=parent.allocated,
            swapped=False,
            num_cached_tokens=parent.num_cached_tokens,
            num_committed_blocks=parent.num_committed_blocks,
            num_released=parent.num_released,
        )

    def take_copy_on_writes(self) -> npt.NDArray[np.int64]:
        """Drain the journal as copy-on-write ``(src, dst)`` pairs, shape ``[n, 2]`` (swap
        rows dropped: ``swap_out``/``swap_in`` returned them)."""
        out = np.array([(s, d) for k, s, d in self._ops if k == "copy"], dtype=np.int64)
        self._ops.clear()
        return out.reshape(-1, 2)

    def take_memory_ops(self) -> list[tuple[str, npt.NDArray[np.int64]]]:
        """Drain every queued block move in issue order, as runs of one kind."""
        runs: list[tuple[str, list[tuple[int, int]]]] = []
        for kind, src, dst in self._ops:
            if not runs or runs[-1][0] != kind:
                runs.append((kind, []))
            runs[-1][1].append((src, dst))
        self._ops.clear()
        return [(kind, np.array(pairs, dtype=np.int64).reshape(-1, 2)) for kind, pairs in runs]

    def confirm_memory_ops(self) -> None:
        """No host tier: nothing to confirm."""

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (last block first) and forget it."""
        sid, seq = self._get(seq_id)
        # Released window entries are a leading run; CPU id 0 is a real block, so they
        # are skipped by position rather than by value.
        live = seq.block_table[seq.num_released :]
        if seq.swapped:
            for block in reversed(live):
                self._release_cpu(block)
        else:
            self._release_table(live)
        del self._seqs[sid]

    # -- swap ------------------------------------------------------------------------
    def _swap_group(self, seq_ids: object, want_swapped: bool) -> list[_Sequence]:
        group = self._batch_seqs(_int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID))
        for seq in group:
            if want_swapped and not seq.swapped:
                raise SequenceStateError(f"swap_in: sequence {seq.seq_id} is not swapped out")
            if not want_swapped:
                if seq.swapped:
                    raise SequenceStateError(
                        f"swap_out: sequence {seq.seq_id} is already swapped out"
                    )
                if seq.reserved is not None:
                    raise SequenceStateError(
                        f"swap_out: sequence {seq.seq_id} has allocated but uncommitted slots"
                    )
        return group

    @staticmethod
    def _distinct_blocks(group: list[_Sequence]) -> list[int]:
        """Live blocks of the group in order of first appearance (released entries skipped)."""
        seen: dict[int, None] = {}
        for seq in group:
            for block in seq.block_table[seq.num_released :]:
                seen.setdefault(block)
        return list(seen)

    def can_swap_out(self, seq_ids: object) -> bool:
        """Enough free CPU blocks for the sequences' distinct blocks."""
        group = self._swap_group(seq_ids, want_swapped=False)
        return len(self._distinct_blocks(group)) <= len(self._cpu_free)

    def can_swap_in(self, seq_ids: object) -> bool:
        """Enough free GPU blocks for the sequences' distinct blocks, keeping the watermark."""
        group = self._swap_group(seq_ids, want_swapped=True)
        needed = len(self._distinct_blocks(group))
        return len(self._free) - needed >= self._watermark_blocks

    def swap_out(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """Move the sequences' blocks to the CPU pool; return ``(gpu, cpu)`` rows."""
        group = self._swap_group(seq_ids, want_swapped=False)
        blocks = self._distinct_blocks(group)
        if len(blocks) > len(self._cpu_free):
            raise OutOfBlocksError(
                f"swap_out needs {len(blocks)} CPU blocks, only {len(self._cpu_free)} are free"
            )
        mapping = {gpu: self._cpu_free.pop_front() for gpu in blocks}
        for seq in group:
            live = seq.block_table[seq.num_released :]
            for gpu in live:
                self._cpu_refcount[mapping[gpu]] += 1
            self._release_table(live)
            seq.block_table[seq.num_released :] = [mapping[gpu] for gpu in live]
            seq.swapped = True
        self._swapped_out += len(blocks)
        self._ops.extend(("swap_out", gpu, cpu) for gpu, cpu in mapping.items())
        return np.array(list(mapping.items()), dtype=np.int64).reshape(-1, 2)

    def swap_in(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """Move swapped sequences back; return ``(cpu, gpu)`` rows, sharing kept."""
        group = self._swap_group(seq_ids, want_swapped=True)
        blocks = self._distinct_blocks(group)
        if len(blocks) > len(self._free):
            raise OutOfBlocksError(
                f"swap_in needs {len(blocks)} GPU blocks, only {len(self._free)} are free"
            )
        mapping = {cpu: self._pop_free() for cpu in blocks}
        for seq in group:
            live = seq.block_table[seq.num_released :]
            for cpu in live:
                self._refcount[mapping[cpu]] += 1
            for cpu in reversed(live):
                self._release_cpu(cpu)
            seq.block_table[seq.num_released :] = [mapping[cpu] for cpu in live]
            seq.swapped = False
        self._swapped_in += len(blocks)
        self._ops.extend(("swap_in", cpu, gpu) for cpu, gpu in mapping.items())
        return np.array(list(mapping.items()), dtype=np.int64).reshape(-1, 2)

    # -- step inputs -------------------------------------------------------------------
    def block_table(self, seq_id: int) -> npt.NDArray[np.int32]:
        """The sequence's block table."""
        return np.array(
            self._get_running(seq_id, "read the block table of")[1].block_table, dtype=np.int32
        )

    def block_tables(
        self, seq_ids: object, *, max_blocks: int | None = None
    ) -> npt.NDArray[np.int32]:
        """2-D block tables, padded with the null block."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        tables = [self._get_running(s, "read the block table of")[1].block_table for s in ids]
        width = max((len(t) for t in tables), default=0)
        if max_blocks is not None:
            max_blocks = _check_int(max_blocks, "max_blocks", 0, _MAX_COUNT)
            if max_blocks < width:
                raise InvalidArgumentError(
                    f"max_blocks ({max_blocks}) is smaller than the longest block table ({width})"
                )
            if max_blocks > max(width, self._num_blocks):
                raise InvalidArgumentError(
                    f"max_blocks ({max_blocks}) exceeds num_blocks and the longest table"
                )
            width = max_blocks
        out = np.zeros((len(ids), width), dtype=np.int32)
        for row, table in enumerate(tables):
            out[row, : len(table)] = table
        return out

    def slot_mapping(self, seq_ids: object, num_tokens: object = None) -> npt.NDArray[np.int64]:
        """Cache slots of the tokens computed this step, concatenated over the sequences."""
        ids = _int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID)
        given = None
        if num_tokens is not None:
            given = _per_seq(num_tokens, len(ids), "num_tokens", 0, _MAX_COUNT)
        bs = self._block_size
        seqs = [self._get_running(sid, "map slots of")[1] for sid in ids]
        spans = []
        for i, (sid, seq) in enumerate(zip(ids, seqs, strict=True)):
            n = len(seq.token_ids) - seq.num_computed if given is None else given[i]
            end = seq.num_computed + n
            reserved = seq.num_computed if seq.reserved is None else seq.reserved
            if end > reserved:
                raise SequenceStateError(
                    f"sequence {sid}: slots up to token {end} requested but only "
                    f"{reserved} are reserved"
                )
            spans.append((seq, end))
        out: list[int] = []
        for seq, end in spans:
            for pos in range(seq.num_computed, end):
                out.append(seq.block_table[pos // bs] * bs + pos % bs)
        return np.array(out, dtype=np.int64)

    # -- prefix cache, events, stats -------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use."""
        if len(self._free) != self._num_blocks - 1:
            return False
        if self._caching:
            for copies in self._cache.values():
                for block in copies:
                    self._block_hash[block] = None
            self._cache.clear()
            if self._record_events:
                self._events.append(RefAllBlocksCleared())
        return True

    def take_events(self) -> list[RefEvent]:
        """Drain the recorded KV cache events."""
        out, self._events = self._events, []
        return out

    def stats(self) -> dict[str, int | float]:
        """Counters of the pools, the prefix cache and the sequences."""
        free = len(self._free)
        queries = self._prefix_queries
        return {
            "num_blocks": self._num_blocks,
            "num_free_blocks": free,
            "num_used_blocks": self._num_blocks - 1 - free,
            "usage": self.usage(),
            "num_cpu_blocks": self._num_cpu_blocks,
            "num_free_cpu_blocks": len(self._cpu_free),
            "num_sequences": len(self._seqs),
            "num_swapped_sequences": sum(1 for s in self._seqs.values() if s.swapped),
            "num_cached_blocks": sum(len(c) for c in self._cache.values()),
            "prefix_cache_queries": queries,
            "prefix_cache_hits": self._prefix_hits,
            "prefix_cache_hit_rate": self._prefix_hits / queries if queries else 0.0,
            "evictions": self._evictions,
            "cow_copies": self._cow_copies,
            "blocks_swapped_out": self._swapped_out,
            "blocks_swapped_in": self._swapped_in,
        }

    def _debug_free_queues(self) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
        """Free-queue order of the GPU and CPU pools, front (reused first) to back."""
        return (
            np.array(list(self._free), dtype=np.uint32),
            np.array(list(self._cpu_free), dtype=np.uint32),
        )

    def check_invariants(self) -> None:
        """Verify refcounts, the free queues and the prefix cache."""
        refs = [0] * self._num_blocks
        cpu_refs = [0] * self._num_cpu_blocks
        for seq in self._seqs.values():
            if any(b != _NULL_BLOCK for b in seq.block_table[: seq.num_released]):
                raise InvariantViolationError("a released window entry is not the null block")
            for block in seq.block_table[seq.num_released :]:
                if seq.swapped:
                    cpu_refs[block] += 1
                else:
                    refs[block] += 1
        if refs[1:] != self._refcount[1:] or self._refcount[_NULL_BLOCK] != 0:
            raise InvariantViolationError("GPU refcounts differ from block-table references")
        if cpu_refs != self._cpu_refcount:
            raise InvariantViolationError("CPU refcounts differ from block-table references")
        if _NULL_BLOCK in self._free:
            raise InvariantViolationError("the null block is in the free queue")
        for block in range(1, self._num_blocks):
            if (block in self._free) != (self._refcount[block] == 0):
                raise InvariantViolationError(f"block {block}: free iff refcount 0 is broken")
        for block in range(self._num_cpu_blocks):
            if (block in self._cpu_free) != (self._cpu_refcount[block] == 0):
                raise InvariantViolationError(f"CPU block {block}: free iff refcount 0 is broken")
        cached = [b for copies in self._cache.values() for b in copies]
        if sorted(cached) != [b for b, h in enumerate(self._block_hash) if h is not None]:
            raise InvariantViolationError("the cached blocks are not the blocks with a hash")
        for h, block in ((h, b) for h, copies in self._cache.items() for b in copies):
            if self._block_hash[block] != h:
                raise InvariantViolationError(f"cache entry of block {block} has a stale hash")
