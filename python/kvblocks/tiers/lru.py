"""LRU order with a retention priority, shared by the host and disk tiers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["RetentionLRU"]

V = TypeVar("V")


class RetentionLRU(Generic[V]):
    """Keys in least-recently-used order within each retention priority.

    :meth:`victim` names the least recently used key of the lowest priority present, so a
    block put with a higher priority outlives every lower-priority block (TensorRT-LLM's
    retention priorities), and blocks of equal priority leave in LRU order.
    """

    def __init__(self) -> None:
        self._by_priority: dict[int, OrderedDict[bytes, V]] = {}
        self._priority: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, key: object) -> bool:
        return key in self._priority

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._priority)

    def get(self, key: bytes) -> V | None:
        """The value of ``key`` without touching its recency."""
        priority = self._priority.get(key)
        return None if priority is None else self._by_priority[priority][key]

    def touch(self, key: bytes) -> V | None:
        """Mark ``key`` most recently used; its value, or None if absent."""
        priority = self._priority.get(key)
        if priority is None:
            return None
        bucket = self._by_priority[priority]
        bucket.move_to_end(key)
        return bucket[key]

    def insert(self, key: bytes, value: V, priority: int = 0) -> None:
        """Add or replace ``key`` as the most recently used of ``priority``."""
        self.remove(key)
        self._by_priority.setdefault(priority, OrderedDict())[key] = value
        self._priority[key] = priority

    def remove(self, key: bytes) -> V | None:
        """Drop ``key``; its value, or None if absent."""
        priority = self._priority.pop(key, None)
        if priority is None:
            return None
        bucket = self._by_priority[priority]
        value = bucket.pop(key)
        if not bucket:
            del self._by_priority[priority]
        return value

    def victim(self, exclude: bytes | None = None) -> bytes | None:
        """The key to evict next (never ``exclude``), or None when there is none."""
        for priority in sorted(self._by_priority):
            for key in self._by_priority[priority]:
                if key != exclude:
                    return key
        return None
