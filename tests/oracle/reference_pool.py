"""The pools and the prefix probes of the reference block manager
(:mod:`oracle.reference_manager`): sequence lookup, the free queues and refcounts (taking,
evicting and releasing blocks), the hashes of a sequence's full blocks, and how much of a
waiting sequence's prompt the cache (or a pending reservation) serves."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError, SequenceStateError, UnknownSequenceError
from oracle.reference_args import _MAX_SEQ_ID, _check_int, _int_list
from oracle.reference_records import (
    _NULL_BLOCK,
    RefBlockRemoved,
    RefEvent,
    _block_hash,
    _FreeQueue,
    _Sequence,
)


class ReferencePool:
    """The state of a reference manager (set by
    :class:`oracle.reference_manager.ReferenceKVCacheManager`) and the helpers every
    operation uses; the base of the operation mixins."""

    _num_blocks: int
    _block_size: int
    _num_cpu_blocks: int
    _caching: bool
    _record_events: bool
    _watermark_blocks: int
    _sliding_window: int | None
    _refcount: list[int]
    _block_hash: list[bytes | None]
    _free: _FreeQueue
    _cache: dict[bytes, list[int]]
    _cpu_refcount: list[int]
    _cpu_free: _FreeQueue
    _seqs: dict[int, _Sequence]
    _ops: list[tuple[str, int, int]]
    _events: list[RefEvent]
    _prefix_queries: int
    _prefix_hits: int
    _evictions: int
    _cow_copies: int
    _swapped_out: int
    _swapped_in: int

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

    # -- prefix probes ---------------------------------------------------------------
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
