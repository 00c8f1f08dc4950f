"""What naming the weights costs: the digest of a multi-GB checkpoint, and its cached lookup.

A checkpoint of ``KVBLOCKS_BENCH_DIGEST_GIB`` GiB (default 2) of random bf16 tensors in
256 MiB pieces, written once to a temporary directory, is hashed three ways in one run:

- ``first``: :func:`checkpoint_digest` with an empty cache and the file in the page cache
  (what a process pays right after the checkpoint was downloaded or loaded);
- ``cold``: the same with the file's pages dropped first (``posix_fadvise(DONTNEED)``: read
  from the disk, as on a first start after a reboot);
- ``cached``: the lookup every later start pays (stat the files, read one small entry);

and, as the baseline, ``hashlib.blake2b`` over the same bytes (the fastest hash in the
standard library). ``extra_info`` carries GB/s.

Run: ``pytest benches/tiers/test_bench_weights_digest.py --benchmark-only``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvblocks.tiers import weights
from kvblocks.tiers.weights import checkpoint_digest

PIECE = 256 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """config.json and one safetensors file of random bf16 tensors."""
    gib = float(os.environ.get("KVBLOCKS_BENCH_DIGEST_GIB", "2"))
    pieces = max(1, round(gib * (1 << 30) / PIECE))
    directory = tmp_path_factory.mktemp("digest-checkpoint")
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    header = {
        f"layer.{i}.weight": {
            "dtype": "BF16",
            "shape": [PIECE // 2 // 4096, 4096],
            "data_offsets": [i * PIECE, (i + 1) * PIECE],
        }
        for i in range(pieces)
    }
    text = json.dumps(header).encode()
    rng = np.random.default_rng(0)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _ in range(pieces):
            f.write(rng.integers(0, 256, PIECE, dtype=np.uint8).tobytes())
    old = 1_600_000_000 * 10**9
    for f in directory.iterdir():
        os.utime(f, ns=(old, old))
    yield directory


def _files(directory: Path) -> tuple[Path, list[Path]]:
    return directory / "config.json", [directory / "model.safetensors"]


def _gbps(benchmark: Any, nbytes: int) -> None:
    median = benchmark.stats.stats.median
    benchmark.extra_info["GB/s"] = round(nbytes / median / 1e9, 3)
    benchmark.extra_info["GiB"] = round(nbytes / (1 << 30), 2)


def _drop_pages(path: Path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("mode", ["first", "cold", "cached"])
def test_checkpoint_digest(
    benchmark: Any,
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    monkeypatch.setattr(weights, "RACY_WINDOW_NS", 0)
    config, files = _files(checkpoint)
    nbytes = files[0].stat().st_size
    counter = iter(range(1 << 30))

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        cache = tmp_path / ("cache" if mode == "cached" else f"cache-{next(counter)}")
        if mode == "cold":
            _drop_pages(files[0])
        return (config, files), {"cache_dir": cache}

    if mode == "cached":
        checkpoint_digest(config, files, cache_dir=tmp_path / "cache")
    result = benchmark.pedantic(checkpoint_digest, setup=setup, rounds=3, iterations=1)
    assert result.cached == (mode == "cached")
    _gbps(benchmark, nbytes)


def test_baseline_hashlib_blake2b(benchmark: Any, checkpoint: Path) -> None:
    """The same bytes through the standard library's fastest hash (pages in memory)."""
    path = _files(checkpoint)[1][0]

    def blake2b() -> str:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            h = hashlib.blake2b(m)
        return h.hexdigest()

    benchmark.pedantic(blake2b, rounds=3, iterations=1)
    _gbps(benchmark, path.stat().st_size)
