"""Same-step prefix sharing: holding back a request whose prefix is being computed now.

A block enters the prefix cache only when its writer commits it, after the model step, so
two requests with one prompt admitted in the same step would both compute it (64
identical 100-token prompts cost 2,272 prefill tokens instead of ~352). The block
manager does not register blocks at allocation (a hitter could read KV that is never
written if the writer is aborted, preempted or commits less); instead
``KVCacheManager.probe_in_flight`` reports, for a waiting sequence, the prompt tokens
right past its cached prefix that another sequence's pending reservation is computing.
The scheduler then holds the request back to the next step, when ``refresh_prefixes``
finds those blocks committed, as SGLang's scheduler does.

The rule (:meth:`PrefixHold.should_hold`), applied at admission:

- only when something else is scheduled this step (a request is never held back
  into an empty step);
- a held request keeps its place in the waiting queue and uses no budget: requests
  after it are admitted as if it were not there (the scheduler stops a step's admission
  after ``max_num_seqs`` holds, so a long queue of copies is not scanned whole);
- holds are bounded: each hold must find the request's cached prefix grown since its
  previous hold, except :attr:`PrefixHold.max_stalls` in a row; otherwise (the writer
  was aborted, preempted or committed less) it is admitted normally.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

__all__ = ["PrefixHold"]


@dataclass
class _Held:
    """A request held back: its cached prefix then, and holds since it last grew."""

    cached: int
    stalls: int = 0


class PrefixHold:
    """Which waiting requests to hold back a step for a prefix computed in this step.

    Requests are tracked by weak reference: one that ends while held (aborted, or
    finished at admission) is forgotten with it.

    Args:
        max_stalls: holds in a row allowed without the request's cached prefix growing.
    """

    def __init__(self, max_stalls: int = 1) -> None:
        self.max_stalls = max_stalls
        self._held: weakref.WeakKeyDictionary[object, _Held] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._held)

    def should_hold(self, request: object, cached: int, in_flight: int) -> bool:
        """Whether to hold ``request`` back this step (and record the hold).

        Args:
            request: the waiting request (hashable, weak-referenceable).
            cached: prompt tokens its cached prefix covers now.
            in_flight: prompt tokens right past that prefix being computed this step by
                another sequence (``KVCacheManager.probe_in_flight``); 0 never holds.
        """
        if in_flight <= 0:
            self._held.pop(request, None)
            return False
        held = self._held.get(request)
        if held is None:
            self._held[request] = _Held(cached)
            return True
        if cached > held.cached:
            held.cached = cached
            held.stalls = 0
            return True
        if held.stalls >= self.max_stalls:
            del self._held[request]
            return False
        held.stalls += 1
        return True

    def release(self, request: object) -> None:
        """Forget ``request`` (admitted, finished or aborted)."""
        self._held.pop(request, None)
