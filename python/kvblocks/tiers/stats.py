"""Counters every tier keeps."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TierStats"]


@dataclass
class TierStats:
    """Counters of one tier since it was opened (a snapshot; tiers hand out copies).

    ``hits``/``misses`` count blocks asked for by ``get_many``; ``rejected`` counts stored
    values that failed validation (short, corrupted, wrong fingerprint, no valid MAC) and
    were read as misses, ``unauthenticated`` those of them that a tier with a MAC key
    rejected for a missing or wrong MAC (a writer without the key); ``puts`` counts blocks
    stored and ``dropped_puts`` blocks a tier could not store (server down, a block larger
    than the whole tier); ``bytes_in``/``bytes_out`` count payload bytes stored and loaded;
    ``evictions`` counts blocks removed to make room or by
    :meth:`~kvblocks.tiers.store.TierStore.evict`; ``errors`` counts failed I/O operations.
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    dropped_puts: int = 0
    rejected: int = 0
    unauthenticated: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0

    def copy(self) -> TierStats:
        """An independent snapshot."""
        return TierStats(**vars(self))
