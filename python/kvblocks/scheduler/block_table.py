"""The scheduler's persistent block table (:class:`PersistentBlockTable`).

Rebuilding every scheduled sequence's block table each step costs O(sequences x blocks)
(an 8 MB matrix at 1,024 sequences x 32k tokens). Instead the scheduler keeps one
``[max_rows, max_blocks]`` int32 table for the whole run: each sequence on the GPU owns a
row (given when it is first scheduled, taken back when it is freed, preempted or swapped
out), and every step the block manager writes only the entries that changed
(``KVCacheManager.update_block_table``) and reports them as a delta, so an engine keeping
a copy on its device scatters only those (:func:`delta_indices`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError
from kvblocks.protocols import BlockManager

__all__ = [
    "DecodeSync",
    "PersistentBlockTable",
    "TableDelta",
    "TableWrites",
    "apply_delta",
    "delta_indices",
]

#: Columns of a new table; it grows (doubling) to the longest table scheduled.
INITIAL_COLUMNS = 16


class TableDelta(Protocol):
    """The writes of one sync: ``kvblocks._core.BlockTableDelta`` or :class:`TableWrites`.

    Entry ``k``: row ``rows[k]`` gets ``block_ids[indptr[k]:indptr[k + 1]]`` from column
    ``start_cols[k]``; if ``reset[k]`` the rest of the row is the null block.
    """

    @property
    def rows(self) -> npt.NDArray[np.int32]: ...
    @property
    def start_cols(self) -> npt.NDArray[np.int32]: ...
    @property
    def indptr(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def reset(self) -> npt.NDArray[np.bool_]: ...
    def __len__(self) -> int: ...


@dataclass
class TableWrites:
    """A :class:`TableDelta` built in Python (managers without ``update_block_table``)."""

    rows: npt.NDArray[np.int32]
    start_cols: npt.NDArray[np.int32]
    indptr: npt.NDArray[np.int64]
    block_ids: npt.NDArray[np.int32]
    reset: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @classmethod
    def empty(cls) -> TableWrites:
        """No writes (a step without sequences)."""
        i32 = np.zeros(0, dtype=np.int32)
        return cls(i32, i32, np.zeros(1, np.int64), i32, np.zeros(0, dtype=bool))


def delta_indices(delta: TableDelta) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(row, col)`` index arrays of every id in ``delta.block_ids``, for one scatter
    ``table[row, col] = block_ids`` (after clearing the rows ``delta.rows[delta.reset]``)."""
    indptr = np.asarray(delta.indptr, dtype=np.int64)
    counts: npt.NDArray[np.int64] = indptr[1:] - indptr[:-1]
    rows = np.repeat(np.asarray(delta.rows, dtype=np.int64), counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(indptr[:-1], counts)
    cols = np.repeat(np.asarray(delta.start_cols, dtype=np.int64), counts) + within
    return rows, cols


def apply_delta(table: npt.NDArray[np.int32], delta: TableDelta) -> None:
    """Apply ``delta`` to a NumPy copy of the table, in place (what an engine does on its
    device with the same index arrays)."""
    reset = np.asarray(delta.reset, dtype=bool)
    if reset.any():
        table[np.asarray(delta.rows)[reset]] = 0
    rows, cols = delta_indices(delta)
    table[rows, cols] = delta.block_ids


@dataclass(slots=True)
class DecodeSync:
    """What :meth:`PersistentBlockTable.allocate_decodes` synced: the sequences' rows,
    the table's writes (one delta, group 0), each token's cache slot and its position."""

    rows: npt.NDArray[np.int32]
    deltas: list[TableDelta]
    slots: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]


