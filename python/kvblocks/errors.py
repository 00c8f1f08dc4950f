"""The kvblocks exception hierarchy.

Every error kvblocks raises on bad input or a bad state is a subclass of
:class:`KVBlocksError`, so an engine can catch one type. The classes live in pure
Python (not in the compiled core) so that the ops front-ends and the scheduler can
raise them without the extension, and the Rust core maps each of its error kinds onto
exactly one of them. A call that raises leaves the manager exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "DuplicateSequenceError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "InvariantViolationError",
    "KVBlocksError",
    "OutOfBlocksError",
    "SequenceStateError",
    "UnknownSequenceError",
]


class KVBlocksError(Exception):
    """Base class of every error raised by kvblocks."""


class InvalidArgumentError(KVBlocksError, ValueError):
    """An argument has the wrong value, shape, dtype or device.

    Also a :class:`ValueError`, so code that already catches ``ValueError`` keeps working.
    """


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (not a bytes, not a layout, not an event record).

    Also a :class:`TypeError` (and, as an :class:`InvalidArgumentError`, a
    :class:`ValueError`), so code that catches the built-in type Python raises for a
    wrong type keeps working.
    """


class OutOfBlocksError(KVBlocksError):
    """A pool has too few free blocks for an operation that cannot wait (swap in/out)."""


class UnknownSequenceError(KVBlocksError, KeyError):
    """A sequence id that the manager does not hold. Also a :class:`KeyError`."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(KVBlocksError):
    """A sequence id that the manager already holds was added again."""


class SequenceStateError(KVBlocksError):
    """The sequence is in a state that does not allow the operation.

    For example: any operation but ``swap_in``, ``free`` and read-only queries on a
    swapped-out sequence, or ``fork`` of a sequence with allocated but uncommitted slots.
    """


class InvariantViolationError(KVBlocksError):
    """``check_invariants`` found a broken internal invariant (a bug in kvblocks)."""
