"""Argument checks of the reference block manager (:mod:`oracle.reference_manager`): the
core's limits, and ints, int sequences and per-sequence values refused as the binding
refuses them (:class:`kvblocks.InvalidArgumentError`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvblocks.errors import InvalidArgumentError

_MAX_SEQ_ID = 2**63
_MAX_TOKEN_ID = 2**32
_MAX_LORA_ID = 2**64
_MAX_COUNT = 2**63
_MAX_BLOCKS = 2**26


def _check_int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value < hi:
        raise InvalidArgumentError(f"{name} must be in [{lo}, {hi}), got {value}")
    return value


def _int_list(values: object, name: str, lo: int, hi: int) -> list[int]:
    """A 1-D integer array or sequence as a list of ints in ``[lo, hi)``."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise InvalidArgumentError(f"{name} must be 1-D, got {values.ndim} dimensions")
        if values.size and not np.issubdtype(values.dtype, np.integer):
            raise InvalidArgumentError(f"{name} must have an integer dtype, got {values.dtype}")
        out = [int(v) for v in values.tolist()]
    elif isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(
            f"{name} must be a sequence of ints, got {type(values).__name__}"
        )
    else:
        out = [_check_int(v, name, lo, hi) for v in values]
    for v in out:
        if not lo <= v < hi:
            raise InvalidArgumentError(f"every {name} entry must be in [{lo}, {hi}), got {v}")
    return out


def _per_seq(values: object, n: int, name: str, lo: int, hi: int) -> list[int]:
    """An int broadcast to ``n`` entries, or an array/sequence of exactly ``n`` entries."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, (bool, np.bool_)):
        return [_check_int(values, name, lo, hi)] * n
    out = _int_list(values, name, lo, hi)
    if len(out) != n:
        raise InvalidArgumentError(
            f"{name} has {len(out)} entries, expected one per sequence ({n})"
        )
    return out
