"""What background write-back saves the step: remote-tier writes on the step thread vs queued.

Two engines of one model (4 layers, 8 KV heads of 128, fp32 on CPU: 512 KiB per block) with a
host tier and write-through to one real Valkey server on loopback: one with
``RemoteTierOptions(async_io=False)`` (every offloaded block is put on the step thread),
one with the default background thread. Each round runs one ``generate`` of eight fresh
64-token prompts (every full block is written: about 40 blocks, 20 MiB per call) on each
engine, alternated, and takes each call's mean step time (``run_stats``: ``elapsed_s /
steps``; the end-of-call flush is not in it). ``extra_info`` has the medians and the median
per-round ratio sync / async, both from the same run.

Run: ``pytest benches/tiers/test_bench_async_writeback.py --benchmark-only``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvblocks.engine import LLM, weights_digest
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.sampling_params import SamplingParams
from kvblocks.tiers import KVLayout, RemoteTierOptions
from tiers.valkey_server import ServerProcess

BLOCK = 16
PROMPTS = 8
PROMPT_LEN = 4 * BLOCK
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def _engine(model: Any, port: int, options: RemoteTierOptions) -> LLM:
    from kvblocks.tiers.valkey_tier import ValkeyTier

    layout = KVLayout(4, 8, BLOCK, 128, torch.float32, weights_digest=weights_digest(model))
    return LLM(
        model,
        num_blocks=128,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=96,
        host_offload="commit",
        remote_tier=ValkeyTier(layout, port=port),
        remote_tier_options=options,
    )


def test_step_time_sync_vs_async_writeback(benchmark: Any, server: ServerProcess) -> None:
    """One round: a call on the synchronous engine, then one on the background one."""
    model = build_tiny_model(tiny_config(**CONFIG))
    engines = {
        "sync": _engine(model, server.port, RemoteTierOptions(async_io=False)),
        "async": _engine(model, server.port, RemoteTierOptions(max_pending_write_blocks=1024)),
    }
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"sync": [], "async": []}

    def one_round() -> None:
        for name, llm in engines.items():
            # Fresh prompts for each call: nothing is cached, every full block is written.
            prompts = rng.integers(1, 256, size=(PROMPTS, PROMPT_LEN)).tolist()
            llm.generate(prompts, PARAMS)
            stats = llm.run_stats
            times[name].append(float(stats["elapsed_s"]) / int(stats["steps"]))

    benchmark.pedantic(one_round, rounds=15, iterations=1, warmup_rounds=1)
    blocks: dict[str, int] = {}
    for name, llm in engines.items():
        assert llm.remote is not None and llm.remote.flush(60.0)
        remote = llm.stats()["remote"]
        blocks[name] = int(remote["published_blocks"])
        assert remote["dropped_writes"] == 0 and remote["worker_errors"] == 0
        llm.close()
        llm.remote.store.close()
    sync, bg = np.asarray(times["sync"]), np.asarray(times["async"])
    ratio = float(np.median(sync / bg))
    benchmark.extra_info.update(
        median_step_sync_ms=float(np.median(sync)) * 1e3,
        median_step_async_ms=float(np.median(bg)) * 1e3,
        median_ratio_sync_over_async=ratio,
        published_blocks=blocks,
    )
    print(
        f"\nstep: sync {np.median(sync) * 1e3:.2f} ms, async {np.median(bg) * 1e3:.2f} ms, "
        f"median per-round ratio sync/async {ratio:.2f} (blocks written {blocks})"
    )
