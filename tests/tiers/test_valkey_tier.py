"""ValkeyTier against a real Valkey/Redis server on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.tiers import KVLayout, TierStore, encode_block
from tiers.helpers import (
    TIERS_LOGGER,
    block_hash,
    digest_of,
    logs_warning,
    random_payload,
    tier_warnings,
)
from tiers.valkey_server import ServerProcess, running_server

pytest.importorskip("valkey", reason="the valkey client is missing: pip install 'kvblocks[tiers]'")

from kvblocks.tiers import ValkeyTier


def _tier(server: ServerProcess, layout: KVLayout, **kwargs) -> ValkeyTier:
    return ValkeyTier(layout, port=server.port, **kwargs)


def test_round_trip_is_bit_exact_and_counted(
    valkey_server: ServerProcess, layout: KVLayout
) -> None:
    tier = _tier(valkey_server, layout, batch_size=3)  # several MGETs in one pipeline
    assert isinstance(tier, TierStore) and tier.capacity_blocks is None
    ids = list(range(10))
    assert (
        tier.put_many([block_hash(i) for i in ids], [random_payload(layout, i) for i in ids]) == 10
    )
    asked = [7, 100, 0, 3, 101, 9, 5]
    got = tier.get_many([block_hash(i) for i in asked])
    for i, out in zip(asked, got, strict=True):
        if i >= 100:
            assert out is None
        else:
            assert out is not None and torch.equal(out, random_payload(layout, i))
    stats = tier.stats()
    assert (stats.puts, stats.hits, stats.misses, stats.rejected) == (10, 5, 2, 0)
    assert stats.bytes_out == 5 * layout.payload_nbytes
    assert tier.contains_many([block_hash(0), block_hash(100)]) == [True, False]
    assert len(tier) == 10
    assert tier.evict(block_hash(0)) and not tier.evict(block_hash(0))
    assert tier.get_many([block_hash(0)]) == [None]


def test_two_instances_share_blocks(valkey_server: ServerProcess, layout: KVLayout) -> None:
    a = _tier(valkey_server, layout)
    b = _tier(valkey_server, layout)
    a.put_many([block_hash(i) for i in range(3)], [random_payload(layout, i) for i in range(3)])
    got = b.get_many([block_hash(i) for i in range(3)])
    assert all(
        out is not None and torch.equal(out, random_payload(layout, i)) for i, out in enumerate(got)
    )
    assert b.stats().hits == 3 and b.stats().puts == 0
    # Another model on the same server has its own key space.
    other = _tier(
        valkey_server,
        KVLayout(2, 2, 16, 64, torch.float16, "another-model", digest_of("another-model")),
    )
    assert other.get_many([block_hash(0)]) == [None] and len(other) == 0


@pytest.mark.parametrize(
    "damage", ["short", "empty", "bit flip", "wrong fingerprint", "other block"]
)
def test_bad_values_are_rejected_never_loaded(
    valkey_server: ServerProcess, layout: KVLayout, damage: str
) -> None:
    tier = _tier(valkey_server, layout)
    good = encode_block(layout, block_hash(0), random_payload(layout, 0))
    bad = {
        "short": good[:-10],
        "empty": b"",
        "bit flip": good[:-1] + bytes([good[-1] ^ 1]),
        "wrong fingerprint": encode_block(
            KVLayout(2, 2, 16, 64, torch.float16, "another-model", digest_of("another-model")),
            block_hash(0),
            random_payload(layout, 0),
        ),
        "other block": encode_block(layout, block_hash(1), random_payload(layout, 1)),
    }[damage]
    tier.client.set(tier.key_of(block_hash(0)), bad)
    tier.put(block_hash(2), random_payload(layout, 2))
    got = tier.get_many([block_hash(0), block_hash(2)])
    assert got[0] is None
    assert got[1] is not None and torch.equal(got[1], random_payload(layout, 2))
    stats = tier.stats()
    assert (stats.rejected, stats.misses, stats.hits) == (1, 1, 1)


def test_many_bad_values_log_one_warning(
    valkey_server: ServerProcess, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged store (or a fleet writing without the readers' key) rejects every read:
    one warning per tier, as the disk tier, not one per record read."""
    tier = _tier(valkey_server, layout, key_prefix="many-bad:")
    hashes = [block_hash(i) for i in range(5)]
    for h in hashes:
        tier.client.set(tier.key_of(h), b"not a record")
    with logs_warning(caplog, "rejected"):
        assert tier.get_many(hashes) == [None] * 5
        assert tier.get_many(hashes) == [None] * 5
    assert len(tier_warnings(caplog)) == 1, tier_warnings(caplog)
    assert tier.stats().rejected == 10


