"""HostTier: a preallocated CPU pool with LRU eviction and retention priorities."""

from __future__ import annotations

import pytest
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers import HostTier, KVLayout, TierStore
from tiers.helpers import block_hash, random_payload


def test_round_trip_is_bit_exact_and_counted(layout: KVLayout) -> None:
    tier = HostTier(layout, 8)
    assert isinstance(tier, TierStore)
    assert tier.is_pinned == torch.cuda.is_available()
    payloads = [random_payload(layout, i) for i in range(5)]
    assert tier.put_many([block_hash(i) for i in range(5)], payloads) == 5
    got = tier.get_many([block_hash(i) for i in (4, 9, 0, 2)])
    assert got[1] is None
    for i, out in zip((4, 0, 2), (got[0], got[2], got[3]), strict=True):
        assert out is not None and torch.equal(out, payloads[i])
    stats = tier.stats()
    assert (stats.puts, stats.hits, stats.misses, stats.evictions) == (5, 3, 1, 0)
    assert stats.bytes_in == 5 * layout.payload_nbytes
    assert stats.bytes_out == 3 * layout.payload_nbytes
    assert len(tier) == 5


def test_results_are_copies_not_views_of_reusable_slots(layout: KVLayout) -> None:
    tier = HostTier(layout, 1)
    first = random_payload(layout, 1)
    tier.put(block_hash(1), first)
    (out,) = tier.get_many([block_hash(1)])
    tier.put(block_hash(2), random_payload(layout, 2))  # reuses the only slot
    assert out is not None and torch.equal(out, first)


def test_full_pool_evicts_least_recently_used(layout: KVLayout) -> None:
    tier = HostTier(layout, 3)
    for i in range(3):
        tier.put(block_hash(i), random_payload(layout, i))
    tier.get_many([block_hash(0)])  # 1 is now the least recently used
    tier.put(block_hash(3), random_payload(layout, 3))
    assert tier.contains_many([block_hash(i) for i in range(4)]) == [True, False, True, True]
    tier.put(block_hash(4), random_payload(layout, 4))  # then 2
    assert tier.contains_many([block_hash(i) for i in range(5)]) == [
        True, False, False, True, True,
    ]  # fmt: skip
    assert tier.stats().evictions == 2
    for i in (0, 3, 4):
        (out,) = tier.get_many([block_hash(i)])
        assert out is not None and torch.equal(out, random_payload(layout, i))


def test_retention_priority_outlives_lower_priorities(layout: KVLayout) -> None:
    tier = HostTier(layout, 2)
    tier.put(block_hash(0), random_payload(layout, 0), priority=10)
    tier.put(block_hash(1), random_payload(layout, 1))
    tier.put(block_hash(2), random_payload(layout, 2))  # evicts 1, not the older 0
    assert tier.contains_many([block_hash(0), block_hash(1), block_hash(2)]) == [True, False, True]


def test_rewrite_keeps_one_slot(layout: KVLayout) -> None:
    tier = HostTier(layout, 2)
    tier.put(block_hash(0), random_payload(layout, 0))
    tier.put(block_hash(0), random_payload(layout, 7))
    assert len(tier) == 1
    (out,) = tier.get_many([block_hash(0)])
    assert out is not None and torch.equal(out, random_payload(layout, 7))


def test_evict_frees_a_slot(layout: KVLayout) -> None:
    tier = HostTier(layout, 1)
    tier.put(block_hash(0), random_payload(layout, 0))
    assert tier.evict(block_hash(0)) and not tier.evict(block_hash(0))
    assert tier.get_many([block_hash(0)]) == [None]
    tier.put(block_hash(1), random_payload(layout, 1))
    assert tier.stats().evictions == 1


def test_bad_input_raises_and_changes_nothing(layout: KVLayout) -> None:
    tier = HostTier(layout, 1)
    tier.put(block_hash(0), random_payload(layout, 0))
    with pytest.raises(InvalidArgumentError):
        tier.put(block_hash(1), torch.zeros(layout.payload_nbytes + 1, dtype=torch.uint8))
    with pytest.raises(TypeError):
        tier.put(123, random_payload(layout, 1))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        tier.put_many([block_hash(1)], [])
    with pytest.raises(InvalidArgumentError):
        HostTier(layout, 0)
    assert tier.contains_many([block_hash(0)]) == [True]
    (out,) = tier.get_many([block_hash(0)])
    assert out is not None and torch.equal(out, random_payload(layout, 0))
    assert tier.stats().puts == 1


def test_bad_priority_or_batch_entry_changes_nothing(layout: KVLayout) -> None:
    """``priority="x"`` raised ValueError, ``None`` TypeError, ``1.5`` or ``101`` were kept
    as priorities; a batch whose second payload was bad stored the first, then raised."""
    tier = HostTier(layout, 2)
    for priority in ["x", None, 1.5, True, -1, 101]:
        with pytest.raises(InvalidArgumentError, match="priority"):
            tier.put(block_hash(0), random_payload(layout, 0), priority=priority)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        tier.put_many([block_hash(0), block_hash(1)], [random_payload(layout, 0), b"short"])
    assert len(tier) == 0 and tier.contains_many([block_hash(0)]) == [False]
    assert tier.stats().puts == 0


def test_a_failed_put_stores_nothing(layout: KVLayout) -> None:
    # A payload without data (a meta tensor) raised NotImplementedError after its hash had
    # taken a slot: the tier then served the slot's old bytes as the block.
    tier = HostTier(layout, 1)
    tier.put(block_hash(0), random_payload(layout, 0))
    meta = torch.zeros(layout.payload_nbytes, dtype=torch.uint8, device="meta")
    with pytest.raises(InvalidArgumentError, match="payload"):
        tier.put(block_hash(1), meta)
    assert tier.contains_many([block_hash(0), block_hash(1)]) == [True, False]
    assert tier.stats().puts == 1


@pytest.mark.parametrize("value", [None, 3, 2.5])
def test_what_is_no_sequence_of_hashes_is_refused(layout: KVLayout, value: object) -> None:
    # A bare TypeError ('float' object is not iterable / has no len()).
    tier = HostTier(layout, 1)
    for call in (tier.get_many, tier.contains_many, lambda v: tier.put_many(v, v)):
        with pytest.raises(InvalidArgumentError):
            call(value)  # type: ignore[operator]
    assert tier.stats().misses == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_blocks": True},
        {"capacity_blocks": 2**45},
        {"capacity_blocks": 2**70},
        {"pin_memory": "no"},
    ],
)
def test_a_pool_that_cannot_be_built_is_refused(layout: KVLayout, kwargs: dict) -> None:
    # True was torch's TypeError, 2**45 slots its allocation RuntimeError, "no" pinned.
    with pytest.raises(InvalidArgumentError):
        HostTier(layout, **{"capacity_blocks": 1, **kwargs})
