"""DiskTier: files keyed by fingerprint + block hash, restarts, crashes, full disks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers import DiskTier, KVLayout, TierStore
from tiers.helpers import block_hash, digest_of, logs_warning, random_payload, tier_warnings


def _stored(tier: DiskTier, layout: KVLayout, ids: range | list[int]) -> list[int]:
    """The ids whose blocks read back bit-exact."""
    got = tier.get_many([block_hash(i) for i in ids])
    ok = []
    for i, out in zip(ids, got, strict=True):
        if out is not None:
            assert torch.equal(out, random_payload(layout, i)), f"block {i} came back altered"
            ok.append(i)
    return ok


def test_round_trip_is_bit_exact_and_counted(tmp_path: Path, layout: KVLayout) -> None:
    tier = DiskTier(tmp_path, layout, 8)
    assert isinstance(tier, TierStore)
    assert (
        tier.put_many(
            [block_hash(i) for i in range(4)], [random_payload(layout, i) for i in range(4)]
        )
        == 4
    )
    assert _stored(tier, layout, [3, 1, 7]) == [3, 1]
    stats = tier.stats()
    assert (stats.puts, stats.hits, stats.misses, stats.rejected) == (4, 2, 1, 0)
    assert stats.bytes_in == 4 * layout.payload_nbytes
    assert stats.bytes_out == 2 * layout.payload_nbytes
    assert (tier.root / "layout.json").exists()


def test_reopen_finds_the_same_blocks_in_lru_order(tmp_path: Path, layout: KVLayout) -> None:
    tier = DiskTier(tmp_path, layout, 4)
    for i in range(4):
        tier.put(block_hash(i), random_payload(layout, i))
        time.sleep(0.01)  # distinct modification times
    tier.get_many([block_hash(0)])  # 0 becomes the most recently used
    tier.close()
    del tier
    reopened = DiskTier(tmp_path, layout, 4)
    assert len(reopened) == 4
    assert reopened.contains_many([block_hash(i) for i in range(4)]) == [True] * 4
    reopened.put(block_hash(9), random_payload(layout, 9))  # evicts 1, the LRU across the restart
    assert reopened.contains_many([block_hash(i) for i in range(4)]) == [True, False, True, True]
    assert _stored(reopened, layout, [0, 2, 3, 9]) == [0, 2, 3, 9]


def test_reopen_with_smaller_capacity_evicts_oldest(tmp_path: Path, layout: KVLayout) -> None:
    tier = DiskTier(tmp_path, layout, 4)
    for i in range(4):
        tier.put(block_hash(i), random_payload(layout, i))
        time.sleep(0.01)
    small = DiskTier(tmp_path, layout, 2)
    assert small.contains_many([block_hash(i) for i in range(4)]) == [False, False, True, True]
    assert len(list(small.root.glob("*.kvb"))) == 2


def test_another_layout_never_sees_the_blocks(tmp_path: Path, layout: KVLayout) -> None:
    DiskTier(tmp_path, layout, 4).put(block_hash(0), random_payload(layout, 0))
    other = DiskTier(
        tmp_path,
        KVLayout(2, 2, 16, 64, torch.float16, "another-model", digest_of("another-model")),
        4,
    )
    assert len(other) == 0 and other.get_many([block_hash(0)]) == [None]


def test_a_directory_of_other_layouts_only_warns(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    DiskTier(tmp_path, layout, 4).put(block_hash(0), random_payload(layout, 0))
    other_layout = KVLayout(2, 2, 16, 64, torch.float32, "test-model", digest_of("test-model"))
    with logs_warning(caplog, "other layouts.*'test-model'"):
        other = DiskTier(tmp_path, other_layout, 4)
    assert other.get_many([block_hash(0)]) == [None]
    caplog.clear()  # reopening its own (now existing) directory is quiet
    assert DiskTier(tmp_path, layout, 4).contains_many([block_hash(0)]) == [True]
    assert tier_warnings(caplog) == []


def test_a_directory_describing_another_layout_is_rejected(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """A fingerprint directory copied from another model: warned, its blocks removed."""
    foreign = KVLayout(2, 2, 16, 64, torch.float16, "another-model", digest_of("another-model"))
    source = DiskTier(tmp_path / "a", foreign, 4)
    source.put(block_hash(0), random_payload(foreign, 0))
    mine = tmp_path / "b" / layout.fingerprint.hex()
    mine.parent.mkdir()
    source.root.rename(mine)
    with logs_warning(caplog, "describes another layout"):
        tier = DiskTier(tmp_path / "b", layout, 4)
    assert len(tier) == 0 and tier.get_many([block_hash(0)]) == [None]
    assert tier.stats().rejected == 1 and not list(mine.glob("*.kvb"))
    assert json.loads((mine / "layout.json").read_text())["model_id"] == "test-model"
    assert tier.put(block_hash(0), random_payload(layout, 0))
    assert _stored(DiskTier(tmp_path / "b", layout, 4), layout, [0]) == [0]


def test_capacity_evicts_lru_never_fails(tmp_path: Path, layout: KVLayout) -> None:
    tier = DiskTier(tmp_path, layout, 3)
    for i in range(3):
        tier.put(block_hash(i), random_payload(layout, i))
    tier.get_many([block_hash(0)])
    assert all(tier.put(block_hash(i), random_payload(layout, i)) for i in range(3, 5))
    assert tier.contains_many([block_hash(i) for i in range(5)]) == [True, False, False, True, True]
    assert tier.stats().evictions == 2
    assert len(list(tier.root.glob("*.kvb"))) == 3


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "foreign record", "empty"])
def test_damaged_file_reads_as_miss_and_is_removed(
    tmp_path: Path, layout: KVLayout, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, layout, 4)
    tier.put(block_hash(0), random_payload(layout, 0))
    tier.put(block_hash(1), random_payload(layout, 1))
    path = tier.path_of(block_hash(0))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "bit flip":
        data[-5] ^= 0x80
    elif damage == "foreign record":
        data = bytearray(tier.path_of(block_hash(1)).read_bytes())
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with logs_warning(caplog, "rejected"):
        assert tier.get_many([block_hash(0), block_hash(1)])[0] is None
    assert tier.stats().rejected == 1
    assert not path.exists() and not tier.contains_many([block_hash(0)])[0]
    assert _stored(tier, layout, [1]) == [1]


def test_a_stray_file_with_an_overlong_hash_name_is_left_alone(
    tmp_path: Path, layout: KVLayout
) -> None:
    # Not a name this tier writes (hashes of at most 100 bytes): evicting it raised the
    # argument error of path_of, from the constructor or from a put after the index had
    # already dropped it.
    tier = DiskTier(tmp_path, layout, 2)
    stray = tier.root / ("ab" * 101 + ".kvb")
    stray.write_bytes(b"not a record")
    os.utime(stray, (1, 1))  # the oldest: the first eviction's victim
    tier.put(block_hash(0), random_payload(layout, 0))
    tier.close()
    tier = DiskTier(tmp_path, layout, 1)
    assert len(tier) == 1
    assert tier.put(block_hash(1), random_payload(layout, 1))
    assert _stored(tier, layout, [0, 1]) == [1] and len(tier) == 1
    assert stray.exists()


def test_an_oversized_file_is_rejected_without_reading_it_whole(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    # A block's file grown to 64 GiB (sparse here): get_many read all of it into memory
    # before the length check (MemoryError, or the process killed for memory).
    tier = DiskTier(tmp_path, layout, 4)
    tier.put(block_hash(0), random_payload(layout, 0))
    os.truncate(tier.path_of(block_hash(0)), 64 << 30)
    with logs_warning(caplog, "rejected"):
        assert tier.get_many([block_hash(0)]) == [None]
    assert tier.stats().rejected == 1 and not tier.path_of(block_hash(0)).exists()


def test_a_directory_named_like_a_block_is_not_indexed(tmp_path: Path, layout: KVLayout) -> None:
    # It was indexed as a block: it filled a slot for good (every read failed with
    # IsADirectoryError, counted as an error, and kept it) and len() counted it.
    tier = DiskTier(tmp_path, layout, 2)
    (tier.root / (block_hash(5).hex() + ".kvb")).mkdir()
    tier.close()
    tier = DiskTier(tmp_path, layout, 2)
    assert len(tier) == 0 and not tier.contains_many([block_hash(5)])[0]


class _StillBlocked(Exception):
    """Not an OSError (TimeoutError is one): the tier's ``except OSError`` must not eat it."""


