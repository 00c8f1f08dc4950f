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
