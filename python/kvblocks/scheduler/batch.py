"""Assembly of one step's batch: the :class:`SchedulerOutput` arrays and the plan that
``update`` needs to apply the engine's results."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt

from kvblocks.protocols import BlockManager
from kvblocks.scheduler.block_table import (
    DecodeSync,
    PersistentBlockTable,
    TableDelta,
    TableWrites,
)
from kvblocks.scheduler.memory_ops import MemoryOps
from kvblocks.scheduler.output import SchedulerOutput
from kvblocks.scheduler.request import RequestOutput
from kvblocks.scheduler.request_state import RequestState
from kvblocks.scheduler.seq_table import SequenceTable
from kvblocks.scheduler.step import Chunk

__all__ = ["DecodeRows", "StepBatch", "StepPlan", "build_step"]


@dataclass(slots=True)
class StepPlan:
    """What ``schedule`` decided, kept until the matching ``update``.

    Attributes:
        output: the step's output (``update`` must be given this very object).
        now: the step's time (events while the step is in flight share it).
        chunks: the prefill chunks.
        row_seq_pos: the position in ``output.seq_ids`` of each sampling row.
        row_chunk: the chunk index of each prefill sampling row.
        special: some row has ``sample_count != 1``.
        ended: final records of requests ended for lack of room while scheduling.
        aborted: requests aborted while the step was in flight (released at ``update``).
        table_version: the decode table's version when the decode rows were cut: while
            it is unchanged they are still rows ``0..num_decode_seqs-1``.
    """

    output: SchedulerOutput
    now: float = 0.0
    chunks: list[Chunk] = field(default_factory=list)
    row_seq_pos: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    row_chunk: list[int] = field(default_factory=list)
    special: bool = False
    ended: list[RequestOutput] = field(default_factory=list)
    aborted: list[RequestState] = field(default_factory=list)
    table_version: int = -1


@dataclass(slots=True)
class DecodeRows:
    """A step's decode rows: the first ``len(seq_ids)`` rows of the decode table, batch
    order (``lens`` and ``is_beam`` are views, read before the table changes), cut at
    the table's ``table_version``; ``synced``: their block-table rows, synced with the
    allocation (a decode-only step, :meth:`PersistentBlockTable.allocate_decodes`)."""

    seq_ids: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    lens: npt.NDArray[np.int64]
    is_beam: npt.NDArray[np.bool_]
    temperature: npt.NDArray[np.float32]
    top_p: npt.NDArray[np.float32]
    top_k: npt.NDArray[np.int32]
    seeds: npt.NDArray[np.int64]
    seq_index: npt.NDArray[np.int32]
    request_ids: list[str]
    any_beam: bool
    table_version: int
    synced: DecodeSync | None = None

    @classmethod
    def from_table(
        cls, table: SequenceTable, end: int, synced: DecodeSync | None = None
    ) -> DecodeRows:
        """The first ``end`` rows of the table's columns."""
        cols = table.cols
        return cls(
            seq_ids=cols["seq_id"][:end].copy(),
            tokens=cols["last_token"][:end].copy(),
            lens=cols["num_tokens"][:end],
            is_beam=cols["is_beam"][:end],
            temperature=cols["temperature"][:end].copy(),
            top_p=cols["top_p"][:end].copy(),
            top_k=cols["top_k"][:end].copy(),
            seeds=cols["seed"][:end].copy(),
            seq_index=cols["seq_index"][:end].copy(),
            request_ids=table.request_ids(end),
            any_beam=table.any_beam_before(end),
            table_version=table.version,
            synced=synced,
        )


@dataclass(slots=True)
class StepBatch:
    """Everything a step computes and moves: the input of :func:`build_step`."""

    decodes: DecodeRows
    chunks: list[Chunk]
    memory_ops: MemoryOps
    finished_request_ids: list[str]


