"""Tier throughput: Valkey on loopback (blocks/s, MB/s) and host/disk tiers per block.

Each tier is measured next to a baseline in the same run: the raw ``valkey`` client moving
the same bytes (no header, no checksum, no tensor) for ValkeyTier, and one torch row copy
for HostTier, so the ratio is the price of the tier layer itself. ``extra_info`` carries
blocks/s and MB/s from the median time.

Run: ``pytest benches/tiers --benchmark-only``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvblocks.tiers import DiskTier, HostTier, KVLayout
from tiers.helpers import block_hash, random_payload
from tiers.valkey_server import ServerProcess

# 8 layers x 8 KV heads x 16 tokens x head 128, fp16: 512 KiB per block (a quarter of a
# Llama-3-8B block, whose 32 layers make 2 MiB).
LAYOUT = KVLayout(8, 8, 16, 128, torch.float16, model_id="bench", trust_model_id=True)
BATCH = 32


def _rate(benchmark: Any, blocks: int) -> None:
    # The median: on a shared machine the mean follows a few preempted rounds.
    median = benchmark.stats.stats.median
    benchmark.extra_info["blocks_per_s"] = round(blocks / median)
    benchmark.extra_info["MB_per_s"] = round(blocks * LAYOUT.payload_nbytes / median / 1e6, 1)


@pytest.fixture(scope="module")
def payloads() -> list[torch.Tensor]:
    return [random_payload(LAYOUT, i) for i in range(BATCH)]


HASHES = [block_hash(i, "bench") for i in range(BATCH)]


def test_valkey_put_many(benchmark: Any, server: ServerProcess, payloads: list) -> None:
    """ValkeyTier.put_many of 32 blocks (one pipeline of SETs, each with header + CRC-32)."""
    from kvblocks.tiers import ValkeyTier

    tier = ValkeyTier(LAYOUT, port=server.port)
    benchmark(tier.put_many, HASHES, payloads)
    assert tier.stats().dropped_puts == 0
    _rate(benchmark, BATCH)


def test_valkey_get_many(benchmark: Any, server: ServerProcess, payloads: list) -> None:
    """ValkeyTier.get_many of 32 blocks (pipelined MGETs, verify, copy into tensors)."""
    from kvblocks.tiers import ValkeyTier

    tier = ValkeyTier(LAYOUT, port=server.port)
    tier.put_many(HASHES, payloads)
    result = benchmark(tier.get_many, HASHES)
    assert all(out is not None for out in result)
    _rate(benchmark, BATCH)


def test_valkey_raw_client_baseline(benchmark: Any, server: ServerProcess, payloads: list) -> None:
    """Baseline: the raw client's MGET of the same 32 payloads as plain bytes."""
    import valkey

    client = valkey.Valkey(port=server.port)
    keys = [b"raw:" + h for h in HASHES]
    client.mset({k: p.numpy().tobytes() for k, p in zip(keys, payloads, strict=True)})
    result = benchmark(client.mget, keys)
    assert all(v is not None for v in result)
    _rate(benchmark, BATCH)


def test_valkey_raw_client_set_baseline(
    benchmark: Any, server: ServerProcess, payloads: list
) -> None:
    """Baseline: the raw client's pipelined SET of the same 32 payloads as plain bytes."""
    import valkey

    client = valkey.Valkey(port=server.port)
    items = [(b"raw:" + h, p.numpy().tobytes()) for h, p in zip(HASHES, payloads, strict=True)]

    def put() -> None:
        pipe = client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value)
        pipe.execute()

    benchmark(put)
    _rate(benchmark, BATCH)


def test_host_put(benchmark: Any, payloads: list) -> None:
    """HostTier.put of one block into a full pool (an LRU eviction every time)."""
    tier = HostTier(LAYOUT, BATCH)
    tier.put_many(HASHES, payloads)
    counter = iter(range(10**9))

    def put() -> None:
        i = next(counter)
        tier.put(block_hash(i, "new"), payloads[i % BATCH])

    benchmark(put)
    _rate(benchmark, 1)


def test_host_get(benchmark: Any, payloads: list) -> None:
    """HostTier.get_many of one block (a gather from the pool into a new tensor)."""
    tier = HostTier(LAYOUT, BATCH)
    tier.put_many(HASHES, payloads)
    benchmark(tier.get_many, HASHES[:1])
    _rate(benchmark, 1)


def test_host_row_copy_baseline(benchmark: Any, payloads: list) -> None:
    """Baseline: one torch copy of a payload into a pool row (what a put must do)."""
    pool = torch.empty((BATCH, LAYOUT.payload_nbytes), dtype=torch.uint8)
    benchmark(pool[3].copy_, payloads[0])
    _rate(benchmark, 1)


def test_disk_put(benchmark: Any, tmp_path: Path, payloads: list) -> None:
    """DiskTier.put of one block (temporary file + rename; no fsync) into a full tier."""
    tier = DiskTier(tmp_path, LAYOUT, BATCH)
    tier.put_many(HASHES, payloads)
    counter = iter(range(10**9))

    def put() -> None:
        i = next(counter)
        tier.put(block_hash(i, "new"), payloads[i % BATCH])

    benchmark(put)
    _rate(benchmark, 1)


def test_disk_get(benchmark: Any, tmp_path: Path, payloads: list) -> None:
    """DiskTier.get_many of one block (read, verify the CRC-32, wrap as a tensor)."""
    tier = DiskTier(tmp_path, LAYOUT, BATCH)
    tier.put_many(HASHES, payloads)
    benchmark(tier.get_many, HASHES[:1])
    _rate(benchmark, 1)


@pytest.mark.parametrize("keyed", [False, True], ids=["crc-only", "crc+mac"])
def test_codec_round_trip(benchmark: Any, payloads: list, keyed: bool) -> None:
    """encode_block + decode_block of one 512 KiB block, without and with the MAC key
    (the baseline is the unkeyed row of the same run: the MAC's price is their ratio)."""
    from kvblocks.tiers import RecordKey
    from kvblocks.tiers.codec import decode_block, encode_block

    key = RecordKey("bench-secret") if keyed else None

    def round_trip() -> memoryview:
        record = encode_block(LAYOUT, HASHES[0], payloads[0], key)
        return decode_block(LAYOUT, HASHES[0], record, key)

    assert bytes(benchmark(round_trip)) == payloads[0].numpy().tobytes()
    _rate(benchmark, 1)