class PersistentBlockTable:
    """A ``[max_rows, max_blocks]`` int32 table kept in step with a block manager, with a
    row allocator over the sequences it holds.

    Args:
        manager: the block manager (``update_block_table`` is used when it has one; a
            manager without it gets whole rows from ``block_tables`` every step).
        num_rows: initial rows (``max_num_seqs``); the table grows when more sequences
            hold rows at once (a request wider than the limit admitted alone).
        block_size: tokens per block.
        num_lookahead_tokens: extra slots each step reserves (they widen tables).

    With a manager built with several KV cache groups the table is kept per group:
    :attr:`group_tables` is ``[num_groups, max_rows, max_blocks]`` (each sequence in the
    same row of every group) and :attr:`table` is its group 0, a view; one
    ``update_group_block_tables`` call syncs every group.

    :attr:`table` is replaced by a bigger array (content kept) when it must grow;
    :attr:`reallocated` is then true until the next :meth:`sync`.
    """

    def __init__(
        self, manager: BlockManager, num_rows: int, block_size: int, num_lookahead_tokens: int = 0
    ) -> None:
        self.manager = manager
        self.block_size = block_size
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_groups = int(getattr(manager, "num_groups", 1))
        self.group_tables: npt.NDArray[np.int32] = np.zeros(
            (self.num_groups, num_rows, INITIAL_COLUMNS), np.int32
        )
        self.table: npt.NDArray[np.int32] = self.group_tables[0]
        self.reallocated = True
        self._row_of: npt.NDArray[np.int32] = np.full(1024, -1, dtype=np.int32)
        self._free: list[int] = list(range(num_rows - 1, -1, -1))
        self._incremental = hasattr(manager, "update_block_table")
        # Counts the changes of the sequence -> row map, and the last decode batch's rows
        # under it (allocate_decodes: a steady decode batch keeps its rows).
        self._num_row_changes = 0
        self._batch_rows: tuple[Hashable, int, npt.NDArray[np.int32]] | None = None

    def num_held_rows(self) -> int:
        """Rows held by sequences."""
        return int(self.table.shape[0]) - len(self._free)

    def row_of(self, seq_id: int) -> int:
        """The row of a sequence, ``-1`` if it holds none."""
        return int(self._row_of[seq_id]) if 0 <= seq_id < len(self._row_of) else -1

    def assign(self, seq_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """Rows of ``seq_ids`` (int32), giving a free row to each sequence without one."""
        try:
            rows = self._row_of[seq_ids]
        except IndexError:  # a sequence id past the map (ids are small and reused)
            grown = np.full(max(2 * len(self._row_of), int(seq_ids.max()) + 1), -1, np.int32)
            grown[: len(self._row_of)] = self._row_of
            self._row_of = grown
            rows = self._row_of[seq_ids]
        missing = rows < 0
        if not missing.any():  # the usual step: every sequence has its row
            return rows
        self._num_row_changes += 1
        for i in np.flatnonzero(missing).tolist():
            if not self._free:
                self._grow(rows=2 * self.table.shape[0])
            row = self._free.pop()
            self._row_of[seq_ids[i]] = row
            rows[i] = row
        return rows

    def release(self, seq_ids: Iterable[int]) -> None:
        """Take back the rows of sequences leaving the GPU (freed, preempted, swapped)."""
        for seq in seq_ids:
            row = self.row_of(seq)
            if row >= 0:
                self._row_of[seq] = -1
                self._free.append(row)
                self._num_row_changes += 1

    def sync(
        self,
        seq_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
    ) -> TableDelta:
        """Write the changed entries of the sequences' tables into their rows.

        ``seq_lens`` (context lengths after the step) bound the tables' lengths, so the
        table is widened first when they would not fit. Returns group 0's writes (every
        group is synced; :meth:`sync_groups` returns each group's).
        """
        return self.sync_groups(seq_ids, rows, seq_lens)[0]

    def sync_groups(
        self,
        seq_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
    ) -> list[TableDelta]:
        """:meth:`sync` of every group in one manager call; one delta per group."""
        self._fit(seq_lens)
        if not self._incremental:
            return [self._write_whole(seq_ids, rows)]
        try:
            return self._update(seq_ids, rows)
        except InvalidArgumentError:
            # Spare blocks from an earlier, larger reservation can make a table longer
            # than its context: widen once and retry (nothing was written or consumed).
            self._grow(cols=2 * self.table.shape[1])
            return self._update(seq_ids, rows)

    def sync_decodes(
        self,
        seq_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
        positions: npt.NDArray[np.int64],
    ) -> tuple[list[TableDelta], npt.NDArray[np.int64]]:
        """:meth:`sync_groups` of a step of decodes (one token each) and the tokens' cache
        slots (:meth:`decode_slots`), in one manager call when it has one."""
        # KVCacheManager's fused call; other managers (the tests' reference) take two steps.
        fused = getattr(self.manager, "update_decode_block_table", None)
        if fused is None or self.num_groups != 1 or not self._incremental:
            deltas = self.sync_groups(seq_ids, rows, seq_lens)
            return deltas, self.decode_slots(rows, positions)
        self._fit(seq_lens)
        try:
            delta, slots = fused(self.table, seq_ids, rows, positions)
        except InvalidArgumentError:
            # As in sync_groups: a table longer than its context (nothing was written).
            self._grow(cols=2 * self.table.shape[1])
            delta, slots = fused(self.table, seq_ids, rows, positions)
        return [delta], slots

    def allocate_decodes(
        self,
        seq_ids: npt.NDArray[np.int64],
        seq_lens: npt.NDArray[np.int64],
        num_lookahead_tokens: int,
        batch_key: Hashable = None,
    ) -> tuple[int, DecodeSync | None] | None:
        """A step of decodes only (one token each, ``seq_lens`` tokens known) in one
        manager call when it has one (``KVCacheManager.allocate_decode_step``) and every
        sequence holds a row: the allocation, the sync of their rows and their tokens'
        slots. Returns ``(num_served, synced)``, ``synced`` ``None`` when the call synced
        nothing (the pool ran short, or the table must widen first: :meth:`sync_decodes`
        does it later); ``None`` when the manager has no such call or a sequence holds no
        row yet: nothing was done then.

        ``batch_key``: when not ``None``, a key the caller passes only with the same
        ``seq_ids`` (the decode table's version and row count): while no row was given or
        taken back since, the batch's rows are those of the last call with that key."""
        fused = getattr(self.manager, "allocate_decode_step", None)
        if fused is None or self.num_groups != 1 or not self._incremental:
            return None
        try:
            rows = self._rows_of_batch(seq_ids, batch_key)
            positions = seq_lens - 1
            # A sequence without a row yet (-1, or an id past the map) is refused before
            # anything changes: assign() gives first rows, in batch order, at build time.
            served, synced = fused(
                self.table, seq_ids, rows, positions, num_lookahead_tokens=num_lookahead_tokens
            )
        except (IndexError, InvalidArgumentError):
            return None  # nothing changed; the caller's allocate_slots_batch reports errors
        if synced is None:
            return served, None
        delta, slots = synced
        return served, DecodeSync(rows, [delta], slots, positions)

    def _rows_of_batch(
        self, seq_ids: npt.NDArray[np.int64], batch_key: Hashable
    ) -> npt.NDArray[np.int32]:
        """``self._row_of[seq_ids]`` (a fresh array: it goes out with the step), from the
        last batch's rows when ``batch_key`` names the same batch and no row moved."""
        memo = self._batch_rows
        rows: npt.NDArray[np.int32]
        if (
            batch_key is not None
            and memo is not None
            and memo[1] == self._num_row_changes
            and memo[0] == batch_key
        ):
            rows = memo[2].copy()  # a copy is cheaper than the gather
            return rows
        rows = self._row_of[seq_ids]
        if batch_key is not None:
            self._batch_rows = (batch_key, self._num_row_changes, rows.copy())
        return rows

    def _fit(self, seq_lens: npt.NDArray[np.int32]) -> None:
        """Widen the table to hold tables of ``seq_lens`` tokens (plus lookahead)."""
        if len(seq_lens):
            longest = int(seq_lens.max()) + self.num_lookahead_tokens
            need = -(-longest // self.block_size)
            if need > self.table.shape[1]:
                self._grow(cols=max(need, 2 * self.table.shape[1]))

    def _update(
        self, seq_ids: npt.NDArray[np.int64], rows: npt.NDArray[np.int32]
    ) -> list[TableDelta]:
        if self.num_groups == 1:
            return [self.manager.update_block_table(self.table, seq_ids, rows)]
        return list(self.manager.update_group_block_tables(self.group_tables, seq_ids, rows))

    def decode_slots(
        self, rows: npt.NDArray[np.int32], positions: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """The cache slot of one token per row (``block * block_size + offset``), read
        from the table: what the manager's ``slot_mapping`` gives for a decode step, once
        :meth:`sync` wrote the step's rows (the block a position falls in is reserved)."""
        blocks = self.table[rows, positions // self.block_size].astype(np.int64)
        blocks *= self.block_size
        blocks += positions % self.block_size
        return blocks

    def step_done(self) -> None:
        """The step's output carries the current table; later growth is news again."""
        self.reallocated = False

    def _write_whole(
        self, seq_ids: npt.NDArray[np.int64], rows: npt.NDArray[np.int32]
    ) -> TableWrites:
        tables = np.asarray(self.manager.block_tables(seq_ids), dtype=np.int32)
        width = tables.shape[1] if tables.ndim == 2 else 0
        if width > self.table.shape[1]:
            self._grow(cols=max(width, 2 * self.table.shape[1]))
        self.table[rows] = 0
        self.table[rows, :width] = tables.reshape(len(rows), width)
        return TableWrites(
            rows=rows.astype(np.int32),
            start_cols=np.zeros(len(rows), np.int32),
            indptr=np.arange(len(rows) + 1, dtype=np.int64) * width,
            block_ids=tables.reshape(-1),
            reset=np.ones(len(rows), dtype=bool),
        )

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self.table.shape
        new_rows = old_rows if rows is None else rows
        new_cols = old_cols if cols is None else cols
        grown = np.zeros((self.num_groups, new_rows, new_cols), dtype=np.int32)
        grown[:, :old_rows, :old_cols] = self.group_tables
        self.group_tables = grown
        self.table = grown[0]
        self._free = list(range(new_rows - 1, old_rows - 1, -1)) + self._free
        self.reallocated = True
