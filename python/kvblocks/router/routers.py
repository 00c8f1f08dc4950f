"""Routers: pick the instance that serves a request.

All three see the same per-instance load (:class:`InstanceLoad`); only
:class:`CacheAwareRouter` also sees the prefix index. The cache-aware cost of sending a
request of ``P`` prompt blocks to instance ``i`` (after NVIDIA Dynamo's KV router) is

    ``cost_i = prefill_weight * (P - overlap_i + queued_prefill_blocks_i) + active_blocks_i``

where ``overlap_i`` is the prompt's leading blocks instance ``i`` holds, at most ``P - 1``
(a claim never covers the prompt's last token, so the last block of a block-aligned
prompt is computed even where it is cached), counted per tier (a block in a lower tier
``m`` credits ``tier_credit[m]`` of a block, since it must be loaded, not recomputed),
``queued_prefill_blocks_i`` the prompt blocks the instance still has to compute for
requests it has queued, and ``active_blocks_i`` the KV blocks its running requests hold
(what decode steps read). The lowest cost wins; ties go to the tied
instance after the last one picked (round-robin among equals), so an empty fleet spreads
requests instead of piling them on instance 0. :class:`LeastLoadedRouter` uses the same
cost with ``overlap_i = 0``, so the comparison isolates the cache credit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvblocks.errors import InvalidArgumentError
from kvblocks.router.events import DEFAULT_MEDIUM, BlockHash, EventRecord
from kvblocks.router.index import PrefixIndex
from kvblocks.validation import check_block_hashes, check_int, check_number

__all__ = [
    "ROUTERS",
    "CacheAwareRouter",
    "InstanceLoad",
    "LeastLoadedRouter",
    "RoundRobinRouter",
    "Router",
    "make_router",
]


@dataclass(frozen=True)
class InstanceLoad:
    """What a router knows about an instance's load.

    Attributes:
        active_blocks: KV blocks held by its running requests.
        queued_prefill_blocks: prompt blocks still to compute for its queued requests.
    """

    active_blocks: int = 0
    queued_prefill_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("active_blocks", "queued_prefill_blocks"):
            value = getattr(self, name)
            # A NaN load would make every cost NaN and no instance the cheapest.
            check_number(value, name, minimum=0)


MAX_INSTANCES = 1 << 20
"""Instances one router can hold (it keeps a load entry per instance)."""


class Router:
    """Base class: ``num_instances`` instances ``0..N-1``, a load table, and :meth:`route`.

    Args:
        num_instances: instances behind the router (``>= 1``).
    """

    name = "router"
    uses_prefix = False
    """Whether :meth:`route` reads the prompt's block hashes (callers may pass ``()``
    to a router that does not, and skip hashing)."""

    def __init__(self, num_instances: int) -> None:
        self.num_instances = check_int(
            num_instances, "num_instances", minimum=1, maximum=MAX_INSTANCES
        )
        self.loads = [InstanceLoad() for _ in range(num_instances)]

    def set_load(self, instance: int, load: InstanceLoad) -> None:
        """Record ``instance``'s current load."""
        self._check(instance)
        if not isinstance(load, InstanceLoad):
            raise InvalidArgumentError(f"load must be an InstanceLoad, got {type(load).__name__}")
        self.loads[instance] = load

    def apply_events(self, records: Sequence[EventRecord]) -> None:
        """Take KV event records (ignored by routers without an index)."""

    def overlaps(self, block_hashes: Sequence[BlockHash]) -> list[float]:
        """Credited cached prompt blocks per instance (zero for routers without an index)."""
        return [0.0] * self.num_instances

    def route(self, block_hashes: Sequence[BlockHash], num_prompt_blocks: int) -> int:
        """The instance for a request whose prompt has ``num_prompt_blocks`` blocks
        (partial last block included) and these full-block hashes."""
        raise NotImplementedError

    def _check(self, instance: int) -> None:
        check_int(
            instance,
            "instance",
            minimum=0,
            maximum=self.num_instances - 1,
            expected=f"in [0, {self.num_instances})",
        )

    @staticmethod
    def _check_request(block_hashes: Sequence[BlockHash], num_prompt_blocks: int) -> None:
        """Raise unless ``route``'s arguments describe a prompt: a count of blocks, and at
        most that many full-block hashes (ints or bytes)."""
        check_int(num_prompt_blocks, "num_prompt_blocks", minimum=0)
        if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
            raise InvalidArgumentError(
                f"block_hashes must be a sequence of block hashes, got "
                f"{type(block_hashes).__name__}"
            )
        if len(block_hashes) > num_prompt_blocks:
            raise InvalidArgumentError(
                f"{len(block_hashes)} block hashes for a prompt of {num_prompt_blocks} blocks"
            )
        check_block_hashes(block_hashes, "block_hashes", numpy=True)


class RoundRobinRouter(Router):
    """Instances in turn, blind to load and cache."""

    name = "round-robin"

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self._next = 0

    def route(self, block_hashes: Sequence[BlockHash], num_prompt_blocks: int) -> int:
        """The next instance in turn."""
        self._check_request(block_hashes, num_prompt_blocks)
        chosen = self._next
        self._next = (self._next + 1) % self.num_instances
        return chosen


