"""The host tier through the Python API: construction, the ordered op list, pins until
``confirm_memory_ops``, the reported hits, stats and events, and hostile inputs.

The content of what the ops move is judged by the content oracle
(``test_content_oracle_host_tier.py``, ``TieredContentOracle``); these tests pin the API.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvblocks
from kvblocks import KVCacheManager

from .core_state import snapshot


def tiered(num_blocks: int = 5, host: int = 8, policy: str = "evict") -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, watermark=0.0, host_cache_blocks=host, host_offload=policy)


def prefill(m: KVCacheManager, sid: int, tokens: list[int]) -> None:
    m.add_sequence(sid, tokens)
    new = len(tokens) - m.num_computed_tokens(sid)
    assert m.allocate_slots(sid, new) is not None
    m.commit(sid, new)


def evict_then_hit(m: KVCacheManager) -> list[int]:
    """Cache a 12-token prompt, evict it to the tier (a 16-token prompt fills the pool),
    confirm the offloads and add the prompt again; return it."""
    prompt = list(range(12))
    prefill(m, 1, prompt)
    m.free(1)
    prefill(m, 2, list(range(100, 116)))
    m.free(2)
    ops = m.take_memory_ops()
    assert [kind for kind, _ in ops] == ["offload"]
    m.confirm_memory_ops()
    return prompt


def test_defaults_and_properties() -> None:
    m = KVCacheManager(8, 4)
    assert (m.host_cache_blocks, m.host_offload) == (0, "evict")
    assert "host_hits" not in m.stats()
    assert m.take_memory_ops() == []
    m.confirm_memory_ops()  # a no-op without a tier
    t = tiered(policy="commit")
    assert (t.host_cache_blocks, t.host_offload) == (8, "commit")
    assert t.stats()["host_cache_blocks"] == 8


def test_a_hit_in_the_tier_is_reported_then_loaded() -> None:
    m = tiered()
    prompt = evict_then_hit(m)
    # Two whole blocks hit (never the whole prompt), both in the tier.
    assert m.add_sequence(3, prompt) == 8
    assert m.num_tier_tokens(3) == 8
    assert m.num_tier_loads(3) == 2  # one group: one load per tier block
    assert m.num_cached_tokens(3) == 8
    assert m.refresh_prefixes([3]).tolist() == [8]
    assert m.can_allocate(3) == kvblocks.AllocStatus.OK
    got = m.allocate_slots(3, 4)
    assert got is not None and len(got) == 1  # loaded blocks belong to the claimed prefix
    ops = m.take_memory_ops()
    loads = np.concatenate([pairs for kind, pairs in ops if kind == "load"])
    assert loads.shape == (2, 2) and loads.dtype == np.int64
    assert loads[:, 1].tolist() == m.block_table(3)[:2].tolist()
    s = m.stats()
    assert (s["host_hits"], s["host_loads"], s["prefix_cache_hits"]) == (8, 2, 0)
    assert s["num_host_pinned_blocks"] >= 2
    m.confirm_memory_ops()
    assert m.stats()["num_host_pinned_blocks"] == 0
    m.check_invariants()


def test_an_unconfirmed_offload_is_no_hit() -> None:
    m = tiered()
    prefill(m, 1, list(range(12)))
    m.free(1)
    prefill(m, 2, list(range(100, 116)))
    m.free(2)
    m.take_memory_ops()
    # Taken but not confirmed: the slots may still be being written.
    assert m.add_sequence(3, list(range(12))) == 0
    m.confirm_memory_ops()
    assert m.refresh_prefixes([3]).tolist() == [8]


def test_events_carry_the_medium() -> None:
    m = tiered()
    evict_then_hit(m)
    media = {(type(e).__name__, e.medium) for e in m.take_events()}
    assert media == {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU")}
    m = tiered(policy="commit")
    prefill(m, 1, list(range(8)))
    # Queued, not written: announced by the confirmation that makes them hits.
    assert [e.medium for e in m.take_events()] == ["GPU"]
    assert [kind for kind, _ in m.take_memory_ops()] == ["offload"]
    m.confirm_memory_ops()
    stored = [e for e in m.take_events() if e.medium == "CPU"]
    # Write-through knows the tokens: full events.
    assert [e.token_ids for e in stored] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_copy_drain_refuses_while_tier_ops_are_queued() -> None:
    m = tiered()
    prefill(m, 1, list(range(12)))
    m.free(1)
    prefill(m, 2, list(range(100, 116)))
    before = snapshot(m)
    with pytest.raises(kvblocks.SequenceStateError, match="take_memory_ops"):
        m.take_copy_on_writes()
    assert snapshot(m) == before
    assert [kind for kind, _ in m.take_memory_ops()] == ["offload"]
    assert m.take_copy_on_writes().shape == (0, 2)


def test_one_journal_with_or_without_a_tier() -> None:
    """Swaps and copies are journaled alike with and without a tier; the copy view works
    on both while no offload or load is queued (it refused on any op with a tier)."""
    for host in (0, 8):
        m = KVCacheManager(16, 4, num_cpu_blocks=8, host_cache_blocks=host)
        m.add_sequence(1, list(range(6)))
        assert m.allocate_slots(1, 6) is not None
        m.commit(1, 6)
        m.take_memory_ops()  # write-through offloads, if any
        m.fork(1, 2)
        assert m.allocate_slots(2, 0, num_lookahead_tokens=1) is not None  # copy-on-write
        rows = m.swap_out([1])
        ops = m.take_memory_ops()
        assert [kind for kind, _ in ops] == ["copy", "swap_out"], host
        assert ops[1][1].tolist() == rows.tolist()
        m.swap_in([1])
        assert m.take_copy_on_writes().shape == (0, 2), host  # the swap-in row dropped
        assert m.take_memory_ops() == []


def test_reset_drops_unpinned_tier_blocks() -> None:
    m = tiered()
    evict_then_hit(m)
    m.take_events()
    assert m.reset_prefix_cache()
    assert m.stats()["num_host_cached_blocks"] == 0
    # AllBlocksCleared covers every medium: no BlockRemoved follows for the tier's blocks.
    assert [type(e).__name__ for e in m.take_events()] == ["AllBlocksCleared"]


class StrictConsumer:
    """A router's view of one instance, per medium, that clears every medium on
    AllBlocksCleared (what vLLM's consumers do: the event has no medium) and refuses to
    remove a block it does not hold."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {"GPU": set(), "CPU": set()}

    def apply(self, events: list[object]) -> None:
        for e in events:
            if isinstance(e, kvblocks.AllBlocksCleared):
                for held in self.held.values():
                    held.clear()
            elif isinstance(e, kvblocks.BlockStored):
                self.held[e.medium].update(e.block_hashes)
            else:
                assert isinstance(e, kvblocks.BlockRemoved)
                gone = set(e.block_hashes)
                assert gone <= self.held[e.medium], f"{e.medium} removal of blocks not held"
                self.held[e.medium] -= gone


def test_a_consumer_that_clears_every_medium_holds_what_the_reset_kept() -> None:
    """Regression: the reset sent AllBlocksCleared, then a CPU BlockRemoved for blocks the
    consumer had just dropped, and nothing for the pinned tier blocks it kept, so the
    consumer forgot blocks the instance still serves as hits. And: the kept blocks still
    being written were announced right after the clear, before they were hits, so until
    their confirmation the consumer counted hits the instance did not give."""
    m = tiered(num_blocks=8, policy="commit")
    consumer = StrictConsumer()
    a, b = list(range(9)), list(range(100, 109))

    def serves(prompt: list[int], sid: int) -> set[bytes]:
        """Hashes of the prompt's blocks the instance gives as a hit now."""
        n = m.add_sequence(sid, prompt) // 4
        m.free(sid)
        return set(m.block_hasher().block_hashes(prompt)[:n])

    prefill(m, 1, a)
    m.take_memory_ops()
    m.confirm_memory_ops()  # a's two blocks are written: unpinned
    prefill(m, 2, b)  # b's two offloads are queued: pinned until confirmed
    m.free(1)
    m.free(2)
    consumer.apply(m.take_events())
    assert len(consumer.held["CPU"]) == 2  # a's; b's are announced once written
    assert m.reset_prefix_cache()
    events = m.take_events()
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared"]
    consumer.apply(events)
    assert m.stats()["num_host_cached_blocks"] == 2
    # What the consumer holds is what the instance serves, at every point: nothing until
    # b's writes are confirmed, then b in the tier; a misses.
    assert consumer.held == {"GPU": set(), "CPU": set()} and serves(b, 10) == set()
    m.take_memory_ops()
    m.confirm_memory_ops()
    events = m.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [("BlockStored", "CPU")] * 2
    consumer.apply(events)
    assert consumer.held == {"GPU": set(), "CPU": serves(b, 11)} and len(serves(b, 12)) == 2
    assert (m.add_sequence(3, b), m.num_tier_tokens(3)) == (8, 8)
    assert m.add_sequence(4, a) == 0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"host_cache_blocks": -1}, kvblocks.InvalidArgumentError),
        ({"host_cache_blocks": 2**40}, kvblocks.InvalidArgumentError),
        ({"host_cache_blocks": 2**70}, kvblocks.InvalidArgumentError),
        ({"host_cache_blocks": "8"}, (TypeError, kvblocks.InvalidArgumentError)),
        ({"host_cache_blocks": 4, "enable_prefix_caching": False}, kvblocks.InvalidArgumentError),
        ({"host_offload": "never"}, kvblocks.InvalidArgumentError),
        ({"host_offload": 3}, (TypeError, kvblocks.InvalidArgumentError)),
    ],
)
def test_bad_construction_raises(
    kwargs: dict[str, object], error: type[Exception] | tuple[type[Exception], ...]
) -> None:
    with pytest.raises(error):
        KVCacheManager(8, 4, **kwargs)  # type: ignore[arg-type]


