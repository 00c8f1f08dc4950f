"""The two records exchanged every step between the scheduler and the engine.

:class:`SchedulerOutput` is what ``Scheduler.schedule()`` returns: flat NumPy arrays
describing one forward pass over a mixed batch (decodes first, then prefill chunks).
:class:`ModelStepResult` is what the engine hands back to ``Scheduler.update()``.

Shapes use ``S`` = sequences computed this step, ``T`` = tokens computed this step,
``B`` = block-table width, ``R`` = sampling rows (sequences whose last computed token
produces logits this step).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError
from kvblocks.page_tables import (
    FlashAttentionPageTable,
    FlashInferPageTable,
    flash_attention_page_table,
    flashinfer_page_table,
)
from kvblocks.scheduler.memory_ops import MemoryOps, pairs_of
from kvblocks.validation import check_int, check_shape

if TYPE_CHECKING:
    from kvblocks.scheduler.block_table import TableDelta

__all__ = ["ModelStepResult", "SchedulerOutput"]


class _GatheredBlockTables:
    """``SchedulerOutput.block_tables``: the value given, or (given ``None``) the rows
    ``block_table[block_table_rows]`` gathered on first read and trimmed to the longest
    table, so engines that read ``[S, B]`` tables keep working while the scheduler's hot
    path never builds them."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> npt.NDArray[np.int32]:
        if obj is None:
            # No class-level default: the dataclass field stays required.
            raise AttributeError(self._attr)
        value = obj.__dict__.get(self._attr)
        if value is None:
            value = _gather(obj.block_table, obj.block_table_rows)
            obj.__dict__[self._attr] = value
        return value  # type: ignore[no-any-return]

    def __set__(self, obj: Any, value: npt.NDArray[np.int32] | None) -> None:
        obj.__dict__[self._attr] = value


def _gather(
    table: npt.NDArray[np.int32] | None, rows: npt.NDArray[np.int32] | None
) -> npt.NDArray[np.int32]:
    if table is None or rows is None:
        raise InvalidArgumentError(
            "block_tables is None and there is no block_table to gather from"
        )
    if len(rows) == 0:
        return np.zeros((0, 1), dtype=np.int32)
    gathered = table[rows]
    used = np.flatnonzero(gathered.any(axis=0))
    # C-contiguous, as the hand-built tables it stands for (kernels and page-table
    # exports take it without another copy).
    return np.ascontiguousarray(gathered[:, : int(used[-1]) + 1 if len(used) else 0])


