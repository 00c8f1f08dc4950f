"""Host time of one decode attention call, up to the kernel launch (CPU, no GPU).

Everything kvblocks does in Python for one layer's decode attention is timed: argument
checks, planning (cached or not), output/workspace allocation and argument packing. The
launcher, the boundary where CuPy would take over, is the only stand-in: a no-op that
keeps the last launches (so nothing is optimised away). Shapes are Llama-3-8B's decode
at batch 64 (32 query heads over 8 KV heads of 128, fp16, block 16, mixed lengths up to
4k) on an H100-sized plan (132 SMs x 2 CTAs). Tensors live on the CPU; no kernel runs.

* ``old``: the front-end checks plus the older split-K driver
  (``kernel_driver.run_split_k_attention``, planned from ``max_seq_len``), what
  ``ops.paged_attention`` did per call before the length-aware path;
* ``functional``: the same front-end checks plus the length-aware path with a cached
  plan (``ops.paged_attention(..., seq_lens_host=...)``, the step's earlier layers
  having planned the lengths);
* ``run``: ``DecodeAttention.run`` after the step's ``plan``, what an engine calls per
  layer (the issue's target: at most 15 us per call with cached plans);
* ``plan_new_lengths``: ``DecodeAttention.plan`` for lengths not seen before, once
  per step (planning and the copy into the plan buffer).

Run: ``pytest benches/ops/test_bench_host_overhead.py --benchmark-only``. The ``run``
and ``functional`` rounds' ``extra_info`` give ``old_over_this``, the ratio of medians
in the same run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kvblocks.ops as ops
from kvblocks.ops import kernel_driver
from kvblocks.ops.launch_plan import KernelLaunch

BATCH, HEADS, KV_HEADS, HEAD, BLOCK, MAX_BLOCKS = 64, 32, 8, 128, 16, 512
TARGET_CTAS = 132 * 2  # H100 at head 128: two decode CTAs fit an SM
OLD_TARGET_CTAS = 132 * 4  # the older kernel's target (CTAS_PER_SM), as its backend plans
DTYPE = torch.float16
MEDIANS: dict[str, float] = {}


class NoopLauncher:
    """The launch boundary: keeps the last two launches, runs nothing."""

    def __init__(self) -> None:
        self.last: list[KernelLaunch] = []

    def __call__(self, launch: KernelLaunch) -> None:
        self.last = [*self.last[-1:], launch]


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    # Only addresses matter (no kernel runs): a small cache that every table points into.
    ((key_cache, value_cache),) = ops.allocate_kv_cache(1, 64, BLOCK, KV_HEADS, HEAD, DTYPE, "cpu")
    lens = rng.integers(1, 4096, BATCH).astype(np.int32)
    return {
        "query": torch.randn(BATCH, HEADS, HEAD, generator=gen).to(DTYPE),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": torch.randint(0, 64, (BATCH, MAX_BLOCKS), dtype=torch.int32),
        "seq_lens": torch.from_numpy(lens),
        "lens": lens,
    }


def front_end_checks(b: dict[str, Any], max_seq_len: int | None) -> None:
    """The checks ``ops.paged_attention`` runs before handing a CUDA call to the backend."""
    ops._check_hint(max_seq_len, "max_seq_len")
    ops._check_attention_args(
        b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
        BATCH, None, None, None, None,
    )  # fmt: skip


def old_call(launch: NoopLauncher, b: dict[str, Any], max_seq_len: int) -> torch.Tensor:
    front_end_checks(b, max_seq_len)
    return kernel_driver.run_split_k_attention(
        launch, b["query"], b["key_cache"], b["value_cache"], b["block_tables"],
        b["seq_lens"], None, scale=None, sliding_window=None, soft_cap=None,
        max_query_len=1, max_seq_len=max_seq_len, target_ctas=OLD_TARGET_CTAS,
    )  # fmt: skip


def functional_call(launch: NoopLauncher, b: dict[str, Any]) -> torch.Tensor:
    front_end_checks(b, None)
    return kernel_driver.run_decode(
        launch, b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["lens"],
        scale=None, sliding_window=None, soft_cap=None, target_ctas=TARGET_CTAS,
    )  # fmt: skip


def decoder(launch: NoopLauncher) -> ops.DecodeAttention:
    return ops.DecodeAttention(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD, block_size=BLOCK,
        dtype=DTYPE, device="cpu", max_seqs=BATCH, target_ctas=TARGET_CTAS, launcher=launch,
    )  # fmt: skip


def _ratio(benchmark: Any, name: str) -> None:
    MEDIANS[name] = benchmark.stats.stats.median
    benchmark.extra_info["us_per_call"] = round(MEDIANS[name] * 1e6, 2)
    if "old" in MEDIANS and name != "old":
        benchmark.extra_info["old_over_this"] = round(MEDIANS["old"] / MEDIANS[name], 1)


def test_old(benchmark: Any, batch: dict[str, Any]) -> None:
    launch = NoopLauncher()
    max_seq_len = int(batch["lens"].max())
    benchmark(old_call, launch, batch, max_seq_len)
    assert launch.last[0].name.startswith("split_k_attention_kernel<")
    _ratio(benchmark, "old")


def test_functional(benchmark: Any, batch: dict[str, Any]) -> None:
    launch = NoopLauncher()
    functional_call(launch, batch)  # an earlier layer of the step planned these lengths
    benchmark(functional_call, launch, batch)
    assert launch.last[0].name.startswith("decode_attention_kernel<")
    _ratio(benchmark, "functional")


def test_run(benchmark: Any, batch: dict[str, Any]) -> None:
    launch = NoopLauncher()
    dec = decoder(launch)
    dec.plan(batch["lens"], batch["block_tables"])
    benchmark(dec.run, batch["query"], batch["key_cache"], batch["value_cache"])
    assert [x.name.split("<")[0] for x in launch.last] == [
        "decode_attention_kernel",
        "merge_partials_kernel",
    ], "the batch is split: both launches are timed"
    _ratio(benchmark, "run")


def test_plan_new_lengths(benchmark: Any, batch: dict[str, Any]) -> None:
    dec = decoder(NoopLauncher())
    steps = [batch["lens"] + i for i in range(1, 4000)]  # decode: every length grows
    it = iter(steps)
    benchmark.pedantic(lambda: dec.plan(next(it), batch["block_tables"]), rounds=2000, iterations=1)
    _ratio(benchmark, "plan_new_lengths")
