"""Planner -> ``decode_attention_kernel`` -> ``merge_partials_kernel`` in the CPU emulator.

:class:`kvblocks.ops.DecodeAttention` plans on the host, writes the plan buffer, packs
the launches, and the emulator runs the real CUDA source on the CPU tensors' memory;
the result is compared with the torch reference. A CUDA-graph replay is emulated by
re-issuing the launches recorded at "capture" after ``plan()`` rewrote the buffers for
other (longer) lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from emu_runtime import emu_launch, library
from ops_cases import make_case, tolerance
from ops_cases import ref_decode as reference_out

import kvblocks.ops as ops
from kvblocks.ops.launch_plan import KernelLaunch


class EmuRecorder:
    """Launches on the emulator and keeps the launches (the "captured graph")."""

    def __init__(self) -> None:
        self.launches: list[KernelLaunch] = []

    def __call__(self, launch: KernelLaunch) -> None:
        self.launches.append(launch)
        emu_launch(launch)


@pytest.fixture(scope="module", autouse=True)
def decode_kernel_in_harness():
    name = b"merge_partials_kernel<__half, 64>"
    if library().kvb_emu_smem_bytes(name) < 0:
        pytest.skip("the emulation harness has no decode_attention_kernel yet")


def decoder(case, launch, **kwargs):
    _, num_kv_heads, block_size, head_size = case.key_cache.shape
    args = {
        "num_heads": case.query.shape[1], "num_kv_heads": num_kv_heads,
        "head_size": head_size, "block_size": block_size, "dtype": case.query.dtype,
        "device": "cpu", "max_seqs": case.query.shape[0], "target_ctas": 32,
        "launcher": launch,
    }  # fmt: skip
    args.update(kwargs)
    return ops.DecodeAttention(**args)


@pytest.mark.parametrize(
    ("dtype", "window", "soft_cap", "block_size"),
    [
        (torch.bfloat16, None, None, 16),
        (torch.float16, 700, None, 16),
        (torch.bfloat16, None, 30.0, 32),
        (torch.float16, 100, 5.0, 8),
    ],
)
def test_mixed_lengths_gqa8_through_the_emulated_kernel(dtype, window, soft_cap, block_size):
    lens = [8192, 37, 1, 0, 300, 16]
    case = make_case(31, lens, [1] * len(lens), num_kv_heads=1, group=8, head_size=128,
                     block_size=block_size, dtype=dtype)  # fmt: skip
    launch = EmuRecorder()
    dec = decoder(case, launch, sliding_window=window, soft_cap=soft_cap)
    plan = dec.plan(np.array(lens, dtype=np.int32), case.block_tables)
    if window is None:
        assert np.bincount(plan.items[:, 0])[0] > 4, "the 8k sequence is split"
    got = dec.run(case.query, case.key_cache, case.value_cache)
    want = reference_out(case, sliding_window=window, soft_cap=soft_cap)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    assert launch.launches[0].name.startswith("decode_attention_kernel<")


@pytest.mark.parametrize("group", [1, 4, 16])
def test_group_sizes_and_head_chunks(group):
    lens = [900, 5, 64]
    case = make_case(32, lens, [1] * 3, num_kv_heads=2, group=group, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    dec = decoder(case, EmuRecorder(), min_chunk_tokens=64)
    dec.plan(np.array(lens), case.block_tables)
    got = dec.run(case.query, case.key_cache, case.value_cache)
    torch.testing.assert_close(got, reference_out(case), **tolerance(torch.float16))


def test_graph_replay_with_longer_sequences_on_the_same_buffers():
    long_lens = [3000, 700, 1, 0, 1500]
    case = make_case(33, long_lens, [1] * 5, num_kv_heads=2, group=8, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    launch = EmuRecorder()
    dec = decoder(case, launch, cuda_graph=True, min_chunk_tokens=128)
    out = torch.empty_like(case.query)
    short = np.array([100, 20, 1, 0, 64], dtype=np.int32)
    assert dec.plan(short, case.block_tables).num_slots == 0, "captured without a split"
    dec.run(case.query, case.key_cache, case.value_cache, out=out)
    captured = list(launch.launches)
    case.seq_lens = torch.from_numpy(short)
    torch.testing.assert_close(out, reference_out(case), **tolerance(torch.bfloat16))
    for lens in (np.array(long_lens, dtype=np.int32), np.array([2000, 600, 5, 0, 1400])):
        plan = dec.plan(lens.astype(np.int32), case.block_tables)
        assert plan.num_slots > 0
        out.fill_(float("nan"))
        for item in captured:
            emu_launch(item)
        case.seq_lens = torch.from_numpy(lens.astype(np.int32))
        torch.testing.assert_close(out, reference_out(case), **tolerance(torch.bfloat16))
