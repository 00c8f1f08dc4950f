"""Errors of the tier layer.

A tier never raises these at a caller on a read: a value that fails validation is counted in
:attr:`~kvblocks.tiers.stats.TierStats.rejected` and read as a miss. They surface from the
codec (:func:`kvblocks.tiers.codec.decode_block`) for code that decodes values itself.
"""

from __future__ import annotations

from kvblocks.errors import KVBlocksError

__all__ = ["CorruptBlockError", "UnauthenticatedBlockError"]


class CorruptBlockError(KVBlocksError):
    """A stored block value is short, corrupted, or made for another layout or block."""


class UnauthenticatedBlockError(CorruptBlockError):
    """A tier with a key read a record without a valid MAC: not written by a key holder
    (counted in :attr:`~kvblocks.tiers.stats.TierStats.unauthenticated`)."""