@dataclass
class SchedulerOutput:
    """One step's batch.

    The engine applies the block moves of ``memory_ops`` in the order given, then runs
    the forward pass over the batch, then computes logits only at ``logits_indices`` and
    samples/ranks them row by row.

    Attributes:
        seq_ids: int64 [S] sequence ids, batch order: decodes first, then prefill chunks.
        num_scheduled_tokens: int32 [S] tokens computed for each sequence this step.
        input_token_ids: int64 [T] the tokens fed to the model, sequence after sequence.
        positions: int64 [T] absolute position of each token in its sequence.
        slot_mapping: int64 [T] cache slot (``block * block_size + offset``) where each
            token's K/V is written.
        query_start_loc: int32 [S+1] prefix sums of ``num_scheduled_tokens``; sequence
            ``i``'s tokens are ``[query_start_loc[i], query_start_loc[i+1])``.
        seq_lens: int32 [S] context length of each sequence after this step (cached +
            previously computed + scheduled).
        block_tables: int32 [S, B] block tables, padded with the null block (0). The
            scheduler passes ``None`` and the array is gathered from ``block_table`` on
            first read (``block_table[block_table_rows]``, trimmed to the longest table):
            read it before the next ``schedule()``, which updates ``block_table``. Engines
            should use ``block_table`` + ``block_table_rows`` instead.
        logits_indices: int64 [R] index into the ``T`` tokens of the last token of each
            sequence that samples this step (a prefill chunk that does not finish its
            prompt does not sample). Rows are in batch order.
        sample_seq_ids: int64 [R] the sequence id of each row.
        sample_request_ids: list[str] [R] the request id of each row (for per-request
            generator state such as seeded sampling). Read-only: steps over the same
            running requests may share one list.
        sample_counts: int32 [R] tokens to draw from each row: ``n`` for the prompt row of
            an ``n > 1`` sampling request, ``0`` for beam-search rows (they are ranked
            through ``topk_*`` instead), else ``1``.
        temperature: float32 [R] (0 = greedy).
        top_p: float32 [R].
        top_k: int32 [R] (0 = off).
        seeds: int64 [R] the request's seed, ``-1`` for none. Seeded rows should draw
            from a generator owned by the request (keyed by ``sample_request_ids``),
            created from the seed the first time the request is seen, and dropped when
            it appears in ``finished_request_ids``.
        beam_topk: 0, or ``K`` = 2 * the largest beam width among the rows: the engine
            then also returns the top-``K`` log-probs (log-softmax of the raw logits,
            temperature ignored) of every row.
        num_prefill_tokens: tokens of prefill chunks in this step.
        num_decode_tokens: tokens of decode sequences in this step.
        num_decode_seqs: the first ``num_decode_seqs`` entries of ``seq_ids`` are decodes
            (one token each, past the prompt); the rest are prefill chunks.
        finished_request_ids: requests finished or aborted since the previous step; the
            engine may drop any per-request state it keeps for them.
        sample_seq_index: int32 [R] completion index (``CompletionOutput.index``) of each
            row's sequence; the ``n`` draws of an ``n > 1`` prompt row go to indices
            ``0..n-1``. With it, seeded sampling can key its noise by (seed, index,
            position) and so not depend on batching or preemption. The scheduler always
            sets it; ``None`` only in hand-built records (added after the first version).
        memory_ops: every block move of the step, as ``(kind, pairs int64 [n, 2])`` runs
            in the order the block manager issued them (the manager's journal, see
            :mod:`kvblocks.scheduler.memory_ops`): ``"swap_out"`` ``(gpu, cpu)``,
            ``"swap_in"`` ``(cpu, gpu)``, ``"copy"`` ``(src, dst)`` GPU blocks (the pairs
            of a run also mean "in this order"), and with a host tier ``"offload"``
            ``(gpu block, tier slot)`` and ``"load"`` ``(tier slot, gpu block)``. A step
            that preempts can free blocks, reuse them as copy-on-write destinations and
            swap those out again, so only this order is always correct. Tier-side copies
            must be complete when the step's ``update()`` is called (it confirms them to
            the manager). ``blocks_to_swap_out``, ``blocks_to_swap_in`` and
            ``blocks_to_copy`` are views of it.
        block_table: int32 [max_rows, max_blocks] the scheduler's persistent block table
            (the same array every step until it grows): row ``block_table_rows[i]`` holds
            the table of ``seq_ids[i]``, padded with the null block. Rows of sequences not
            in this step hold stale data. Updated in place by the next ``schedule()``.
            ``None`` in hand-built records.
        block_table_rows: int32 [S] the row of each sequence in ``block_table``.
        block_table_delta: the entries this step wrote into ``block_table``
            (``kvblocks._core.BlockTableDelta``: ``rows``, ``start_cols``, ``indptr``,
            ``block_ids``, ``reset``); an engine keeping a device copy applies only these
            (``kvblocks.scheduler.block_table.delta_indices`` gives the scatter indices).
        block_table_reallocated: ``block_table`` is a new array this step (first step,
            or it grew): a device copy must be rebuilt from it whole.
        suppressed_token_ids: int64 tokens sampling rows must not draw, row after row
            (``SamplingParams.min_tokens``: a sequence that has generated fewer than
            ``min_tokens`` tokens may not draw its EOS or stop tokens, as in vLLM); row
            ``r`` bans ``suppressed_token_ids[suppressed_indptr[r]:suppressed_indptr[r+1]]``.
            ``None`` (both) when no row bans anything, the usual case.
        suppressed_indptr: int64 [R+1] offsets into ``suppressed_token_ids``, or ``None``.
        state_mappings: with a manager that has recurrent-state groups, one
            ``kvblocks.StateMapping`` per such group in group order: where each sequence's
            state is read and where the states of this step (each checkpoint it crosses,
            then its end) are saved (``KVCacheManager.state_mapping``); empty otherwise.
        group_slot_mappings: int64 [G, T] per KV cache group ``g`` (``G =
            manager.num_groups``, 1 without groups), the cache slot where each token's K/V
            is written by the layers of group ``g``: each group has its own blocks. Row 0
            is ``slot_mapping``. One manager call per step. ``None`` in hand-built
            records.
        group_block_table: int32 [G, max_rows, max_blocks] the persistent block table of
            every group (each sequence in the same row ``block_table_rows[i]`` of every
            group; a window or chunked group's entries for blocks no future query sees
            are the null block). Group 0 is ``block_table`` (the same memory). Updated in
            place by the next ``schedule()``, reallocated with ``block_table``.
        group_block_table_deltas: one delta per group (as ``block_table_delta``; entry 0
            is ``block_table_delta``): the entries this step wrote into each group's
            table.
    """

    seq_ids: npt.NDArray[np.int64]
    num_scheduled_tokens: npt.NDArray[np.int32]
    input_token_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    if TYPE_CHECKING:
        # What readers get; the scheduler passes None (see _GatheredBlockTables).
        block_tables: npt.NDArray[np.int32]
    else:
        block_tables: _GatheredBlockTables = _GatheredBlockTables()
    logits_indices: npt.NDArray[np.int64]
    sample_seq_ids: npt.NDArray[np.int64]
    sample_request_ids: list[str]
    sample_counts: npt.NDArray[np.int32]
    temperature: npt.NDArray[np.float32]
    top_p: npt.NDArray[np.float32]
    top_k: npt.NDArray[np.int32]
    seeds: npt.NDArray[np.int64]
    beam_topk: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_decode_seqs: int = 0
    finished_request_ids: list[str] = field(default_factory=list)
    sample_seq_index: npt.NDArray[np.int32] | None = None
    memory_ops: MemoryOps = field(default_factory=list)
    block_table: npt.NDArray[np.int32] | None = None
    block_table_rows: npt.NDArray[np.int32] | None = None
    block_table_delta: TableDelta | None = None
    block_table_reallocated: bool = False
    suppressed_token_ids: npt.NDArray[np.int64] | None = None
    suppressed_indptr: npt.NDArray[np.int64] | None = None
    state_mappings: list[Any] = field(default_factory=list)
    group_slot_mappings: npt.NDArray[np.int64] | None = None
    group_block_table: npt.NDArray[np.int32] | None = None
    group_block_table_deltas: list[TableDelta] | None = None

    @property
    def num_groups(self) -> int:
        """``G``: the KV cache groups the step's per-group arrays cover (1 without
        groups).

        Raises:
            InvalidArgumentError: a hand-built record whose per-group arrays disagree:
                ``group_slot_mappings`` not ``[G, T]`` for the ``G`` groups of its tables
                (``group_block_table``'s, or one), or ``group_block_table`` not 3-D.
        """
        groups = 1
        if self.group_block_table is not None:
            check_shape(
                self.group_block_table,
                "group_block_table",
                (None, None, None),
                "one table per KV cache group",
            )
            groups = int(self.group_block_table.shape[0])
        if self.group_slot_mappings is not None:
            check_shape(
                self.group_slot_mappings,
                "group_slot_mappings",
                (groups, self.num_tokens),
                f"one row per KV cache group of the record's block tables ({groups}), one "
                "column per token",
            )
        return groups

    @functools.cached_property
    def group_block_tables(self) -> npt.NDArray[np.int32]:
        """int32 [G, S, B]: every group's block table of each scheduled sequence, padded
        with the null block and trimmed to the longest (``block_tables`` is group 0).

        Gathered from ``group_block_table`` on first read: read it before the next
        ``schedule()``, which updates that table in place.
        """
        if self.group_block_table is None:
            return np.ascontiguousarray(self.block_tables[None])
        rows = self.block_table_rows
        if rows is None:
            raise InvalidArgumentError("group_block_table has no block_table_rows to gather with")
        width = int(self.block_tables.shape[1])
        gathered = self.group_block_table[:, rows]
        # The full-attention group (or the longest table) sets the width: a window group's
        # table has the same length, its leading entries null.
        used = np.flatnonzero(gathered.any(axis=(0, 1)))
        width = max(width, int(used[-1]) + 1 if len(used) else 0)
        return np.ascontiguousarray(gathered[:, :, :width])

    @property
    def blocks_to_swap_out(self) -> npt.NDArray[np.int64]:
        """int64 [n, 2] ``(gpu_block, cpu_block)``: the ``"swap_out"`` pairs of
        ``memory_ops`` (a view for statistics; apply ``memory_ops``)."""
        return pairs_of(self.memory_ops, "swap_out")

    @property
    def blocks_to_swap_in(self) -> npt.NDArray[np.int64]:
        """int64 [n, 2] ``(cpu_block, gpu_block)``: the ``"swap_in"`` pairs of
        ``memory_ops``."""
        return pairs_of(self.memory_ops, "swap_in")

    @property
    def blocks_to_copy(self) -> npt.NDArray[np.int64]:
        """int64 [n, 2] ``(src_gpu_block, dst_gpu_block)``: the ``"copy"`` pairs of
        ``memory_ops``."""
        return pairs_of(self.memory_ops, "copy")

    @property
    def num_seqs(self) -> int:
        """``S``: sequences computed this step."""
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """``T``: tokens computed this step."""
        return int(self.input_token_ids.shape[0])

    @property
    def num_sample_rows(self) -> int:
        """``R``: rows that produce logits this step."""
        return int(self.logits_indices.shape[0])

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be swap/copy work)."""
        return self.num_seqs == 0

    def flashinfer_page_table(
        self, block_size: int, group: int = 0, *, skip_released: bool = False
    ) -> FlashInferPageTable:
        """Group ``group``'s page table for this step in FlashInfer's CSR form
        (``qo_indptr`` included), for the layers of that KV cache group.

        See :func:`kvblocks.page_tables.flashinfer_page_table`; ``block_size`` is the
        manager's. A window or chunked group's released entries are exported as the null
        block in place (run the kernel with the group's window), or, with
        ``skip_released=True``, left out, the pages starting at ``kv_start``.

        Raises:
            InvalidArgumentError: ``group`` is not in ``[0, num_groups)``, or a bad
                ``block_size``.
        """
        g = self._group(group)
        table, rows = self._table_of(g)
        return flashinfer_page_table(
            table,
            self.seq_lens,
            block_size,
            self.query_start_loc,
            rows=rows,
            skip_released=skip_released,
        )

    def group_flashinfer_page_tables(
        self, block_size: int, *, skip_released: bool = False
    ) -> list[FlashInferPageTable]:
        """Every group's :meth:`flashinfer_page_table`, entry ``g`` for group ``g``.

        Without ``skip_released`` the groups' pages come from one gather over the stacked
        tables: the entries share ``kv_indptr``, ``kv_last_page_len`` and ``qo_indptr``
        (the same arrays), and ``kv_indices`` are the rows of one ``[G, nnz]`` array.
        With it each group has its own page counts (one export per group).
        """
        if skip_released or self.num_groups == 1:
            return [
                self.flashinfer_page_table(block_size, g, skip_released=skip_released)
                for g in range(self.num_groups)
            ]
        table, rows = self._stacked_tables()
        stacked = flashinfer_page_table(
            table, self.seq_lens, block_size, self.query_start_loc, rows=rows
        )
        return [
            dataclasses.replace(stacked, kv_indices=stacked.kv_indices[g])
            for g in range(self.num_groups)
        ]

    def flash_attention_page_table(
        self, block_size: int, group: int = 0
    ) -> FlashAttentionPageTable:
        """Group ``group``'s ``block_table`` / ``cache_seqlens`` / ``cu_seqlens_q`` for
        FlashAttention, for the layers of that KV cache group.

        See :func:`kvblocks.page_tables.flash_attention_page_table`; ``block_size`` is
        the manager's. A window or chunked group's released entries stay in place as the
        null block (positions must not shift); the kernel, run with the group's
        ``window_size``, never reads them.

        Raises:
            InvalidArgumentError: ``group`` is not in ``[0, num_groups)``, or a bad
                ``block_size``.
        """
        g = self._group(group)
        if g == 0:
            return flash_attention_page_table(
                self.block_tables, self.seq_lens, block_size, self.query_start_loc
            )
        table, rows = self._table_of(g)
        return flash_attention_page_table(
            table, self.seq_lens, block_size, self.query_start_loc, rows=rows
        )

    def group_flash_attention_page_tables(self, block_size: int) -> list[FlashAttentionPageTable]:
        """Every group's :meth:`flash_attention_page_table`, entry ``g`` for group ``g``:
        one gather over the stacked tables, ``block_table`` of entry ``g`` row ``g`` of one
        ``[G, S, B]`` array; the other fields are shared (the same arrays)."""
        if self.num_groups == 1:
            return [self.flash_attention_page_table(block_size)]
        stacked = flash_attention_page_table(
            self.group_block_tables, self.seq_lens, block_size, self.query_start_loc
        )
        return [
            dataclasses.replace(stacked, block_table=stacked.block_table[g])
            for g in range(self.num_groups)
        ]

    def _group(self, group: object) -> int:
        return check_int(group, "group", minimum=0, maximum=self.num_groups - 1, numpy=True)

    def _table_of(self, group: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32] | None]:
        """Group ``group``'s table and the rows to read it with (``None``: one row per
        scheduled sequence, in order)."""
        if self.block_table_rows is not None:
            if self.group_block_table is not None:
                # Straight from the persistent table: the [S, B] matrix is never built.
                return self.group_block_table[group], self.block_table_rows
            if group == 0 and self.block_table is not None:
                return self.block_table, self.block_table_rows
        if group == 0:
            return self.block_tables, None
        return self.group_block_tables[group], None

    def _stacked_tables(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32] | None]:
        if self.group_block_table is not None and self.block_table_rows is not None:
            return self.group_block_table, self.block_table_rows
        return self.group_block_tables, None

    @classmethod
    def empty(cls, num_block_columns: int = 1) -> SchedulerOutput:
        """A step with no sequences (used when nothing can be scheduled)."""
        i32 = np.zeros(0, dtype=np.int32)
        i64 = np.zeros(0, dtype=np.int64)
        return cls(
            seq_ids=i64,
            num_scheduled_tokens=i32,
            input_token_ids=i64,
            positions=i64,
            slot_mapping=i64,
            query_start_loc=np.zeros(1, dtype=np.int32),
            seq_lens=i32,
            block_tables=np.zeros((0, num_block_columns), dtype=np.int32),
            logits_indices=i64,
            sample_seq_ids=i64,
            sample_request_ids=[],
            sample_counts=i32,
            temperature=np.zeros(0, dtype=np.float32),
            top_p=np.zeros(0, dtype=np.float32),
            top_k=i32,
            seeds=i64,
        )


@dataclass
class ModelStepResult:
    """What the engine computed for a :class:`SchedulerOutput`.

    Attributes:
        sampled_token_ids: int64 [sum(sample_counts)] drawn tokens, row after row (row
            ``r`` contributes ``sample_counts[r]`` tokens).
        sampled_logprobs: float32 [sum(sample_counts)] log-prob of each drawn token
            (under the distribution it was drawn from, or the raw log-softmax; the
            scheduler only accumulates it into ``cumulative_logprob``).
        topk_token_ids: int64 [R, K] the ``K = beam_topk`` most likely tokens of every
            row, best first; ``None`` when ``beam_topk == 0``.
        topk_logprobs: float32 [R, K] their log-probs (log-softmax of the raw logits);
            ``None`` when ``beam_topk == 0``.
    """

    sampled_token_ids: npt.NDArray[np.int64]
    sampled_logprobs: npt.NDArray[np.float32] | None = None
    topk_token_ids: npt.NDArray[np.int64] | None = None
    topk_logprobs: npt.NDArray[np.float32] | None = None
