"""gather_blocks / scatter_blocks between a paged cache and tier payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblocks import ops
from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers import (
    HostTier,
    KVLayout,
    allocate_host_pool,
    gather_blocks,
    load_blocks,
    offload_blocks,
    scatter_blocks,
)
from tiers.helpers import block_hash


def _random_cache(layout: KVLayout, num_blocks: int, seed: int) -> list:
    caches = ops.allocate_kv_cache(
        layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads,
        layout.head_size, layout.dtype, "cpu",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for key, value in caches:
        key.copy_(torch.randn(key.shape, generator=gen).to(layout.dtype))
        value.copy_(torch.randn(value.shape, generator=gen).to(layout.dtype))
    return caches


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_payload_order_is_layer_major_k_then_v(layout: KVLayout) -> None:
    caches = _random_cache(layout, 6, 0)
    payloads = gather_blocks(layout, caches, [4, 1])
    assert payloads.shape == (2, layout.payload_nbytes) and payloads.dtype == torch.uint8
    tile = layout.tile_nbytes
    for row, block in enumerate((4, 1)):
        for layer, (key, value) in enumerate(caches):
            k_part = payloads[row, (2 * layer) * tile : (2 * layer + 1) * tile]
            v_part = payloads[row, (2 * layer + 1) * tile : (2 * layer + 2) * tile]
            assert torch.equal(k_part, _bits(key[block]).reshape(-1))
            assert torch.equal(v_part, _bits(value[block]).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scatter_writes_exactly_the_target_blocks(dtype: torch.dtype) -> None:
    layout = KVLayout(3, 2, 16, 64, dtype)
    src = _random_cache(layout, 5, 1)
    dst = _random_cache(layout, 7, 2)
    before = [(_bits(k).clone(), _bits(v).clone()) for k, v in dst]
    scatter_blocks(layout, gather_blocks(layout, src, [0, 3]), dst, [6, 2])
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before, strict=True):
        for s_block, d_block in ((0, 6), (3, 2)):
            assert torch.equal(_bits(dk[d_block]), _bits(sk[s_block]))
            assert torch.equal(_bits(dv[d_block]), _bits(sv[s_block]))
        for untouched in (0, 1, 3, 4, 5):
            assert torch.equal(_bits(dk[untouched]), bk[untouched])
            assert torch.equal(_bits(dv[untouched]), bv[untouched])


def test_cache_to_host_tier_to_cache(layout: KVLayout) -> None:
    src = _random_cache(layout, 4, 3)
    dst = _random_cache(layout, 4, 4)
    tier = HostTier(layout, 4)
    payloads = gather_blocks(layout, src, [0, 1, 2])
    tier.put_many([block_hash(i) for i in range(3)], list(payloads))
    loaded = tier.get_many([block_hash(2), block_hash(0)])
    scatter_blocks(layout, loaded, dst, [0, 3])  # type: ignore[arg-type]
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(_bits(dk[0]), _bits(sk[2])) and torch.equal(_bits(dv[3]), _bits(sv[0]))


def test_gather_into_out_buffer(layout: KVLayout) -> None:
    caches = _random_cache(layout, 3, 5)
    out = torch.empty((2, layout.payload_nbytes), dtype=torch.uint8)
    assert gather_blocks(layout, caches, [2, 0], out=out) is out
    assert torch.equal(out, gather_blocks(layout, caches, [2, 0]))


def test_bad_arguments_raise(layout: KVLayout) -> None:
    caches = _random_cache(layout, 3, 6)
    with pytest.raises(InvalidArgumentError):
        gather_blocks(layout, caches, [3])
    with pytest.raises(InvalidArgumentError):
        gather_blocks(layout, caches[:1], [0])
    with pytest.raises(InvalidArgumentError):
        gather_blocks(KVLayout(2, 2, 16, 128, torch.float16), caches, [0])
    with pytest.raises(InvalidArgumentError):
        scatter_blocks(layout, torch.zeros((1, 3), dtype=torch.uint8), caches, [0])
    with pytest.raises(TypeError):
        scatter_blocks(layout, [None], caches, [0])  # type: ignore[list-item]


def test_offload_then_load_through_slot_addressed_pool(layout: KVLayout) -> None:
    caches = _random_cache(layout, 6, 7)
    original = [(_bits(k).clone(), _bits(v).clone()) for k, v in caches]
    pool = allocate_host_pool(layout, 4, pin_memory=False)
    # The core's runs: offload GPU blocks 1 and 4 into slots 3 and 0 ...
    offload_blocks(layout, caches, pool, np.array([[1, 3], [4, 0]], dtype=np.int64))
    assert torch.equal(pool[3], gather_blocks(layout, caches, [1])[0])
    assert torch.equal(pool[1], torch.zeros_like(pool[1]))  # untouched slot
    for key, value in caches:  # ... the GPU blocks are reused for something else ...
        key[1].zero_()
        value[4].zero_()
    # ... and a later prefix hit loads slot 3 into GPU block 5, slot 0 into block 1.
    load_blocks(layout, pool, caches, np.array([[3, 5], [0, 1]], dtype=np.int64))
    for (key, value), (ok, ov) in zip(caches, original, strict=True):
        assert torch.equal(_bits(key[5]), ok[1]) and torch.equal(_bits(value[5]), ov[1])
        assert torch.equal(_bits(key[1]), ok[4]) and torch.equal(_bits(value[1]), ov[4])
        assert torch.equal(_bits(key[0]), ok[0]) and torch.equal(_bits(key[3]), ok[3])


def test_pool_ops_reject_bad_rows(layout: KVLayout) -> None:
    caches = _random_cache(layout, 2, 8)
    pool = allocate_host_pool(layout, 2, pin_memory=False)
    before = pool.clone()
    with pytest.raises(InvalidArgumentError):
        offload_blocks(layout, caches, pool, np.array([[0, 2]]))
    with pytest.raises(InvalidArgumentError):
        offload_blocks(layout, caches, pool, np.array([0, 1]))
    with pytest.raises(InvalidArgumentError):
        load_blocks(layout, pool, caches, np.array([[5, 0]]))
    with pytest.raises(InvalidArgumentError):
        load_blocks(layout, pool[:, :10], caches, np.array([[0, 0]]))
    assert torch.equal(pool, before)


def test_no_blocks_is_an_empty_payload_and_a_no_op_scatter(layout: KVLayout) -> None:
    caches = _random_cache(layout, 4, 3)
    before = [(k.clone(), v.clone()) for k, v in caches]
    payloads = gather_blocks(layout, caches, [])
    assert payloads.shape == (0, layout.payload_nbytes) and payloads.dtype == torch.uint8
    scatter_blocks(layout, payloads, caches, [])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize(
    "block_ids",
    [
        [1.7],
        np.array([1.5]),
        [True],
        np.array([True]),
        "1",
        np.array([2**64 - 1], np.uint64),
        [[1, [2]]],
    ],
    ids=["float", "float array", "bool", "bool array", "str", "uint64 max", "ragged"],
)
def test_block_ids_that_are_no_ints_are_refused(layout: KVLayout, block_ids: object) -> None:
    # A float was truncated (1.7 gathered block 1), a bool read as 1; the others were
    # torch's TypeError, ValueError or RuntimeError.
    caches = _random_cache(layout, 4, 0)
    pool = allocate_host_pool(layout, 2, pin_memory=False)
    before = pool.clone()
    with pytest.raises(InvalidArgumentError, match=r"block ids|rows"):
        gather_blocks(layout, caches, block_ids)  # type: ignore[arg-type]
    rows = [[b, b] for b in block_ids] if isinstance(block_ids, list) else block_ids
    with pytest.raises(InvalidArgumentError, match=r"block ids|rows"):
        offload_blocks(layout, caches, pool, rows)
    assert torch.equal(pool, before)


def test_arguments_of_the_wrong_kind_are_refused(layout: KVLayout) -> None:
    # Each was an AttributeError, TypeError or IndexError from inside.
    caches = _random_cache(layout, 4, 0)
    calls = [
        lambda: gather_blocks("layout", caches, [0]),  # type: ignore[arg-type]
        lambda: gather_blocks(layout, 3.5, [0]),  # type: ignore[arg-type]
        lambda: gather_blocks(layout, np.zeros(2), [0]),  # type: ignore[arg-type]
        lambda: scatter_blocks(None, [], caches, []),  # type: ignore[arg-type]
        lambda: offload_blocks(layout, caches, "pool", [[0, 0]]),  # type: ignore[arg-type]
        lambda: load_blocks(layout, None, caches, [[0, 0]]),  # type: ignore[arg-type]
        lambda: allocate_host_pool("layout", 2),  # type: ignore[arg-type]
        lambda: allocate_host_pool(layout, True),
        lambda: allocate_host_pool(layout, 2, pin_memory="no"),  # type: ignore[arg-type]
        lambda: allocate_host_pool(layout, 2**45, pin_memory=False),  # cannot be allocated
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()


def test_rows_with_negative_strides_are_read(layout: KVLayout) -> None:
    # A reversed view of valid rows was torch.from_numpy's ValueError.
    caches = _random_cache(layout, 4, 0)
    pool = allocate_host_pool(layout, 2, pin_memory=False)
    offload_blocks(layout, caches, pool, np.array([[2, 1], [3, 0]])[::-1])
    assert torch.equal(pool, gather_blocks(layout, caches, [3, 2]))


def test_a_destination_named_twice_is_refused(layout: KVLayout) -> None:
    """One index copy writes every row at once: on CUDA two rows with one destination
    race (either may win), so a repeated destination is refused, as copy_blocks refuses
    it, and nothing is written. Sources may repeat."""
    caches = _random_cache(layout, 4, 9)
    pool = allocate_host_pool(layout, 4, pin_memory=False)
    offload_blocks(layout, caches, pool, np.array([[0, 0], [0, 1], [2, 2]]))  # a source twice
    before = [(k.clone(), v.clone()) for k, v in caches]
    pool_before = pool.clone()
    payloads = gather_blocks(layout, caches, [1, 2])
    with pytest.raises(InvalidArgumentError, match="twice"):
        scatter_blocks(layout, payloads, caches, [3, 3])
    with pytest.raises(InvalidArgumentError, match="twice"):
        load_blocks(layout, pool, caches, np.array([[0, 3], [2, 3]]))
    with pytest.raises(InvalidArgumentError, match="twice"):
        offload_blocks(layout, caches, pool, np.array([[1, 3], [2, 3]]))
    assert torch.equal(pool, pool_before)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
