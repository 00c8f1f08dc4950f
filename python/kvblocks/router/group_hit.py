"""The prefix-cache hit rule of an instance with KV cache groups, as the router sees it.

An instance serves a hit of ``k`` blocks (its next query at position ``k * block_size``)
when every group has cached every block that query sees (``docs/hybrid-groups.md``, "The
prefix-cache hit rule"): full attention every block of the prefix, a window of ``W`` the
blocks of the last ``W - 1`` tokens, a chunked group the current chunk's, a recurrent
state group the state at the hit boundary (its block ``k - 1``). The longest ``k`` every
group serves is found as the core finds it (``manager::hit``): full-attention groups cut
the candidate to their leading run, then each other group lowers it to the longest length
at or below it that it serves, until none lowers it.

The router learns a group's rule from its ``BlockStored`` events (vLLM 0.33's
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``) or from
:meth:`PrefixIndex.set_group_specs <kvblocks.router.index.PrefixIndex.set_group_specs>`.
The events name no chunk size and no checkpoint interval: a chunked group learned from
events alone is taken as full attention (it may under-report, never over-report, the hit),
and a recurrent group serves ``k`` when block ``k - 1``'s state is cached (the instance
caches only checkpoint states, so this is its own rule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvblocks.errors import InvalidArgumentError

__all__ = ["GroupRule", "longest_hit", "needed_groups"]

_KINDS = ("full_attention", "sliding_window", "chunked_local_attention", "mamba")


@dataclass(frozen=True)
class GroupRule:
    """What one KV cache group needs cached to serve a hit.

    Attributes:
        kind: vLLM's ``kv_cache_spec_kind``: ``"full_attention"``, ``"sliding_window"``,
            ``"chunked_local_attention"`` or ``"mamba"`` (recurrent state).
        window: the sliding window in tokens (``"sliding_window"`` only).
        chunk: the chunk size in tokens (``"chunked_local_attention"``; ``None``: unknown,
            served like full attention).
        checkpoint_every_blocks: blocks between a recurrent group's cached states
            (``None``: unknown, any cached state block ends a hit).
    """

    kind: str = "full_attention"
    window: int | None = None
    chunk: int | None = None
    checkpoint_every_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidArgumentError(f"unknown KV cache spec kind {self.kind!r}")
        if self.kind == "sliding_window" and (self.window is None or self.window < 1):
            raise InvalidArgumentError(
                f"a sliding-window group needs a window >= 1, got {self.window}"
            )
        for name in ("chunk", "checkpoint_every_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {value}")

    @property
    def is_full(self) -> bool:
        """Needs every block of the prefix (downward closed: one leading scan)."""
        return self.kind == "full_attention" or (
            self.kind == "chunked_local_attention" and self.chunk is None
        )

    def first_needed(self, k: int, block_size: int) -> int:
        """The first block a hit of ``k`` blocks needs (attention groups)."""
        pos = k * block_size
        if self.kind == "sliding_window":
            assert self.window is not None
            first = max(0, pos + 1 - self.window)
        elif self.kind == "chunked_local_attention" and self.chunk is not None:
            first = pos // self.chunk * self.chunk
        else:
            first = 0
        return min(first // block_size, k)


def _bound(held: Callable[[int, int], bool], group: int) -> Callable[[int], bool]:
    return lambda i: held(group, i)


def _leading(has: Callable[[int], bool], k: int) -> int:
    i = 0
    while i < k and has(i):
        i += 1
    return i


def _served(rule: GroupRule, has: Callable[[int], bool], k: int, block_size: int) -> int:
    """The longest hit ``<= k`` one non-full group serves on its own."""
    if rule.kind == "mamba":
        step = rule.checkpoint_every_blocks or 1
        k -= k % step
        while k > 0 and not has(k - 1):
            k -= step
        return k
    while True:
        for i in range(k - 1, rule.first_needed(k, block_size) - 1, -1):
            if not has(i):
                k = i  # every length above i needs block i
                break
        else:
            return k


def longest_hit(
    rules: Mapping[int, GroupRule],
    held: Callable[[int, int], bool],
    cap: int,
    block_size: int,
) -> int:
    """The longest hit ``<= cap`` blocks every group in ``rules`` serves.

    ``held(group, i)``: the group has block ``i`` of the prompt cached.
    """
    k = cap
    order: Sequence[int] = sorted(rules)
    for g in order:
        if rules[g].is_full:
            k = _leading(_bound(held, g), k)
    partial = [g for g in order if not rules[g].is_full]
    while partial:
        before = k
        for g in partial:
            k = _served(rules[g], _bound(held, g), k, block_size)
        if k == before:
            break
    return k


def needed_groups(
    rules: Mapping[int, GroupRule], k: int, block_size: int
) -> list[tuple[int, range]]:
    """Each group and the blocks a hit of ``k`` claims in it (a recurrent group's state
    block only)."""
    out = []
    for g in sorted(rules):
        rule = rules[g]
        if rule.kind == "mamba":
            out.append((g, range(k - 1, k) if k else range(0)))
        else:
            out.append((g, range(rule.first_needed(k, block_size), k)))
    return out