def build_step(
    manager: BlockManager,
    batch: StepBatch,
    beam_width_of: Callable[[int], int],
    block_table: PersistentBlockTable | None = None,
    state_groups: Sequence[int] = (),
) -> tuple[SchedulerOutput, StepPlan]:
    """Assemble the step's :class:`SchedulerOutput` from its decode rows and prefill chunks.

    ``beam_width_of(seq_id)`` gives the beam width of a decoding beam sequence. One
    ``slot_mapping`` call covers the whole batch; with a ``block_table`` (the scheduler's
    persistent table) one sync writes only the entries that changed and
    ``SchedulerOutput.block_tables`` is gathered only if read (and a decode-only step's
    slots are read from the synced rows), else one ``block_tables`` call builds the
    ``[S, B]`` tables. Each recurrent-state group in ``state_groups`` adds its
    ``state_mapping`` of the batch.
    """
    mgr = manager
    dec = batch.decodes
    chunks = batch.chunks
    if dec.synced is not None and not (chunks or dec.any_beam or state_groups):
        assert block_table is not None  # only its allocate_decodes syncs
        return _synced_decodes(batch, dec.synced, block_table)
    num_decode = len(dec.seq_ids)
    dec_ids, dec_tokens, dec_lens, dec_beam = dec.seq_ids, dec.tokens, dec.lens, dec.is_beam
    temperature, top_p, top_k, seeds, seq_index = (
        dec.temperature,
        dec.top_p,
        dec.top_k,
        dec.seeds,
        dec.seq_index,
    )
    dec_request_ids = dec.request_ids
    special = dec.any_beam
    beam_width = 0
    if special:
        sample_counts = np.where(dec_beam, 0, 1).astype(np.int32)
        for seq in dec_ids[dec_beam].tolist():
            beam_width = max(beam_width, beam_width_of(seq))
    else:
        sample_counts = np.ones(num_decode, dtype=np.int32)
    num_sched: npt.NDArray[np.int64] | None = None  # None: decodes only, one token each
    if chunks:
        chunk_ids = np.array([s.seq_ids[0] for s, _, _ in chunks], dtype=np.int64)
        chunk_lens = np.array([n for _, _, n in chunks], dtype=np.int64)
        chunk_starts = np.array([a for _, a, _ in chunks], dtype=np.int64)
        seq_ids = np.concatenate([dec_ids, chunk_ids])
        num_sched = np.concatenate([np.ones(num_decode, np.int64), chunk_lens])
        input_ids = np.concatenate(
            [dec_tokens] + [s.tokens[a : a + n] for s, a, n in chunks]
        ).astype(np.int64, copy=False)
        # positions: a ramp per chunk, built without a per-token loop.
        offsets = np.repeat(chunk_starts - np.cumsum(chunk_lens) + chunk_lens, chunk_lens)
        chunk_pos = np.arange(int(chunk_lens.sum()), dtype=np.int64) + offsets
        positions = np.concatenate([dec_lens - 1, chunk_pos])
        seq_lens = np.concatenate([dec_lens, chunk_starts + chunk_lens]).astype(np.int32)
    else:
        seq_ids = dec_ids
        input_ids = dec_tokens
        positions = dec_lens - 1
        seq_lens = dec_lens.astype(np.int32)
    if num_sched is None:
        num_scheduled = np.ones(num_decode, dtype=np.int32)
        query_start_loc = np.arange(num_decode + 1, dtype=np.int32)
        num_prefill_tokens = 0
    else:
        num_scheduled = num_sched.astype(np.int32)
        query_start_loc = np.zeros(len(seq_ids) + 1, dtype=np.int32)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_prefill_tokens = int(num_sched[num_decode:].sum())
    logits = [np.arange(num_decode, dtype=np.int64)]
    row_seq_pos = [np.arange(num_decode, dtype=np.int64)]
    row_chunk: list[int] = []
    extra_counts: list[int] = []
    extra_sampling: list[tuple[float, float, int, int]] = []
    extra_request_ids: list[str] = []
    extra_index: list[int] = []
    for j, (state, start, length) in enumerate(chunks):
        if start + length < len(state.tokens):
            continue  # not the prompt's last chunk: nothing to sample
        params = state.params
        pos = num_decode + j
        logits.append(np.array([query_start_loc[pos + 1] - 1], dtype=np.int64))
        row_seq_pos.append(np.array([pos], dtype=np.int64))
        row_chunk.append(j)
        if params.use_beam_search:
            count = 0
            beam_width = max(beam_width, params.beam_width)
        else:
            count = state.prompt_sample_count
        special = special or count != 1
        extra_counts.append(count)
        seed = -1 if params.seed is None else params.seed
        extra_sampling.append((params.temperature, params.top_p, params.top_k, seed))
        extra_request_ids.append(state.request.request_id)
        extra_index.append(state.seq_index.get(state.seq_ids[0], 0))
    if extra_counts:
        sample_counts = np.concatenate([sample_counts, np.array(extra_counts, np.int32)])
        ext = np.array(extra_sampling, dtype=np.float64).reshape(-1, 4)
        temperature = np.concatenate([temperature, ext[:, 0].astype(np.float32)])
        top_p = np.concatenate([top_p, ext[:, 1].astype(np.float32)])
        top_k = np.concatenate([top_k, ext[:, 2].astype(np.int32)])
        # A prompt row samples for the request's first sequence (index 0), or for the
        # sequence a recomputed part continues; an n > 1 prompt row's draws i = 0..n-1
        # go to the sequences of index i.
        seq_index = np.concatenate([seq_index, np.array(extra_index, np.int32)])
        seeds = np.concatenate([seeds, np.array([e[3] for e in extra_sampling], np.int64)])
        dec_request_ids = dec_request_ids + extra_request_ids
    logits_indices = np.concatenate(logits) if len(logits) > 1 else logits[0]
    plan_row_pos = np.concatenate(row_seq_pos) if len(row_seq_pos) > 1 else row_seq_pos[0]
    block_tables: npt.NDArray[np.int32] | None = None
    table_rows = None
    table_deltas: list[TableDelta] | None = None
    num_groups = int(getattr(mgr, "num_groups", 1))
    counts = 1 if num_sched is None else num_sched  # decodes only: one token each
    group_slots: npt.NDArray[np.int64] | None = None
    if len(seq_ids):
        if num_groups > 1:
            # One call for every group's slots (each group writes into its own blocks).
            group_slots = np.asarray(mgr.group_slot_mappings(seq_ids, counts), dtype=np.int64)
        if block_table is None:
            block_tables = np.asarray(mgr.block_tables(seq_ids), dtype=np.int32)
        elif dec.synced is not None and not chunks and group_slots is None:
            # Phase 1 synced the decode rows and read their slots with the allocation.
            table_rows, table_deltas = dec.synced.rows, dec.synced.deltas
            group_slots = dec.synced.slots[None]
        else:
            table_rows = block_table.assign(seq_ids)
            if group_slots is None and num_sched is None:
                # Decodes only: one slot each, read from the rows just synced.
                table_deltas, slots = block_table.sync_decodes(
                    seq_ids, table_rows, seq_lens, positions
                )
                group_slots = slots[None]
            else:
                table_deltas = block_table.sync_groups(seq_ids, table_rows, seq_lens)
        if group_slots is None:
            group_slots = np.asarray(mgr.slot_mapping(seq_ids, counts), dtype=np.int64)[None]
    else:
        group_slots = np.zeros((num_groups, 0), dtype=np.int64)
        block_tables = np.zeros((0, 1), dtype=np.int32)
        if block_table is not None:
            table_rows = np.zeros(0, dtype=np.int32)
            table_deltas = [TableWrites.empty() for _ in range(num_groups)]
    slot_mapping = group_slots[0]
    output = SchedulerOutput(
        seq_ids=seq_ids,
        num_scheduled_tokens=num_scheduled,
        input_token_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        # None: gathered from block_table on first read (SchedulerOutput.block_tables).
        block_tables=cast("npt.NDArray[np.int32]", block_tables),
        logits_indices=logits_indices,
        sample_seq_ids=seq_ids[plan_row_pos] if chunks else seq_ids.copy(),
        sample_request_ids=dec_request_ids,
        sample_seq_index=seq_index.astype(np.int32, copy=False),
        sample_counts=sample_counts,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seeds=seeds,
        beam_topk=2 * beam_width,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=num_decode,
        num_decode_seqs=num_decode,
        finished_request_ids=batch.finished_request_ids,
        memory_ops=batch.memory_ops,
        group_slot_mappings=group_slots,
    )
    if state_groups and len(seq_ids):
        output.state_mappings = [mgr.state_mapping(seq_ids, group=g) for g in state_groups]
    if block_table is not None:
        assert table_deltas is not None
        output.block_table = block_table.table
        output.group_block_table = block_table.group_tables
        output.block_table_rows = table_rows
        output.block_table_delta = table_deltas[0]
        output.group_block_table_deltas = table_deltas
        output.block_table_reallocated = block_table.reallocated
        block_table.step_done()
    plan = StepPlan(
        output,
        chunks=chunks,
        row_seq_pos=plan_row_pos,
        row_chunk=row_chunk,
        special=special,
        table_version=dec.table_version,
    )
    return output, plan


