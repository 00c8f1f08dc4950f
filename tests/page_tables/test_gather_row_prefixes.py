"""``kvblocks._core.gather_row_prefixes``: the ragged gather behind FlashInfer's page list."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import InvalidArgumentError
from kvblocks._core import gather_row_prefixes

TABLE = np.arange(1, 13, dtype=np.int32).reshape(3, 4)


def test_row_prefixes_in_order_and_by_row() -> None:
    got = gather_row_prefixes(TABLE, np.array([1, 0, 4]))
    assert got.dtype == np.int32 and got.tolist() == [1, 9, 10, 11, 12]
    got = gather_row_prefixes(TABLE, [2, 3, 0], rows=np.array([2, 0, 2], dtype=np.int32))
    assert got.tolist() == [9, 10, 1, 2, 3]
    assert gather_row_prefixes(TABLE, []).tolist() == []


def test_matches_a_per_row_loop_on_random_ragged_rows() -> None:
    rng = np.random.default_rng(0)
    table = rng.integers(0, 1 << 30, size=(64, 300), dtype=np.int32)
    rows = rng.permutation(64)[:40]
    counts = rng.integers(0, 301, size=40)
    want = np.concatenate([table[r, :c] for r, c in zip(rows, counts, strict=True)])
    np.testing.assert_array_equal(gather_row_prefixes(table, counts, rows), want)


def test_a_table_without_columns_has_its_rows_of_no_pages() -> None:
    # (3, 0) holds three empty rows; the gather took it for 0 rows and refused every row.
    empty = np.zeros((3, 0), dtype=np.int32)
    assert gather_row_prefixes(empty, [0, 0, 0]).tolist() == []
    got = gather_row_prefixes(empty, [0, 0], rows=[2, 0])
    assert got.dtype == np.int32 and got.tolist() == []
    for counts, rows in (([1], None), ([0, 0, 0, 0], None), ([0], [3])):
        with pytest.raises(InvalidArgumentError):
            gather_row_prefixes(empty, counts, rows)  # wider than 0, or past 3 rows


@pytest.mark.parametrize(
    ("table", "counts", "rows"),
    [
        (TABLE.astype(np.int64), [1], None),  # dtype
        (np.asfortranarray(TABLE), [1], None),  # not C-contiguous
        (TABLE[:, ::2], [1], None),  # strided view
        (TABLE.reshape(-1), [1], None),  # 1-D
        ([[1, 2]], [1], None),  # not an array
        (TABLE, [5], None),  # wider than the table
        (TABLE, [-1], None),  # negative count
        (TABLE, [1, 1, 1, 1], None),  # more counts than rows
        (TABLE, [1], [3]),  # row outside the table
        (TABLE, [1], [-1]),  # negative row
        (TABLE, [1, 1], [0]),  # lengths differ
        (TABLE, [[1]], None),  # counts not 1-D
    ],
)
def test_bad_arguments_raise_invalid_argument(table, counts, rows) -> None:
    with pytest.raises(InvalidArgumentError):
        gather_row_prefixes(table, counts, rows)
