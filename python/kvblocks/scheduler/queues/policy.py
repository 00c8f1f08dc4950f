"""Admission policies (fcfs, priority, lpm) and the waiting queue they order.

Every request has a *key*, a tuple that orders requests by importance (smallest first):
``(0, arrival, counter)`` for fcfs and lpm, ``(priority, arrival, counter)`` for priority.
The same key orders the running requests, so preemption always picks the least
important one. lpm only changes the *admission* order: waiting requests are admitted
longest cached prefix first (ties by key), as SGLang's cache-aware scheduling does; the
cached prefix of every waiting request comes from one batch ``refresh_prefixes`` call
to the block manager.

The waiting queue orders by :attr:`Keyed.queue_key`: the key, except that requests
that waited too long (overdue, see :mod:`~kvblocks.scheduler.queues.wait_bound`) come
first, by arrival, under every policy.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import chain
from typing import Any, Protocol

import numpy as np

from kvblocks.protocols import BlockManager

__all__ = ["Key", "Keyed", "QueueKey", "SchedulingPolicy", "WaitingQueue", "make_policy"]

Key = tuple[int, float, int]
"""A request's importance: ``(priority, arrival, counter)``, smallest first."""

QueueKey = tuple[int, int, float, int]
"""The waiting queue's order: ``(0, 0, arrival, counter)`` for an overdue request, else
``(1, *key)``."""


class Keyed(Protocol):
    """What the waiting queue needs from a request state."""

    key: Key
    seq_ids: list[int]

    @property
    def queue_key(self) -> QueueKey: ...


class SchedulingPolicy:
    """fcfs: admit in arrival order."""

    name = "fcfs"
    #: Whether waiting sequences stay registered with the block manager (lpm ranks them
    #: by the cached prefix the manager probes for each); otherwise a waiting request is
    #: registered only when it is tried for admission.
    probes_waiting = False

    def key(self, priority: int, arrival: float, counter: int) -> Key:
        """The ordering key of a request (smaller is more important)."""
        return (0, arrival, counter)

    def admission_order(self, queue: WaitingQueue, manager: BlockManager) -> Iterator[Any]:
        """Waiting requests in the order to try admitting them."""
        return iter(list(queue.items()))


class PriorityPolicy(SchedulingPolicy):
    """priority: smaller ``Request.priority`` first, then arrival."""

    name = "priority"

    def key(self, priority: int, arrival: float, counter: int) -> Key:
        """The ordering key of a request (smaller is more important)."""
        return (priority, arrival, counter)


class LongestPrefixMatchPolicy(SchedulingPolicy):
    """lpm: longest cached prefix first, then arrival (cache-aware, like SGLang)."""

    name = "lpm"
    probes_waiting = True

    def admission_order(self, queue: WaitingQueue, manager: BlockManager) -> Iterator[Any]:
        """Order by the cached prefix each request would claim now (one batch refresh).

        ``refresh_prefixes`` re-probes every waiting sequence against the cache as it is
        now, so prefixes cached while a request waited count (a plain probe stays capped
        at what was cached when the request was added); nothing is claimed.
        """
        items = list(queue.items())  # the caller removes admitted items from the live list
        if len(items) <= 1:
            return iter(items)
        cached = np.asarray(manager.refresh_prefixes(queue.seq_ids()), dtype=np.int64)
        # Overdue requests keep their place in front (arrival order); the others are
        # already key-sorted, so a stable sort on -cached keeps key order on ties.
        first = queue.num_overdue()
        order = np.argsort(-cached[first:], kind="stable") + first
        return chain(items[:first], (items[i] for i in order.tolist()))


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called ``name`` (``"fcfs"``, ``"priority"`` or ``"lpm"``)."""
    policies: dict[str, type[SchedulingPolicy]] = {
        "fcfs": SchedulingPolicy,
        "priority": PriorityPolicy,
        "lpm": LongestPrefixMatchPolicy,
    }
    return policies[name]()


class WaitingQueue:
    """Requests waiting for admission, kept sorted by :attr:`Keyed.queue_key`.

    Preempted (recomputed) requests go back with their original key, so they are
    re-admitted before requests that arrived after them.
    """

    def __init__(self) -> None:
        self._keys: list[QueueKey] = []
        self._items: list[Any] = []
        self._seq_ids: list[int] = []  # first sequence of each item, for batch probes

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def push(self, item: Keyed) -> None:
        """Insert ``item`` at its key's place."""
        key = item.queue_key
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._items.insert(index, item)
        self._seq_ids.insert(index, item.seq_ids[0])

    def remove(self, item: Keyed) -> None:
        """Remove ``item`` (it must be queued, with the queue key it was pushed with)."""
        index = bisect.bisect_left(self._keys, item.queue_key)
        while self._items[index] is not item:
            index += 1
        del self._keys[index]
        del self._items[index]
        del self._seq_ids[index]

    def num_overdue(self) -> int:
        """Overdue requests (they are the first ones)."""
        return bisect.bisect_left(self._keys, (1,))

    def items(self) -> list[Any]:
        """The queued requests, key order (the live list; do not mutate)."""
        return self._items

    def seq_ids(self) -> np.ndarray:
        """The first sequence id of every queued request, key order (int64)."""
        return np.array(self._seq_ids, dtype=np.int64)