def test_bad_calls_raise_and_change_nothing() -> None:
    m = tiered()
    evict_then_hit(m)
    before = snapshot(m)
    with pytest.raises(kvblocks.UnknownSequenceError):
        m.num_tier_tokens(99)
    with pytest.raises((TypeError, kvblocks.InvalidArgumentError)):
        m.num_tier_tokens(-1)
    with pytest.raises(kvblocks.UnknownSequenceError):
        m.num_tier_loads(99)
    m.confirm_memory_ops()
    m.confirm_memory_ops()
    assert snapshot(m) == before
    m.check_invariants()


def test_no_run_writes_one_destination_twice() -> None:
    """A block loaded into, freed and claimed again for another tier hit before the ops
    are taken gets two loads: they must not share a run, whose rows the engine applies
    at once (one index copy; on CUDA duplicate destinations race and either load may
    win). In separate runs they apply in issue order, the later load last."""
    m = KVCacheManager(6, 4, watermark=0.0, host_cache_blocks=8)
    a, b, c, d = (
        list(range(start, start + n)) for start, n in ((0, 12), (100, 12), (200, 8), (300, 8))
    )
    # A history (found by a random search) that leaves a's and b's blocks in the tier
    # and the pool's free blocks in the order that makes a's claim reuse b's.
    steps: list[list[tuple[int, list[int] | None]]] = [
        [(1, c), (1, None)],
        [(2, a), (2, None), (3, d)],
        [(4, b), (3, None), (5, d)],
        [(5, None), (4, None), (6, a)],
        [(7, d), (6, None)],
    ]
    for step in steps:
        for sid, prompt in step:
            if prompt is None:
                m.free(sid)
            else:
                prefill(m, sid, prompt)
        m.take_memory_ops()
        m.confirm_memory_ops()
    prefill(m, 8, b)
    table_b = m.block_table(8)[:2].tolist()
    m.free(8)
    prefill(m, 9, a)  # reuses b's loaded blocks, which the tier holds (no offload between)
    runs = m.take_memory_ops()
    # Every load is there, b's before a's, and a block they share is written twice.
    dsts = [int(dst) for kind, pairs in runs if kind == "load" for dst in pairs[:, 1]]
    assert dsts == table_b + m.block_table(9)[:2].tolist()
    assert len(set(dsts)) < len(dsts)
    for kind, pairs in runs:
        assert len(set(pairs[:, 1].tolist())) == len(pairs), (kind, pairs.tolist())
    m.confirm_memory_ops()
    m.check_invariants()
