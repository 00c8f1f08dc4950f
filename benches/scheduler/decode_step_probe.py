"""Time the 1,024-decode scheduler step in whatever ``kvblocks`` this interpreter imports.

``python decode_step_probe.py STEPS [RUNNING]`` builds the steady decode state of
``test_bench_scheduler.py`` (every request running, one decode token each per step), times
``STEPS`` calls of ``schedule()`` + ``update()`` with a seeded fake model result, and
prints one JSON line: the per-step wall-clock and CPU (this thread's) times in ns and a
SHA-256 digest of everything the same steps return (the output arrays, the block table
rows and delta, and every request's news), replayed untimed.
``test_bench_step_baseline.py`` runs it under the current checkout and under a baseline
build, interleaved, so both figures come from one run and the digests prove the outputs
are the same.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

from kvblocks import KVCacheManager
from kvblocks.scheduler import ModelStepResult, Request, SamplingParams, Scheduler, SchedulerConfig

_ARRAYS = (
    "seq_ids",
    "num_scheduled_tokens",
    "input_token_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "logits_indices",
    "sample_seq_ids",
    "sample_counts",
    "temperature",
    "top_p",
    "top_k",
    "seeds",
    "sample_seq_index",
    "block_table_rows",
)


def _result(output: Any, rng: np.random.Generator) -> ModelStepResult:
    total = int(output.sample_counts.sum())
    return ModelStepResult(
        rng.integers(0, 32000, size=total, dtype=np.int64),
        rng.standard_normal(total).astype(np.float32),
    )


def _digest(h: Any, out: Any, news: Any) -> None:
    for name in _ARRAYS:
        h.update(name.encode())
        h.update(np.ascontiguousarray(getattr(out, name)).tobytes())
    h.update(repr((out.sample_request_ids, out.finished_request_ids, out.memory_ops)).encode())
    h.update(np.ascontiguousarray(out.block_tables).tobytes())
    delta = out.block_table_delta
    for name in ("rows", "start_cols", "indptr", "block_ids", "reset"):
        h.update(np.asarray(getattr(delta, name)).tobytes())
    for record in news:
        h.update(repr((record.request_id, record.finished)).encode())
        for c in record.outputs:
            h.update(
                repr((c.index, c.new_token_ids, c.finish_reason, c.cumulative_logprob)).encode()
            )


def build(running: int, steps: int) -> Scheduler:
    """A scheduler with ``running`` requests decoding (prefills done), room for ``steps``."""
    max_len = 64 + steps + 64
    mgr = KVCacheManager(running * (max_len // 16 + 2) + 4096, 16)
    cfg = SchedulerConfig(max_num_batched_tokens=64 * running, max_num_seqs=running + 64)
    sched = Scheduler(mgr, cfg)
    rng = np.random.default_rng(0)
    for i in range(running):
        prompt = rng.integers(0, 32000, size=64)
        sched.add_request(Request(f"d{i}", prompt, SamplingParams(max_tokens=10**6)))
    while True:  # the prefills, so that the timed steps start in steady state
        out = sched.schedule()
        sched.update(out, _result(out, rng))
        if out.num_prefill_tokens == 0:
            break
    return sched


def draws(step: int, running: int) -> tuple[np.ndarray, np.ndarray]:
    """The fake model's tokens and log-probs of a step (made before the clock starts)."""
    rng = np.random.default_rng(step)
    return (
        rng.integers(0, 32000, size=running, dtype=np.int64),
        rng.standard_normal(running).astype(np.float32),
    )


def step(sched: Scheduler, tokens: np.ndarray, logprobs: np.ndarray) -> tuple[Any, Any]:
    """One ``schedule()`` + ``update()`` (what is timed)."""
    out = sched.schedule()
    total = int(out.sample_counts.sum())
    return out, sched.update(out, ModelStepResult(tokens[:total], logprobs[:total]))


def main(steps: int, running: int) -> dict[str, Any]:
    """Time ``steps`` steps from the steady state; then digest the same steps, replayed
    on a fresh scheduler (reading every record between the timed steps would leave its
    garbage to the timed ones)."""
    sched = build(running, steps)
    times = []
    cpu_times = []
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    for i in range(steps):
        tokens, logprobs = draws(i, running)
        start = clock()
        cpu_start = cpu_clock()
        step(sched, tokens, logprobs)
        cpu_times.append(cpu_clock() - cpu_start)
        times.append(clock() - start)
    assert sched.stats()["num_running_seqs"] == running
    sched = build(running, steps)
    h = hashlib.sha256()
    for i in range(steps):
        out, news = step(sched, *draws(i, running))
        _digest(h, out, news)
    return {"times_ns": times, "cpu_times_ns": cpu_times, "digest": h.hexdigest()}


if __name__ == "__main__":
    n_steps = int(sys.argv[1])
    n_running = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    print(json.dumps(main(n_steps, n_running)))
