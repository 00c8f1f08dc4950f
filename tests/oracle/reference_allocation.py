"""Allocation and commit in the reference block manager (:mod:`oracle.reference_manager`):
admission checks, claiming the cached prefix, copy-on-write of a shared write block,
appending blocks, and on commit caching the full blocks (with events) and releasing what
a sliding window no longer sees."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvblocks._core import AllocStatus
from kvblocks.errors import InvalidArgumentError, SequenceStateError
from oracle.reference_args import (
    _MAX_COUNT,
    _MAX_SEQ_ID,
    _MAX_TOKEN_ID,
    _check_int,
    _int_list,
    _per_seq,
)
from oracle.reference_pool import ReferencePool
from oracle.reference_records import (
    _NULL_BLOCK,
    RefBatchAllocation,
    RefBlockStored,
    _Sequence,
)


class ReferenceAllocation(ReferencePool):
    """``can_allocate``, ``allocate_slots[_batch]`` and ``commit[_batch]`` of
    :class:`oracle.reference_manager.ReferenceKVCacheManager`."""

    def can_allocate(
        self, seq_id: int, *, num_lookahead_tokens: int = 0, num_new_tokens: int | None = None
    ) -> AllocStatus:
        """Can the whole known sequence get blocks, keeping the watermark free? With
        ``num_new_tokens``: can that step (past the cached prefix) get them, and can the
        known tokens after it ever be computed (one a step: the window's worst count)?"""
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
            for p in range(computed + new, len(seq.token_ids)):
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
