"""One engine round against a manager, and the type of the ``make`` fixture.

Shared by the API, error and semantics tests, which run on both the Rust manager and
the reference model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Make = Callable[..., Any]
"""Type of the ``make`` fixture (``conftest.py``): builds the manager under test."""


def run(m: Any, seq_id: int, n: int, tokens: list[int] | None = None) -> np.ndarray:
    """Allocate ``n`` slots and commit them (plus ``tokens``): one engine round."""
    blocks = m.allocate_slots(seq_id, n)
    assert blocks is not None
    m.commit(seq_id, n, tokens or [])
    return blocks
