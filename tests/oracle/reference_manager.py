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

Where the parts live: the records (events, a sequence's state, the free queue, the block
hash) in :mod:`oracle.reference_records`, the argument checks in
:mod:`oracle.reference_args`, the pools and prefix probes in :mod:`oracle.reference_pool`,
allocation and commit in :mod:`oracle.reference_allocation`, the journal and swapping in
:mod:`oracle.reference_swap`; this module holds the class and the rest of the API.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from kvblocks.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvariantViolationError,
    SequenceStateError,
)
from oracle.reference_allocation import ReferenceAllocation
from oracle.reference_args import (
    _MAX_BLOCKS,
    _MAX_COUNT,
    _MAX_LORA_ID,
    _MAX_SEQ_ID,
    _MAX_TOKEN_ID,
    _check_int,
    _int_list,
    _per_seq,
)
from oracle.reference_records import (
    _HASH_ALGOS,
    _NULL_BLOCK,
    RefAllBlocksCleared,
    RefBlockRemoved,
    RefBlockStored,
    RefEvent,
    _FreeQueue,
    _Sequence,
)
from oracle.reference_swap import ReferenceSwap

__all__ = [
    "RefAllBlocksCleared",
    "RefBlockRemoved",
    "RefBlockStored",
    "ReferenceKVCacheManager",
]


class ReferenceKVCacheManager(ReferenceAllocation, ReferenceSwap):
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
