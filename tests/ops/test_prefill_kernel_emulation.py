"""The tensor-core prefill kernel (cuda/prefill_attention.cu) on the CPU emulator against
the torch reference: GQA, head sizes, block sizes, mixed chunks, window, soft cap, hints.

Launches are planned by :mod:`kvblocks.ops.prefill_launch`, the code the CUDA backend runs,
on CPU tensors the emulated kernel reads and writes directly (the WMMA emulation is
``cuda/emu/include/mma.h``).
"""

from __future__ import annotations

import pytest
import torch
from emu_runtime import emu_launch, library
from ops_cases import make_case, tolerance

from kvblocks.ops import prefill_launch, reference
from kvblocks.ops.cuda_sources import PREFILL_SOURCE, kernel_names

DTYPES = [torch.float16, torch.bfloat16]


def recording(launches):
    """A launcher that logs each launch and runs it."""

    def launch(item):
        launches.append(item)
        emu_launch(item)

    return launch


def emu_prefill(case, launch=emu_launch, max_query_len=None, **kw):
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    return prefill_launch.run_prefill(
        launch, case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=kw.get("scale"),
        sliding_window=kw.get("sliding_window"), soft_cap=kw.get("soft_cap"),
        max_query_len=max(q_lens) if max_query_len is None else max_query_len,
        target_ctas=528,
    )  # fmt: skip


def ref_prefill(case, **kw):
    return reference.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, **kw,
    )  # fmt: skip


def test_every_instantiation_is_in_the_harness_with_the_planned_smem():
    lib = library()
    for name in kernel_names(PREFILL_SOURCE):
        smem = lib.kvb_emu_smem_bytes(name.encode())
        head = int(name[name.index(", ") + 2 : -1])
        assert smem == prefill_launch.prefill_smem_bytes(head), name
        assert smem <= 48 * 1024, f"{name} needs opt-in shared memory"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_size", "block_size", "group"),
    [(64, 16, 1), (128, 8, 4), (256, 32, 8), (80, 16, 1), (96, 32, 4), (112, 8, 8)],
)
def test_mixed_chunks_match_reference(dtype, head_size, block_size, group):
    # A full prompt, extends (q_len < seq_len) across tile edges, a decode row, an idle
    # sequence (q_len = 0) and a chunk longer than one query tile.
    seq_lens, q_lens = [16, 40, 7, 33, 100], [16, 9, 0, 1, 70]
    case = make_case(3 + head_size + group, seq_lens, q_lens, num_kv_heads=2, group=group,
                     head_size=head_size, block_size=block_size, dtype=dtype)  # fmt: skip
    torch.testing.assert_close(emu_prefill(case), ref_prefill(case), **tolerance(dtype))
