"""The scheduler's request registry (:class:`RequestRegistry`).

Unfinished requests by id, the request that owns each sequence id, the sequence-id
allocator (ids of finished requests are reused, last freed first), the arrival counter
that breaks key ties, and what every step needs to know about the set of requests: the
union of their stop tokens, whether any has ``min_tokens``, and the requests that
finished since the previous step.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvblocks.scheduler.request_state import RequestState

__all__ = ["RequestRegistry"]


class RequestRegistry:
    """Unfinished requests and the owners of their sequence ids."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        #: The request (or part of a split request) each live sequence id belongs to.
        self.owner: dict[int, RequestState] = {}
        self._next_seq_id = 0
        self._free_seq_ids: list[int] = []
        self._counter = 0
        #: Unfinished requests with ``min_tokens > 0``: only then do steps scan their rows.
        self.num_min_tokens = 0
        #: Every stop token of a request added so far (sorted), for the vectorised check.
        self.stop_tokens: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._finished_ids: list[str] = []
        self._shared = False  # ``requests`` was handed out by snapshot(): copy on change

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, request_id: str) -> RequestState | None:
        """The unfinished request ``request_id``, or ``None``."""
        return self.requests.get(request_id)

    def next_counter(self) -> int:
        """The arrival counter the next added request gets."""
        return self._counter

    def snapshot(self) -> dict[str, RequestState]:
        """The unfinished requests now, as a mapping later changes do not affect (it is
        copied at the next change, not now: most steps add and finish nothing)."""
        self._shared = True
        return self.requests

    def _own(self) -> None:
        if self._shared:
            self.requests = dict(self.requests)
            self._shared = False

    def new_seq_id(self) -> int:
        """A sequence id no live sequence has (the last one given back, else a new one)."""
        if self._free_seq_ids:
            return self._free_seq_ids.pop()
        seq = self._next_seq_id
        self._next_seq_id += 1
        return seq

    def give_back(self, seq: int) -> None:
        """Return an id :meth:`new_seq_id` gave that was never used."""
        self._free_seq_ids.append(seq)

    def add(self, state: RequestState) -> None:
        """Register a new request (its first sequence id included)."""
        self._counter += 1
        self._own()
        self.requests[state.request.request_id] = state
        self.owner[state.seq_ids[0]] = state
        if state.params.min_tokens > 0:
            self.num_min_tokens += 1
        if state.stop_set:
            union = set(self.stop_tokens.tolist()) | set(state.stop_set)
            self.stop_tokens = np.array(sorted(union), dtype=np.int64)

    def adopt(self, state: RequestState, seq: int, index: int) -> None:
        """``seq`` (a fork) joins ``state`` as its completion ``index``."""
        state.all_seq_ids.append(seq)
        state.seq_index[seq] = index
        self.owner[seq] = state

    def disown_forks(self, state: RequestState, keep: int) -> None:
        """Give back every sequence id of ``state`` but ``keep`` (a beam search restarts
        from its prompt's sequence)."""
        for seq in state.all_seq_ids:
            if seq != keep and self.owner.get(seq) is state:
                del self.owner[seq]
                self._free_seq_ids.append(seq)

    def forget(self, state: RequestState) -> None:
        """``state`` ended: drop it and give back its sequence ids; a request (not a
        part) is reported in the next step's ``finished_request_ids``."""
        rid = state.request.request_id
        if self.requests.get(rid) is state:
            self._own()
            del self.requests[rid]
            if state.params.min_tokens > 0:
                self.num_min_tokens -= 1
        for seq in state.all_seq_ids:
            if self.owner.get(seq) is state:
                del self.owner[seq]
                self._free_seq_ids.append(seq)
        state.all_seq_ids = []
        if state.parent is None:
            self._finished_ids.append(rid)

    def take_finished_ids(self) -> list[str]:
        """The requests that ended since the last call, in the order they ended."""
        ids, self._finished_ids = self._finished_ids, []
        return ids
