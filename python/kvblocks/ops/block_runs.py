"""Merging a block mapping into contiguous runs, so a swap is a few large copies."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["merge_block_runs"]


def merge_block_runs(mapping: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """Return ``(src_start, dst_start, length)`` runs covering ``mapping`` (``[n, 2]``).

    Consecutive pairs whose source and destination both advance by one join the same
    run; order is preserved, so the copies are equivalent to the pairwise ones.
    """
    if len(mapping) == 0:
        return []
    src = mapping[:, 0]
    dst = mapping[:, 1]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(mapping)]))
    return [
        (int(src[a]), int(dst[a]), int(b - a))
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