class _CostRouter(Router):
    """Lowest :meth:`costs` wins; ties rotate."""

    default_prefill_weight = 1.0

    def __init__(self, num_instances: int, prefill_weight: float | None = None) -> None:
        super().__init__(num_instances)
        if prefill_weight is None:
            prefill_weight = self.default_prefill_weight
        # inf * 0 blocks is NaN: an infinite weight makes no instance the cheapest.
        check_number(prefill_weight, "prefill_weight", minimum=0)
        self.prefill_weight = prefill_weight
        self._last = -1

    def costs(self, block_hashes: Sequence[BlockHash], num_prompt_blocks: int) -> list[float]:
        """Each instance's cost for this request (see the module docstring)."""
        # A claim never covers the prompt's last token: of a block-aligned prompt, the
        # last full block is computed even where it is cached.
        credit = self.overlaps(block_hashes[: max(num_prompt_blocks - 1, 0)])
        w = self.prefill_weight
        return [
            w * (num_prompt_blocks - credit[i] + load.queued_prefill_blocks) + load.active_blocks
            for i, load in enumerate(self.loads)
        ]

    def route(self, block_hashes: Sequence[BlockHash], num_prompt_blocks: int) -> int:
        """The lowest-cost instance (ties: the first after the last one picked)."""
        self._check_request(block_hashes, num_prompt_blocks)
        costs = self.costs(block_hashes, num_prompt_blocks)
        best = min(costs)
        n = self.num_instances
        for k in range(1, n + 1):
            i = (self._last + k) % n
            if costs[i] == best:
                self._last = i
                return i
        raise AssertionError("unreachable")  # pragma: no cover


class LeastLoadedRouter(_CostRouter):
    """Lowest ``prefill_weight * queued_prefill_blocks + active_blocks``, blind to the cache."""

    name = "least-loaded"


class CacheAwareRouter(_CostRouter):
    """Lowest cost with the prefix overlap credited (see the module docstring).

    Args:
        num_instances: instances behind the router.
        prefill_weight: weight of prompt blocks to compute against blocks held.
        tier_credit: fraction of a block credited for a hit in each tier; the GPU tier
            (``"GPU"``) is 1 unless given, tiers not listed 0.5.
        index: the prefix index to read (a fresh one by default).
    """

    name = "cache-aware"
    uses_prefix = True
    default_prefill_weight = 8.0

    def __init__(
        self,
        num_instances: int,
        prefill_weight: float | None = None,
        tier_credit: Mapping[str, float] | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        super().__init__(num_instances, prefill_weight)
        if tier_credit is not None and not isinstance(tier_credit, Mapping):
            raise InvalidArgumentError(
                f"tier_credit must be a mapping of tier name to credit, got "
                f"{type(tier_credit).__name__}"
            )
        for medium, credit in (tier_credit or {}).items():
            if not isinstance(medium, str) or not _is_fraction(credit):
                raise InvalidArgumentError(
                    f"tier_credit must map tier names to a fraction in [0, 1], got "
                    f"{medium!r}: {credit!r}"
                )
        if index is not None and not isinstance(index, PrefixIndex):
            raise InvalidArgumentError(
                f"index must be a PrefixIndex or None, got {type(index).__name__}"
            )
        self.tier_credit = {DEFAULT_MEDIUM: 1.0, **(tier_credit or {})}
        self.lower_tier_credit = 0.5
        self.index = index if index is not None else PrefixIndex()

    def apply_events(self, records: Sequence[EventRecord]) -> None:
        """Feed the prefix index."""
        self.index.apply_all(records)

    def overlaps(self, block_hashes: Sequence[BlockHash]) -> list[float]:
        """Credited prompt blocks per instance: each leading block held counts the credit
        of the best tier holding it; the match ends at the first block held in no tier.
        Every hash given is counted: for the hit an instance serves, give the blocks
        before the prompt's last token (:meth:`costs` does)."""
        credit = [0.0] * self.num_instances
        for inst, c in self.index.credited_overlaps(block_hashes, self._credit).items():
            if isinstance(inst, int) and 0 <= inst < self.num_instances:
                credit[inst] = c
        return credit

    def _credit(self, medium: str) -> float:
        return self.tier_credit.get(medium, self.lower_tier_credit)


ROUTERS: dict[str, type[Router]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    LeastLoadedRouter.name: LeastLoadedRouter,
    CacheAwareRouter.name: CacheAwareRouter,
}
"""Router classes by their CLI name."""


def make_router(name: str, num_instances: int) -> Router:
    """A router by its CLI name (``round-robin``, ``least-loaded``, ``cache-aware``).

    Raises:
        InvalidArgumentError: unknown name or ``num_instances < 1``.
    """
    cls = ROUTERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgumentError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return cls(num_instances)


def _is_fraction(value: object) -> bool:
    try:
        check_number(value, "credit", minimum=0, maximum=1)
    except InvalidArgumentError:
        return False
    return True
