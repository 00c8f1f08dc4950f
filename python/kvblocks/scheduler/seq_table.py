"""Column store of the decoding sequences (:class:`SequenceTable`).

A decode step touches every running sequence, so their per-step state lives in NumPy
columns instead of Python objects: the scheduler builds a step's inputs by slicing the
columns and applies a step's results with a handful of vectorised operations. Rows are
kept sorted by scheduling priority (most important first), so preemption victims are
always taken from the end and a batch that does not fit is cut at its tail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["COLUMNS", "SequenceTable"]

COLUMNS: dict[str, Any] = {
    "seq_id": np.int64,
    "request_id": object,
    "prio": np.int64,  # policy priority (0 unless the policy is "priority")
    "arrival": np.float64,
    "counter": np.int64,  # request admission counter: unique per request, breaks ties
    "num_tokens": np.int64,  # known tokens: prompt + generated; all but the last are computed
    "num_generated": np.int64,
    "max_tokens": np.int64,
    "last_token": np.int64,
    "eos": np.int64,  # -1: no EOS stop
    "has_stop": np.bool_,
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "seed": np.int64,
    "seq_index": np.int32,  # completion index of the sequence within its request
    "cum_logprob": np.float64,
    "is_beam": np.bool_,
}
"""Column names and dtypes."""

Rows = dict[str, npt.NDArray[Any]]


def empty_rows(n: int = 0) -> Rows:
    """Column arrays of ``n`` uninitialised rows."""
    return {name: np.zeros(n, dtype=dtype) for name, dtype in COLUMNS.items()}


class SequenceTable:
    """Decoding sequences as NumPy columns, sorted by (prio, arrival, counter, seq_id).

    ``row_of`` maps a sequence id to its row (``-1`` when absent) so that results can be
    applied after the table was reordered between ``schedule`` and ``update``;
    ``version`` counts the reorderings, so a caller that saw no change since it cut the
    first ``n`` rows knows they are still rows ``0..n-1`` (and can slice instead).
    """

    def __init__(self) -> None:
        self.cols: Rows = empty_rows()
        self.row_of: npt.NDArray[np.int64] = np.full(1024, -1, dtype=np.int64)
        self.version = 0
        # Per-version derived values (the columns change shape only in update(), which
        # bumps the version): the request ids as a list and the first beam row.
        self._derived: tuple[int, list[str], int] | None = None

    def __len__(self) -> int:
        return int(self.cols["seq_id"].shape[0])

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.cols[name]

    def rows_of(self, seq_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Rows of the given sequences (all must be present)."""
        return self.row_of[seq_ids]

    def request_ids(self, end: int) -> list[str]:
        """The request ids of rows ``0..end-1`` (read-only: when ``end`` covers every row
        this is the list cached for the table's version, shared by every step until the
        table changes, because copying it touches a thousand string objects a step)."""
        ids = self._derived_values()[1]
        return ids if end == len(ids) else ids[:end]

    def any_beam_before(self, end: int) -> bool:
        """Whether a beam-search sequence is among rows ``0..end-1``."""
        return self._derived_values()[2] < end

    def _derived_values(self) -> tuple[int, list[str], int]:
        derived = self._derived
        if derived is None or derived[0] != self.version:
            beam = self.cols["is_beam"]
            first_beam = int(beam.argmax()) if beam.any() else len(beam)
            derived = (self.version, self.cols["request_id"].tolist(), first_beam)
            self._derived = derived
        return derived

    def request_boundary(self, end: int) -> int:
        """The largest ``k <= end`` that does not split a multi-sequence request (rows
        ``k - 1`` and ``k`` belong to different requests)."""
        counter = self.cols["counter"]
        while end > 0 and counter[end - 1] == counter[end]:
            end -= 1
        return end

    def take(self, rows: npt.NDArray[np.int64]) -> Rows:
        """Copies of the given rows."""
        return {name: col[rows] for name, col in self.cols.items()}

    def update(self, remove: npt.NDArray[np.int64] | None, add: list[Rows]) -> None:
        """Drop the rows ``remove``, append ``add`` and restore the priority order."""
        self.version += 1
        if remove is not None and remove.size:
            self.row_of[self.cols["seq_id"][remove]] = -1
            keep = np.ones(len(self), dtype=bool)
            keep[remove] = False
            cols = {name: col[keep] for name, col in self.cols.items()}
        else:
            cols = self.cols
        if add:
            cols = {
                name: np.concatenate([col] + [rows[name] for rows in add])
                for name, col in cols.items()
            }
            # New rows usually belong after every running one (fcfs: later arrivals), so
            # the full sort runs only when the order is actually broken.
            if not _is_sorted(cols):
                order = np.lexsort((cols["seq_id"], cols["counter"], cols["arrival"], cols["prio"]))
                cols = {name: col[order] for name, col in cols.items()}
        self.cols = cols
        self._reindex()

    def _reindex(self) -> None:
        ids = self.cols["seq_id"]
        if ids.size:
            top = int(ids.max())
            if top >= self.row_of.shape[0]:
                grown = np.full(max(2 * self.row_of.shape[0], top + 1), -1, dtype=np.int64)
                grown[: self.row_of.shape[0]] = self.row_of
                self.row_of = grown
            self.row_of[ids] = np.arange(ids.shape[0], dtype=np.int64)


def _is_sorted(cols: Rows) -> bool:
    """Whether rows are in (prio, arrival, counter, seq_id) order."""
    keys = (cols["prio"], cols["arrival"], cols["counter"], cols["seq_id"])
    if keys[0].shape[0] < 2:
        return True
    # Row i <= row i+1 lexicographically: decided by the first key that differs.
    undecided = np.ones(keys[0].shape[0] - 1, dtype=bool)
    for key in keys:
        a, b = key[:-1], key[1:]
        if (undecided & (a > b)).any():
            return False
        undecided &= a == b
    return True
