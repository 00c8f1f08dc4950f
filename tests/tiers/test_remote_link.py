"""The remote-tier link's counters are moved by two threads (the step thread and the
worker's): every change is locked, and ``stats()`` hands out snapshots, never the live
object (issue 17.2: ``link.stats`` was a shared dataclass updated without a lock)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvblocks
from kvblocks.tiers import DiskTier, KVLayout, RemoteTierLink, RemoteTierOptions
from kvblocks.tiers.remote_link import RemoteTierStats
from kvblocks.tiers.transfer import allocate_host_pool
from tiers.helpers import block_hash, digest_of, random_payload


@pytest.fixture
def link(tmp_path: Path) -> Iterator[RemoteTierLink]:
    layout = KVLayout(2, 2, 16, 64, torch.float16, weights_digest=digest_of("link"))
    manager = kvblocks.KVCacheManager(8, 16, host_cache_blocks=4)
    store = DiskTier(tmp_path, layout, 64)
    link = RemoteTierLink(store, manager, allocate_host_pool(layout.shape_only(), 4), layout)
    yield link
    link.close(timeout=5.0)
    store.close()


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Thread switches after every few bytecodes: an unlocked ``+=`` loses updates."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_counters_moved_by_many_threads_lose_nothing(
    link: RemoteTierLink, tiny_switch_interval: None
) -> None:
    threads, each = 8, 50_000

    def hammer() -> None:
        for _ in range(each):
            link.count_dropped_writes(1)

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert link.stats().dropped_writes == threads * each


def test_stats_is_a_snapshot(link: RemoteTierLink, tmp_path: Path) -> None:
    before = link.stats()
    assert isinstance(before, RemoteTierStats) and before == RemoteTierStats()
    link.write_store([block_hash(0)], random_payload(link.store.layout, 0)[None])
    assert before.published_blocks == 0  # the snapshot did not move
    assert link.stats().published_blocks == 1
    assert link.read_store([block_hash(0)])[0] is not None  # type: ignore[index]


def test_synchronous_and_background_links_count_alike(tmp_path: Path) -> None:
    """Writes through the worker thread land in the same counters as synchronous ones."""
    layout = KVLayout(2, 2, 16, 64, torch.float16, weights_digest=digest_of("link"))
    for async_io in (False, True):
        manager = kvblocks.KVCacheManager(8, 16, host_cache_blocks=4)
        store = DiskTier(tmp_path / str(async_io), layout, 64)
        pool = allocate_host_pool(layout.shape_only(), 4)
        link = RemoteTierLink(store, manager, pool, layout, RemoteTierOptions(async_io=async_io))
        payloads = torch.stack([random_payload(layout, i) for i in range(3)])
        if link._worker is not None:  # the background path, as publish() takes it
            assert link._worker.submit_write([block_hash(i) for i in range(3)], payloads) == 0
        else:
            link.write_store([block_hash(i) for i in range(3)], payloads)
        assert link.flush(10.0)
        assert link.stats().published_blocks == 3, async_io
        assert link.close(10.0)
        store.close()


def test_a_written_block_leaves_the_staged_rows(link: RemoteTierLink) -> None:
    """Queued rows answer reads only until their write reached the store: then they are
    released (a long-running engine would otherwise keep every block it ever wrote in
    memory) and reads go to the store, which may have evicted the block since."""
    worker = link._worker
    assert worker is not None
    layout = link.store.layout
    hashes = [block_hash(i) for i in range(3)]
    rows = torch.stack([random_payload(layout, i) for i in range(3)])
    assert worker.submit_write(hashes, rows) == 0
    assert link.flush(10.0)
    assert link.stats().published_blocks == 3
    assert worker._staged == {}
    assert link.store.evict(hashes[0])
    got = worker.read_through_staged(hashes)
    assert got is not None and got[0] is None
    assert got[1] is not None and torch.equal(got[1], rows[1])


class _FailingPool:
    """A host pool whose rows cannot be written (a copy that raises)."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.pool[index]  # type: ignore[index]

    def __setitem__(self, index: object, value: object) -> None:
        raise RuntimeError("copy into the host pool failed")


def test_a_failed_import_leaves_no_unwritten_slot_a_hit(link: RemoteTierLink) -> None:
    """``complete`` reserved host-tier slots for the fetched blocks, then writing their
    rows raised: it confirmed the reservations and reset the prefix cache, which keeps
    everything while a sequence holds blocks, so the unwritten slots became prefix hits
    (3 garbage blocks here). The reservations are discarded now: no hit, no event."""
    from kvblocks.router import PromptHasher
    from kvblocks.tiers.remote_link import TierRead

    m = link.manager
    prompt = list(range(1, 50))  # three full blocks of 16
    hashes = list(PromptHasher(m.block_size, hash_algo=m.hash_algo).block_hashes(prompt))[:3]
    link.write_store(hashes, torch.stack([random_payload(link.store.layout, i) for i in range(3)]))
    m.add_sequence(99, list(range(500, 520)))  # a sequence holding blocks: no reset
    assert m.allocate_slots(99, 20) is not None
    m.take_events()
    fetch = link.prefetch(TierRead(prompt))
    assert fetch is not None
    fetch.wait(10.0)
    link.host_pool = _FailingPool(link.host_pool)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="host pool failed"):
        link.complete(fetch)
    assert m.num_cached_prefix_blocks(hashes) == 0
    assert m.tier_slot_hashes(list(range(m.host_cache_blocks))) == [None] * 4
    assert not [e for e in m.take_events() if getattr(e, "medium", None) == "CPU"]
    m.check_invariants()
    # The emptied slots take the next import.
    link.host_pool = link.host_pool.pool  # type: ignore[attr-defined]
    fetch = link.prefetch(TierRead(prompt))
    assert fetch is not None
    fetch.wait(10.0)
    assert link.complete(fetch) == 3
    assert m.num_cached_prefix_blocks(hashes) == 3
    # Announced once, by the import that wrote them (none left over from the failed one).
    stored = [e for e in m.take_events() if getattr(e, "medium", None) == "CPU"]
    assert [bytes(h) for e in stored for h in e.block_hashes] == hashes


@pytest.mark.parametrize(
    ("read", "match"),
    [
        ({"token_ids": [1.7] * 40}, "integers"),  # cast to int64, these read [1] * 40's blocks
        ({"token_ids": ["1"] * 40}, "integers"),
        ({"token_ids": [[1] * 20] * 2}, "1-D"),
        ({"token_ids": [-1] * 40}, r"\[0, "),
        ({"token_ids": [2**32] * 40}, r"\[0, "),
        ({"token_ids": [1] * 40, "retention_priority": 101}, "retention_priority"),
        ({"token_ids": [1] * 40, "lora_id": -1}, "lora_id"),
    ],
)
def test_a_bad_read_raises_before_anything_is_read(
    link: RemoteTierLink, read: dict[str, object], match: str
) -> None:
    """``prefetch``/``missing`` take a TierRead from the caller: a token list that a cast
    would change (floats, strings) raised nothing and read another prompt's blocks."""
    from kvblocks.errors import KVBlocksError
    from kvblocks.tiers.remote_link import TierRead

    bad = TierRead(**read)  # type: ignore[arg-type]
    with pytest.raises(KVBlocksError, match=match):
        link.prefetch(bad)
    with pytest.raises(KVBlocksError, match=match):
        link.missing(bad)
    with pytest.raises(KVBlocksError, match="TierRead"):
        link.prefetch([1] * 40)  # type: ignore[arg-type]
    assert link.stats().fetches == 0
