"""Predicates for numeric arguments, shared by the front-ends that run without torch
(router, tiers, engine options).

A bool is never a number here: ``True`` given as a count or a time is a mistake, not 1.
"""

from __future__ import annotations

import math
from typing import TypeGuard

__all__ = ["is_finite_nonnegative", "is_positive_int"]


def is_finite_nonnegative(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or float, finite and ``>= 0`` (a load, a weight, seconds).

    A NaN or infinite value passes a bare comparison and fails only later, in the
    arithmetic or the socket it reaches.
    """
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def is_positive_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int ``>= 1`` (a capacity, a batch size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
