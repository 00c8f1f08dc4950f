"""What contiguous per-request KV reservation would hold (the pre-paging baseline).

Servers before paged attention reserved one contiguous KV buffer per sequence, sized for
``prompt + max_tokens`` because the final length is unknown, and could share nothing
between sequences. Paging allocates blocks as tokens arrive and shares prefix and forked
blocks; comparing the two for the same running batch shows the memory paging saves.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvblocks.simulate.workload import SimRequest

__all__ = ["ContiguousReservation"]


class ContiguousReservation:
    """Reservation of a batch under contiguous allocation, in blocks of ``block_size``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def tokens_for(self, requests: Iterable[SimRequest]) -> int:
        """Tokens reserved: ``n * (prompt + declared max_tokens)`` per request."""
        return sum(r.n * (len(r.prompt_token_ids) + r.declared_max_tokens) for r in requests)

    def blocks_for(self, requests: Iterable[SimRequest]) -> float:
        """The same, expressed in blocks (for comparison with the paged pool)."""
        return self.tokens_for(requests) / self.block_size
