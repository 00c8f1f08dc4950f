"""The persistent block tables of the level (a) content oracle, kept as an engine keeps
them (see :mod:`core.content_oracle`): each resident sequence in a row of a small row
allocator (rows freed when a sequence is freed or swapped out, reused by others, moved,
and the buffer replaced by a bigger one with ``full=True`` when rows run out), synced only
by ``update_block_table``, with a mirror patched only through the returned deltas; a few
sequences at a time lag (are not synced for some operations)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from oracle.kv_memory import assert_array_equal

from .content_oracle_settings import COVERAGE, TABLE_WIDTH, pick


class BlockTableRows:
    """The row rules and the table sync of :class:`core.content_oracle.ContentOracle`
    (mixed in before ``RuleBasedStateMachine``)."""

    m: Any
    table: np.ndarray
    mirror: np.ndarray
    row_of: dict[int, int]
    row_last_owner: dict[int, int]
    row_len: dict[tuple[int, int], int]
    free_rows: list[int]
    lagging: dict[int, int]

    @precondition(lambda self: self.row_of)
    @rule(data=st.data())
    def move_row(self, data):
        """Move a sequence to another row (a free one, or swap with another sequence)."""
        sid = pick(data, sorted(self.row_of))
        others = sorted(self.row_of)
        if self.free_rows and data.draw(st.booleans()):
            new = self.free_rows.pop()
            self.free_rows.append(self.row_of[sid])
            self.row_of[sid] = new
        else:
            other = pick(data, others)
            self.row_of[sid], self.row_of[other] = self.row_of[other], self.row_of[sid]
        COVERAGE["ops"] += 1

    @precondition(lambda self: self.row_of)
    @rule(data=st.data(), steps=st.integers(1, 4))
    def lag(self, data, steps):
        """Leave a sequence out of the next few syncs (an unscheduled sequence)."""
        self.lagging[pick(data, sorted(self.row_of))] = steps

    def _sync_table(self) -> list[int]:
        """Sync the resident sequences (all but the lagging ones) into their rows; return
        the synced ones. Rows of sequences that left the GPU go back to the allocator."""
        resident = self._resident()
        live = set(resident)
        for sid in [s for s in self.row_of if s not in live]:
            self.free_rows.append(self.row_of.pop(sid))
            self.lagging.pop(sid, None)
        full = False
        for sid in resident:
            if sid in self.row_of:
                continue
            if not self.free_rows:
                # A bigger buffer: the manager wrote none of it, so sync it whole.
                old = self.table.shape[1]
                self.table = np.zeros((self.num_groups, 2 * old, TABLE_WIDTH), dtype=np.int32)
                self.mirror = self.table.copy()
                self.free_rows = list(range(2 * old - 1, old - 1, -1))
                self.lagging.clear()
                full = True
            self.row_of[sid] = self.free_rows.pop()
        synced = [s for s in resident if self.lagging.get(s, 0) == 0]
        for sid in list(self.lagging):
            self.lagging[sid] -= 1
            if self.lagging[sid] <= 0:
                del self.lagging[sid]
        rows = [self.row_of[s] for s in synced]
        ids = np.array(synced, np.int64)
        if self.num_groups == 1:
            deltas = [self.m.update_block_table(self.table[0], ids, rows, full=full)]
        else:
            deltas = self.m.update_group_block_tables(self.table, ids, rows, full=full)
        assert len(deltas) == self.num_groups
        # The engine side: patch the mirror from the deltas alone.
        for g, delta in enumerate(deltas):
            assert len(delta.indptr) == len(delta) + 1
            for k in range(len(delta)):
                row = int(delta.rows[k])
                blocks = delta.block_ids[delta.indptr[k] : delta.indptr[k + 1]]
                start = int(delta.start_cols[k])
                if delta.reset[k]:
                    self.mirror[g, row] = 0
                    if self.row_last_owner.get(row, -1) not in (-1, synced[rows.index(row)]):
                        COVERAGE["table_row_reused"] += 1
                else:
                    COVERAGE["table_incremental"] += 1
                    # Copy-on-write, window releases and swap-ins rewrite entries in place.
                    COVERAGE["table_rewrite"] += start < self.row_len.get((g, row), 0)
                self.mirror[g, row, start : start + len(blocks)] = blocks
                self.row_len[(g, row)] = start + len(blocks)
        for s, r in zip(synced, rows, strict=True):
            self.row_last_owner[r] = s
        assert_array_equal(self.mirror, self.table)
        return synced
