"""Argument checkers for the public boundary: each returns the value it accepted.

A public constructor or call checks each argument once, here, and keeps what the checker
returns (``self._capacity = check_int(capacity, "capacity", minimum=1)``); the layers
below trust it. Every failure is an :class:`~kvblocks.errors.InvalidArgumentError` whose
message names the argument, what it must be and what it got.

A bool is never a number here: ``True`` given as a count or a time is a mistake, not 1.
NaN and the infinities are never finite numbers: they pass a bare comparison and fail
only later, in the arithmetic or the socket they reach. Needs neither torch nor NumPy.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from kvblocks.errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "INT32_MAX",
    "RETENTION_PRIORITY_MAX",
    "TOKEN_ID_MAX",
    "check_block_hashes",
    "check_bool",
    "check_int",
    "check_int_array",
    "check_iterable",
    "check_number",
    "check_optional_int",
    "check_priority",
    "check_real_array",
    "check_request_id",
    "check_shape",
]

INT32_MAX = 2**31 - 1
"""The largest length, window or count a kernel's or the core's int32 argument holds."""


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def check_int(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    expected: str | None = None,
    numpy: bool = False,
) -> int:
    """``value`` as an ``int`` if it is an int (not a bool) in ``[minimum, maximum]``;
    else raise. ``numpy=True`` also accepts NumPy integer scalars (returned as ``int``).
    ``expected`` replaces the generated description ("an int >= 1") in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if numpy else int):
        raise InvalidArgumentError(
            f"{name} must be {expected or 'an int' + _bounds(minimum, maximum)}, got {value!r}"
        )
    result = int(value)
    if (minimum is not None and result < minimum) or (maximum is not None and result > maximum):
        raise InvalidArgumentError(
            f"{name} must be {expected or 'an int' + _bounds(minimum, maximum)}, got {value!r}"
        )
    return result


TOKEN_ID_MAX = 2**32 - 1
"""The largest token id: prompts, stop tokens and the manager's token store are u32."""

RETENTION_PRIORITY_MAX = 100
"""The highest retention priority (TensorRT-LLM's range, as the manager's)."""


def check_priority(value: object, name: str = "priority") -> int:
    """A tier's retention priority: an int (or NumPy integer) in ``[0, 100]``, the range
    the manager, ``Request`` and ``SamplingParams`` take; else raise."""
    return check_int(value, name, minimum=0, maximum=RETENTION_PRIORITY_MAX, numpy=True)


def check_request_id(value: object) -> str:
    """``value`` if it is a ``str`` (request ids are: ``Request`` checks them), else raise
    :class:`InvalidTypeError` (an unhashable id would raise a bare ``TypeError`` from the
    lookup it is used in)."""
    if not isinstance(value, str):
        raise InvalidTypeError(f"request_id must be a str, got {type(value).__name__}")
    return value


def check_optional_int(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    expected: str | None = None,
    numpy: bool = False,
) -> int | None:
    """None, or :func:`check_int` of ``value``."""
    if value is None:
        return None
    return check_int(
        value,
        name,
        minimum=minimum,
        maximum=maximum,
        expected=expected or f"None or an int{_bounds(minimum, maximum)}",
        numpy=numpy,
    )


def check_number(
    value: object,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    expected: str | None = None,
    numpy: bool = False,
    infinite: bool = False,
) -> float:
    """``value`` as a ``float`` if it is a finite int or float (not a bool) in
    ``[minimum, maximum]``, and ``> 0`` if ``positive``; else raise. ``numpy=True`` also
    accepts NumPy's scalars (any real number); ``infinite=True`` also the infinities
    that lie in the bounds (never NaN)."""
    finite = "a number" if infinite else "a finite number"
    if positive:
        described = finite + " > 0" + (f" and <= {maximum}" if maximum is not None else "")
    else:
        described = finite + _bounds(minimum, maximum)
    kinds = numbers.Real if numpy else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or math.isnan(value)
        or (not infinite and math.isinf(value))
    ):
        raise InvalidArgumentError(f"{name} must be {expected or described}, got {value!r}")
    result = float(value)
    if (
        (minimum is not None and result < minimum)
        or (maximum is not None and result > maximum)
        or (positive and result <= 0)
    ):
        raise InvalidArgumentError(f"{name} must be {expected or described}, got {value!r}")
    return result


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a bool (not 0 or 1, not a truthy object); else raise."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return value


