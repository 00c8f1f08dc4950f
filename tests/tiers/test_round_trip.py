"""Every tier behind one protocol: a cache's blocks go down and come back bit-exact."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvblocks import ops
from kvblocks.tiers import (
    DiskTier,
    HostTier,
    KVLayout,
    TierStore,
    gather_blocks,
    scatter_blocks,
)
from tiers.helpers import block_hash, digest_of
from tiers.valkey_server import ServerProcess


@pytest.fixture(params=["host", "disk", "valkey"])
def make_tier(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[KVLayout], TierStore]]:
    made: list[TierStore] = []

    def make(layout: KVLayout) -> TierStore:
        if request.param == "host":
            store: TierStore = HostTier(layout, 16)
        elif request.param == "disk":
            store = DiskTier(tmp_path, layout, 16)
        else:
            server: ServerProcess = request.getfixturevalue("valkey_server")
            from kvblocks.tiers import ValkeyTier

            store = ValkeyTier(layout, port=server.port)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cache_blocks_round_trip_through_the_tier(
    make_tier: Callable[[KVLayout], TierStore], dtype: torch.dtype
) -> None:
    src = ops.allocate_kv_cache(2, 8, 16, 2, 64, dtype, "cpu")
    dst = ops.allocate_kv_cache(2, 8, 16, 2, 64, dtype, "cpu")
    gen = torch.Generator().manual_seed(11)
    for key, value in src:
        key.copy_(torch.randn(key.shape, generator=gen).to(dtype))
        value.copy_(torch.randn(value.shape, generator=gen).to(dtype))
    layout = KVLayout.from_caches(src, "round-trip", weights_digest=digest_of("round-trip"))
    tier = make_tier(layout)
    blocks = [7, 2, 5, 0]
    hashes = [block_hash(b, "rt") for b in blocks]
    assert tier.put_many(hashes, list(gather_blocks(layout, src, blocks))) == 4
    assert tier.contains_many([*hashes, block_hash(99)]) == [True] * 4 + [False]
    loaded = tier.get_many(hashes[::-1])
    assert all(p is not None for p in loaded)
    targets = [1, 3, 4, 6]
    scatter_blocks(layout, loaded, dst, targets)  # type: ignore[arg-type]
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s_block, d_block in zip(blocks[::-1], targets, strict=True):
            assert torch.equal(dk[d_block].view(torch.uint8), sk[s_block].view(torch.uint8))
            assert torch.equal(dv[d_block].view(torch.uint8), sv[s_block].view(torch.uint8))
        for untouched in (0, 2, 5, 7):
            assert not dk[untouched].any() and not dv[untouched].any()
    stats = tier.stats()
    assert (stats.hits, stats.puts, stats.rejected) == (4, 4, 0)
    assert stats.bytes_out == 4 * layout.payload_nbytes