def test_killed_server_gives_misses_one_warning_and_no_hang(
    valkey_server: ServerProcess, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _tier(valkey_server, layout, socket_timeout_s=0.5, retry_interval_s=0.3)
    tier.put(block_hash(0), random_payload(layout, 0))
    assert tier.get_many([block_hash(0)])[0] is not None
    valkey_server.kill()
    start = time.monotonic()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=TIERS_LOGGER):
        for i in range(20):
            assert tier.get_many([block_hash(0), block_hash(1)]) == [None, None]
            assert not tier.put(block_hash(10 + i), random_payload(layout, i))
            assert tier.contains_many([block_hash(0)]) == [False]
            assert not tier.evict(block_hash(0))
        elapsed = time.monotonic() - start
        time.sleep(0.4)  # past the back-off: the tier tries again, fails, and stays quiet
        assert tier.get_many([block_hash(0)]) == [None]
    assert elapsed < 5.0, f"a dead server cost {elapsed:.1f} s"
    with pytest.raises(InvalidArgumentError):  # bad input still raises while the server is down
        tier.put(block_hash(0), b"short")
    unreachable = [m for m in tier_warnings(caplog) if "unreachable" in m]
    assert len(unreachable) == 1, tier_warnings(caplog)
    stats = tier.stats()
    assert stats.misses == 41 and stats.dropped_puts == 20 and stats.errors >= 2