def check_block_hashes(values: Iterable[object], name: str, *, numpy: bool = False) -> None:
    """Raise :class:`~kvblocks.errors.InvalidTypeError` unless every value is a block hash:
    ``bytes`` or an int (not a bool; ``numpy=True`` also accepts NumPy integers)."""
    kinds = (numbers.Integral, bytes) if numpy else (int, bytes)
    for h in values:
        # Exact int/bytes first: the ABC check costs ~0.3 us a hash, and the router's
        # route() is otherwise a few dict lookups.
        if type(h) is int or type(h) is bytes:
            continue
        if isinstance(h, bool) or not isinstance(h, kinds):
            raise InvalidTypeError(f"{name} must hold ints or bytes, got {type(h).__name__}")


def check_shape(value: object, name: str, expected: Sequence[int | None], meaning: str) -> None:
    """Raise unless ``value`` has a ``shape`` of ``len(expected)`` dimensions, each equal
    to its entry of ``expected`` (``None``: any size). ``meaning`` says what each
    dimension is, for the message ("one row per group, one column per token")."""
    shape = getattr(value, "shape", None)
    if (
        not isinstance(shape, tuple)
        or len(shape) != len(expected)
        or any(want is not None and got != want for got, want in zip(shape, expected, strict=True))
    ):
        want = ", ".join("*" if d is None else str(d) for d in expected)
        got = "no shape" if shape is None else f"shape {list(shape)}"
        raise InvalidArgumentError(f"{name} must have shape [{want}] ({meaning}), got {got}")


def _dtype_kind(value: object) -> str | None:
    return getattr(getattr(value, "dtype", None), "kind", None)


def check_int_array(value: object, name: str, *, minimum: int, maximum: int) -> None:
    """Raise unless ``value`` (an array: NumPy's or one with ``dtype``, ``size``,
    ``min()`` and ``max()``) holds integers (not bools) in ``[minimum, maximum]``; an
    empty array of any dtype passes. Callers turn their argument into an array first
    (``np.asarray(x)``, never ``np.asarray(x, dtype=np.int64)``: that cast truncates
    floats, parses strings and wraps unsigned values, silently)."""
    if not getattr(value, "size", 0):
        return
    kind = _dtype_kind(value)
    if kind not in ("i", "u"):
        dtype = getattr(value, "dtype", type(value).__name__)
        raise InvalidArgumentError(f"{name} must hold integers, got dtype {dtype}")
    low, high = int(value.min()), int(value.max())  # type: ignore[attr-defined]
    if low < minimum or high > maximum:
        raise InvalidArgumentError(
            f"{name} must hold integers in [{minimum}, {maximum}], got range [{low}, {high}]"
        )


def check_real_array(value: object, name: str) -> None:
    """Raise unless ``value`` (an array, as for :func:`check_int_array`) holds real
    numbers: integers or floats, not bools, strings or objects. Values are not checked
    (a log-prob may be ``-inf``). An empty array of any dtype passes."""
    if getattr(value, "size", 0) and _dtype_kind(value) not in ("i", "u", "f"):
        dtype = getattr(value, "dtype", type(value).__name__)
        raise InvalidArgumentError(f"{name} must hold real numbers, got dtype {dtype}")


def check_iterable(value: object, name: str, what: str) -> Iterable[Any]:
    """``value`` if it can be iterated and is not a ``str`` or ``bytes`` (which iterate
    as characters or ints); else raise :class:`InvalidTypeError` ("``name`` must be a
    sequence of ``what``"). A generator passes unconsumed."""
    if not isinstance(value, (str, bytes)):
        try:
            iter(value)  # type: ignore[call-overload]
        except TypeError:
            pass
        else:
            return value  # type: ignore[return-value]
    raise InvalidTypeError(f"{name} must be a sequence of {what}, got {type(value).__name__}")
