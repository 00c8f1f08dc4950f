"""Admission through a remote tier: which requests wait for their reads, and which
preempted sequences are read again before they come back.

A new request is held outside the scheduler while its prompt's blocks past the local hit
are read from the store (:meth:`RemoteTierLink.prefetch`); between two steps the held
requests are handed to the scheduler in arrival order once their read came back (its hits
imported first) or its wait ran out (then they are computed). While other requests run a
read still under way holds its request, and those behind it, for a later step; with
nothing else to run the engine waits for it, up to ``fetch_wait_s``.

A sequence preempted by recompute is tracked while it waits for re-admission: before each
step, one that lost more blocks locally than at its last probe is read again and its hits
imported, so its re-admission loads them instead of recomputing them. Only steps where a
waiting sequence lost blocks pay for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvblocks.scheduler import Request
from kvblocks.tiers.remote_link import RemoteTierLink, TierRead, TokenIds
from kvblocks.tiers.remote_worker import PendingFetch

__all__ = ["Admits", "RemoteAdmission", "SequenceKey", "tier_read"]

SequenceKey = tuple[str, int]
"""A sequence of a request: (request id, completion index)."""


class Admits(Protocol):
    """What admission hands requests to (a :class:`~kvblocks.scheduler.Scheduler`)."""

    def add_request(self, request: Request) -> None:
        """Queue a request."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether anything is queued or running."""
        ...


def tier_read(request: Request, token_ids: TokenIds | None = None) -> TierRead:
    """A read of ``token_ids`` (default the prompt; prompt + generated tokens for a
    preempted sequence) in ``request``'s namespace, kept at its retention priority."""
    tokens = request.prompt_token_ids if token_ids is None else token_ids
    return TierRead(tokens, request.cache_salt, request.lora_id, request.retention_priority)


@dataclass(frozen=True)
class _Held:
    request: Request
    fetch: PendingFetch | None
    deadline: float


@dataclass(frozen=True)
class _Preempted:
    read: TierRead
    missing: int | None  # blocks missing locally at the last probe (None: not probed yet)


class RemoteAdmission:
    """The held requests and tracked preempted sequences of one engine's remote tier.

    Every call is made between two steps, on the step thread.
    """

    def __init__(self, link: RemoteTierLink) -> None:
        self.link = link
        self._held: deque[_Held] = deque()
        self._preempted: dict[SequenceKey, _Preempted] = {}

    # -- new requests --------------------------------------------------------------------
    def hold(self, request: Request) -> None:
        """Start reading the request's blocks and hold it until :meth:`release` lets it go."""
        fetch = self.link.prefetch(tier_read(request))
        deadline = time.monotonic() + self.link.options.fetch_wait_s
        self._held.append(_Held(request, fetch, deadline))

    def release(self, scheduler: Admits) -> None:
        """Hand held requests to ``scheduler``, in arrival order, once their read came back
        (its hits imported first) or its wait ran out; see the module docstring."""
        while self._held:
            held = self._held[0]
            fetch = held.fetch
            if fetch is not None and not fetch.done():
                busy = scheduler.has_unfinished_requests()
                wait = 0.0 if busy else held.deadline - time.monotonic()
                if not fetch.wait(wait) and time.monotonic() < held.deadline:
                    return
            if fetch is not None:
                self.link.complete(fetch)
            self._held.popleft()
            scheduler.add_request(held.request)

    def withdraw(self, request_id: str) -> Request | None:
        """Stop holding a request (aborted before its read came back); None when it is not
        held. Its read, if still under way, is left to finish and is never imported."""
        for i, held in enumerate(self._held):
            if held.request.request_id == request_id:
                del self._held[i]
                return held.request
        return None

    # -- preempted sequences -------------------------------------------------------------
    def track(self, waiting: Iterable[tuple[SequenceKey, TierRead]]) -> None:
        """Start tracking sequences a step preempted by recompute (each read: prompt and
        generated tokens); sequences already tracked keep their last probe."""
        for key, read in waiting:
            if key not in self._preempted:
                self._preempted[key] = _Preempted(read, None)

    def is_tracked(self, key: SequenceKey) -> bool:
        """Whether a preempted sequence is tracked."""
        return key in self._preempted

    def refetch(self, still_waiting: Callable[[str], bool]) -> None:
        """Read again the tracked sequences that lost blocks since their last probe and
        import what the store has; forget those no longer waiting (re-admitted, ended)."""
        if not self._preempted:
            return
        link = self.link
        probe: list[SequenceKey] = []
        for key, seq in list(self._preempted.items()):
            if not still_waiting(key[0]):
                del self._preempted[key]  # re-admitted (or gone): nothing more to do
                continue
            missing = len(link.missing(seq.read))
            if missing and (seq.missing is None or missing > seq.missing):
                probe.append(key)
            self._preempted[key] = _Preempted(seq.read, missing)
        if probe:
            link.refetch([self._preempted[key].read for key in probe])
            for key in probe:
                read = self._preempted[key].read
                self._preempted[key] = _Preempted(read, len(link.missing(read)))

    # -- lifetime ------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every held request and tracked sequence (the end of a call)."""
        self._held.clear()
        self._preempted.clear()