def test_hung_server_times_out_instead_of_hanging(
    valkey_server: ServerProcess, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _tier(valkey_server, layout, socket_timeout_s=0.3, retry_interval_s=60)
    tier.put(block_hash(0), random_payload(layout, 0))
    valkey_server.pause()
    try:
        start = time.monotonic()
        with logs_warning(caplog, "unreachable"):
            assert tier.get_many([block_hash(0)]) == [None]
        assert not tier.put(block_hash(1), random_payload(layout, 1))
        assert tier.get_many([block_hash(0)]) == [None]
        elapsed = time.monotonic() - start
    finally:
        valkey_server.resume()
    # One socket timeout, then the back-off answers without touching the network.
    assert elapsed < 2.0, f"a hung server cost {elapsed:.1f} s"
    assert tier.stats().dropped_puts == 1


def test_reconnects_after_the_server_returns(
    valkey_server: ServerProcess, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _tier(valkey_server, layout, socket_timeout_s=0.5, retry_interval_s=0.2)
    valkey_server.kill()
    with logs_warning(caplog, "unreachable"):
        assert not tier.put(block_hash(0), random_payload(layout, 0))
    assert not tier.is_available()
    valkey_server.start()  # same port, empty (no persistence)
    time.sleep(0.3)
    assert tier.is_available()
    assert tier.put(block_hash(0), random_payload(layout, 0))
    (out,) = tier.get_many([block_hash(0)])
    assert out is not None and torch.equal(out, random_payload(layout, 0))


def test_a_database_the_server_lacks_is_one_warning_not_silence(
    valkey_server: ServerProcess, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """A url naming database 99 of a 16-database server: every command is refused (the
    server is reachable, so there is no outage to report). Each refused command is counted;
    one warning for the reads and one for the writes name the server's reason."""
    tier = ValkeyTier(layout, url=f"valkey://127.0.0.1:{valkey_server.port}/99")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=TIERS_LOGGER):
        for i in range(3):
            assert not tier.put(block_hash(i), random_payload(layout, i))
            assert tier.get_many([block_hash(i)]) == [None]
            assert tier.contains_many([block_hash(i)]) == [False]
    warnings = tier_warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "refused a write" in warnings[0] and "refused a read" in warnings[1], warnings
    assert all("DB index is out of range" in w for w in warnings), warnings
    stats = tier.stats()
    assert stats.errors == 9 and stats.dropped_puts == 3 and stats.misses == 3
    assert tier.is_available()  # reachable: no back-off, the next command asks again


def test_refused_puts_warn_once_per_episode(
    layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory under ``noeviction`` refuses each SET of a pipeline: one warning while
    it lasts (reads, which still succeed, do not end it), a note when a put succeeds again,
    and a warning for the next episode."""
    with running_server() as server:
        tier = ValkeyTier(layout, port=server.port)
        tier.client.config_set("maxmemory-policy", "noeviction")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=TIERS_LOGGER):
            tier.client.config_set("maxmemory", "1")  # below what the server already uses
            for i in range(3):
                assert tier.put_many([block_hash(i)], [random_payload(layout, i)]) == 0
                assert tier.get_many([block_hash(i)]) == [None]  # GET is allowed
            assert len(tier_warnings(caplog)) == 1
            tier.client.config_set("maxmemory", "0")  # no limit
            assert tier.put(block_hash(10), random_payload(layout, 10))
            tier.client.config_set("maxmemory", "1")
            assert not tier.put(block_hash(11), random_payload(layout, 11))
        warnings = tier_warnings(caplog)
        assert len(warnings) == 2 and all("maxmemory" in w for w in warnings), warnings
        assert any("accepts writes again" in r.getMessage() for r in caplog.records)
        stats = tier.stats()
        assert stats.puts == 1 and stats.dropped_puts == 4 and stats.errors == 4


def test_server_lru_bounds_the_tier(layout: KVLayout) -> None:
    with running_server(maxmemory="2mb") as server:
        tier = ValkeyTier(layout, port=server.port)
        n = 400  # 400 x 16 KiB = 6.4 MB > 2 MB
        stored = sum(tier.put(block_hash(i), random_payload(layout, i)) for i in range(n))
        assert stored == n  # the server evicts (allkeys-lru), no put fails
        assert 0 < len(tier) < n
        got = tier.get_many([block_hash(n - 1)])
        assert got[0] is not None and torch.equal(got[0], random_payload(layout, n - 1))


def test_bad_arguments_raise(valkey_server: ServerProcess, layout: KVLayout) -> None:
    tier = _tier(valkey_server, layout)
    with pytest.raises(InvalidArgumentError):
        tier.put(block_hash(0), b"short")
    with pytest.raises(TypeError):
        tier.get_many(["nope"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        ValkeyTier(layout, port=valkey_server.port, batch_size=0)
    # A priority is ignored here but checked as every tier checks it (ValueError before).
    with pytest.raises(InvalidArgumentError, match="priority"):
        tier.put(block_hash(0), random_payload(layout, 0), priority="x")  # type: ignore[arg-type]
    # What cannot be iterated is refused as the other tiers refuse it (a bare TypeError).
    for call in (tier.get_many, tier.contains_many, lambda v: tier.put_many(v, v)):
        for value in (None, 5):
            with pytest.raises(InvalidTypeError, match="block_hashes"):
                call(value)
    # Values the client or the server refuse only at the first command: named at once.
    # (A host the resolver cannot encode raised UnicodeError out of the first put, a
    # socket timeout past the clock's range OverflowError, a TTL past the server's
    # range dropped every put.)
    port = valkey_server.port
    for kwargs, word in (
        ({"host": "a..b", "port": port}, "host"),
        ({"url": f"valkey://{'a' * 64}:{port}/0"}, "url"),
        ({"port": port, "socket_timeout_s": 1e10}, "socket_timeout_s"),
        ({"port": port, "ttl_s": 2**62}, "ttl_s"),
        ({"client": 5}, "client"),
    ):
        with pytest.raises(InvalidArgumentError, match=word):
            ValkeyTier(layout, **kwargs)  # type: ignore[arg-type]
    assert len(tier) == 0 and tier.stats().puts == 0