@contextmanager
def _fails_after(seconds: float) -> Iterator[None]:
    """Raise _StillBlocked in the main thread if the block runs longer than ``seconds``: a
    SIGALRM handler interrupts a blocking open(), so nothing is left hanging."""

    def expire(signum: int, frame: object) -> None:
        raise _StillBlocked(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_place_of_a_block_reads_as_a_miss(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    # open() of a FIFO for reading waits for a writer: get_many blocked forever.
    tier = DiskTier(tmp_path, layout, 4)
    tier.put(block_hash(0), random_payload(layout, 0))
    tier.put(block_hash(1), random_payload(layout, 1))
    path = tier.path_of(block_hash(0))
    path.unlink()
    os.mkfifo(path)
    with _fails_after(5), logs_warning(caplog, "not a regular file"):
        assert tier.get_many([block_hash(0)]) == [None]
    assert _stored(tier, layout, [1]) == [1]
    stats = tier.stats()
    assert (stats.misses, stats.rejected, stats.hits) == (1, 1, 1)
    assert not tier.contains_many([block_hash(0)])[0] and not path.exists()
    assert tier.put(block_hash(0), random_payload(layout, 0))  # the name is usable again
    assert _stored(tier, layout, [0]) == [0]


def test_a_fifo_named_layout_json_does_not_block_the_open(
    tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    # The constructor reads this layout's layout.json and, in a fresh directory, every
    # other layout's: a FIFO in either place blocked it forever.
    other = tmp_path / "other-layout"
    other.mkdir()
    os.mkfifo(other / "layout.json")
    with _fails_after(5), logs_warning(caplog, "not a regular file"):
        tier = DiskTier(tmp_path, layout, 4)
    tier.put(block_hash(0), random_payload(layout, 0))
    tier.close()
    own = tier.root / "layout.json"
    own.unlink()
    os.mkfifo(own)
    with _fails_after(5), logs_warning(caplog, "not a regular file"):
        reopened = DiskTier(tmp_path, layout, 4)
    assert _stored(reopened, layout, [0]) == [0]


def test_leftover_temporaries_are_removed_on_open(tmp_path: Path, layout: KVLayout) -> None:
    tier = DiskTier(tmp_path, layout, 4)
    tier.put(block_hash(0), random_payload(layout, 0))
    torn = tier.root / (block_hash(1).hex() + ".kvb.123.0.tmp")
    torn.write_bytes(b"KVBT half a record")
    reopened = DiskTier(tmp_path, layout, 4)
    assert not torn.exists()
    assert reopened.contains_many([block_hash(0), block_hash(1)]) == [True, False]


_WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from kvblocks.tiers import DiskTier, KVLayout
    from tiers.helpers import block_hash, digest_of, random_payload
    layout = KVLayout(2, 2, 16, 64, torch.float16, "test-model", digest_of("test-model"))
    tier = DiskTier({root!r}, layout, 10_000)
    i = 0
    while True:
        tier.put(block_hash(i), random_payload(layout, i))
        if i == 20:
            print("ready", flush=True)
        i += 1
    """
)


@pytest.mark.slow  # a real writer process killed mid-put
def test_killed_writer_leaves_no_corrupt_block(tmp_path: Path, layout: KVLayout) -> None:
    tests_dir = str(Path(__file__).resolve().parents[1])
    code = _WRITER.format(tests=tests_dir, root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    tier = DiskTier(tmp_path, layout, 10_000)
    count = len(tier)
    assert count > 20
    # Every indexed block verifies and is bit-exact: a torn write never became a block.
    assert _stored(tier, layout, range(count + 5)) == list(range(count))
    assert tier.stats().rejected == 0
    assert not list(tier.root.glob("*.tmp"))


@pytest.fixture
def tiny_filesystem(tmp_path: Path):
    """A 256 KiB tmpfs (needs root and mount permission; skipped otherwise)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_directory_removed_under_the_tier_is_made_again(tmp_path: Path, layout: KVLayout) -> None:
    """Its directory removed under a running tier (a cleanup job, an operator): the blocks
    it held read as misses, and the next puts store again, instead of every later put
    being dropped until a restart."""
    import shutil

    tier = DiskTier(tmp_path, layout, 10)
    assert (
        tier.put_many([block_hash(i) for i in (0, 1)], [random_payload(layout, i) for i in (0, 1)])
        == 2
    )
    shutil.rmtree(tmp_path)
    assert tier.get_many([block_hash(0)]) == [None]
    assert tier.put(block_hash(2), random_payload(layout, 2))
    got = tier.get_many([block_hash(1), block_hash(2)])
    assert got[0] is None and got[1] is not None
    assert torch.equal(got[1], random_payload(layout, 2))
    assert tier.stats().dropped_puts == 0
    assert json.loads((tier.root / "layout.json").read_text())["fingerprint"] == (
        layout.fingerprint.hex()
    )
    again = DiskTier(tmp_path, layout, 10)  # a restart finds what was stored since
    assert again.contains_many([block_hash(2)]) == [True]


def test_full_disk_evicts_lru_never_fails(tiny_filesystem: Path, layout: KVLayout) -> None:
    tier = DiskTier(tiny_filesystem, layout, 1000)
    n = 40  # 40 blocks of 16 KiB do not fit in 256 KiB
    with_room = [tier.put(block_hash(i), random_payload(layout, i)) for i in range(n)]
    assert all(with_room)
    stats = tier.stats()
    assert stats.evictions > 0 and stats.errors > 0 and stats.dropped_puts == 0
    kept = _stored(tier, layout, range(n))
    # The survivors are exactly the most recent blocks.
    assert kept == list(range(n - len(kept), n)) and len(kept) >= 5


def test_block_larger_than_the_disk_is_dropped_with_a_warning(
    tiny_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    huge = KVLayout(
        4, 8, 16, 128, torch.float16, weights_digest=digest_of("huge")
    )  # 512 KiB blocks, 256 KiB disk
    tier = DiskTier(tiny_filesystem, huge, 4)
    with logs_warning(caplog, "dropped"):
        assert not tier.put(block_hash(0), torch.zeros(huge.payload_nbytes, dtype=torch.uint8))
    assert tier.stats().dropped_puts == 1 and len(tier) == 0
    assert not list(tier.root.glob("*.tmp"))


def test_bad_arguments_raise(tmp_path: Path, layout: KVLayout) -> None:
    tier = DiskTier(tmp_path, layout, 2)
    with pytest.raises(InvalidArgumentError):
        tier.put(b"x" * 101, random_payload(layout, 0))
    with pytest.raises(InvalidArgumentError):
        tier.put(block_hash(0), b"short")
    with pytest.raises(InvalidArgumentError):
        DiskTier(tmp_path, layout, 0)
    assert len(tier) == 0 and not list(tier.root.glob("*.kvb"))


@pytest.mark.parametrize("priority", ["5", 1.5, float("nan"), None, True, -1, 101, 2**70])
def test_bad_priority_raises_and_stores_nothing(
    tmp_path: Path, layout: KVLayout, priority: object
) -> None:
    """A priority outside the retention priorities' [0, 100] (a str, a float, NaN, None, a
    bool) raised ValueError/TypeError, or was stored as a priority no other level has."""
    tier = DiskTier(tmp_path, layout, 2)
    with pytest.raises(InvalidArgumentError, match="priority"):
        tier.put(block_hash(0), random_payload(layout, 0), priority=priority)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="priority"):
        tier.put_many([block_hash(0)], [random_payload(layout, 0)], priority=priority)  # type: ignore[arg-type]
    assert len(tier) == 0 and not list(tier.root.glob("*.kvb")) and tier.stats().puts == 0


def test_put_many_with_one_bad_block_stores_none(tmp_path: Path, layout: KVLayout) -> None:
    """A batch whose second payload (or hash) is bad stored the first block, then raised."""
    tier = DiskTier(tmp_path, layout, 4)
    good = random_payload(layout, 0)
    for hashes, kvs in [
        ([block_hash(0), block_hash(1)], [good, b"short"]),
        ([block_hash(0), b"x" * 101], [good, good]),
        ([block_hash(0), "not bytes"], [good, good]),
    ]:
        with pytest.raises(InvalidArgumentError):
            tier.put_many(hashes, kvs)  # type: ignore[arg-type]
    assert len(tier) == 0 and not list(tier.root.glob("*.kvb")) and tier.stats().puts == 0


def test_bad_fsync_and_hash_lists_are_refused(tmp_path: Path, layout: KVLayout) -> None:
    # fsync took any truthy object; get_many of a non-sequence was a bare TypeError.
    for fsync in ("no", 1, None):
        with pytest.raises(InvalidArgumentError, match="fsync"):
            DiskTier(tmp_path, layout, 4, fsync=fsync)  # type: ignore[arg-type]
    tier = DiskTier(tmp_path, layout, 4)
    for value in (None, 3):
        with pytest.raises(InvalidArgumentError):
            tier.get_many(value)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            tier.contains_many(value)  # type: ignore[arg-type]
