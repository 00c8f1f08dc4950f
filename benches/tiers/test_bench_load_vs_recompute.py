"""What a host-tier hit saves: loading one block's KV vs recomputing its tokens, on CPU.

Both sides use the per-layer shapes of Llama-3-8B (hidden 4,096, 32 query heads over 8 KV
heads of 128, MLP 14,336) with two layers, so the ratio holds per layer of a real model:

* ``load``: ``kvblocks.tiers.load_blocks`` of one 16-token block (K and V of both layers,
  fp16: 128 KiB) from a host pool into the paged cache, the engine's ``"load"`` op.
* ``recompute``: the model's forward over the block's 16 tokens (fp32 on CPU), what the
  engine runs instead when the block is not in any tier. Attention to the earlier context
  is left out, so this is a lower bound of the recompute and the ratio is conservative.

Run: ``pytest benches/tiers/test_bench_load_vs_recompute.py --benchmark-only``; the
recompute round's ``extra_info`` gives ``recompute_over_load``, the median ratio of the
same run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvblocks import ops
from kvblocks.engine.dense import dense_logits
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.tiers import KVLayout, allocate_host_pool, load_blocks

BLOCK = 16
LAYERS = 2
LAYOUT = KVLayout(
    LAYERS, 8, BLOCK, 128, torch.float16, model_id="bench-8b-shaped", trust_model_id=True
)
MEDIANS: dict[str, float] = {}


@pytest.fixture(scope="module")
def model() -> Any:
    config = tiny_config(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=LAYERS,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    return build_tiny_model(config)


def test_load_one_block(benchmark: Any) -> None:
    caches = ops.allocate_kv_cache(LAYERS, 8, BLOCK, 8, 128, torch.float16, "cpu")
    pool = allocate_host_pool(LAYOUT, 4, pin_memory=False)
    pool[1].copy_(torch.randint(0, 256, (LAYOUT.payload_nbytes,), dtype=torch.uint8))
    rows = np.array([[1, 3]], dtype=np.int64)  # slot 1 -> block 3
    benchmark(load_blocks, LAYOUT, pool, caches, rows)
    assert torch.equal(
        caches[0][0][3].contiguous().view(torch.uint8).reshape(-1)[:16], pool[1][:16]
    )
    MEDIANS["load"] = benchmark.stats.stats.median
    benchmark.extra_info["bytes"] = LAYOUT.payload_nbytes


def test_recompute_one_block(benchmark: Any, model: Any) -> None:
    tokens = torch.arange(BLOCK, dtype=torch.long).reshape(1, BLOCK)
    with torch.inference_mode():
        benchmark.pedantic(dense_logits, args=(model, tokens), rounds=5, iterations=1)
    median = benchmark.stats.stats.median
    if "load" in MEDIANS:
        benchmark.extra_info["recompute_over_load"] = round(median / MEDIANS["load"])