class _Ramps(NamedTuple):
    """Read-only templates of a decode step's constant arrays (copied into each output)."""

    int32: npt.NDArray[np.int32]  # [3n + 1]: ones(n) twice, then arange(n + 1)
    rows: npt.NDArray[np.int64]  # [n] logits_indices, row_seq_pos


@functools.lru_cache(maxsize=8)
def _ramps(n: int) -> _Ramps:
    ramps = _Ramps(
        np.concatenate([np.ones(2 * n, np.int32), np.arange(n + 1, dtype=np.int32)]),
        np.arange(n, dtype=np.int64),
    )
    for a in ramps:
        a.flags.writeable = False
    return ramps


def _synced_decodes(
    batch: StepBatch, synced: DecodeSync, block_table: PersistentBlockTable
) -> tuple[SchedulerOutput, StepPlan]:
    """:func:`build_step` of the steady state, a step of decodes only (no beam search)
    whose rows phase 1 allocated and synced: the same output with the fewest NumPy
    operations (constant arrays are copies of cached templates; the positions, rows and
    slots come from the sync)."""
    dec = batch.decodes
    n = len(dec.seq_ids)
    ramps = _ramps(n)
    # One copy for the three int32 arrays (separate views of it, none overlapping).
    int32 = ramps.int32.copy()
    group_slots = synced.slots[None]
    output = SchedulerOutput(
        seq_ids=dec.seq_ids,
        num_scheduled_tokens=int32[:n],
        input_token_ids=dec.tokens,
        positions=synced.positions,
        slot_mapping=group_slots[0],
        query_start_loc=int32[2 * n :],
        seq_lens=dec.lens.astype(np.int32),
        # None: gathered from block_table on first read (SchedulerOutput.block_tables).
        block_tables=cast("npt.NDArray[np.int32]", None),
        logits_indices=ramps.rows.copy(),
        sample_seq_ids=dec.seq_ids.copy(),
        sample_request_ids=dec.request_ids,
        sample_seq_index=dec.seq_index,
        sample_counts=int32[n : 2 * n],
        temperature=dec.temperature,
        top_p=dec.top_p,
        top_k=dec.top_k,
        seeds=dec.seeds,
        num_decode_tokens=n,
        num_decode_seqs=n,
        finished_request_ids=batch.finished_request_ids,
        memory_ops=batch.memory_ops,
        block_table=block_table.table,
        block_table_rows=synced.rows,
        block_table_delta=synced.deltas[0],
        block_table_reallocated=block_table.reallocated,
        group_slot_mappings=group_slots,
        group_block_table=block_table.group_tables,
        group_block_table_deltas=synced.deltas,
    )
    block_table.step_done()
    # Every row samples one token in batch order: update never reads row_seq_pos.
    return output, StepPlan(output, row_seq_pos=ramps.rows, table_version=dec.table_version)
