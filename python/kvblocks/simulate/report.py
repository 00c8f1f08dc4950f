"""The ``kvblocks simulate`` report: a plain-text table or JSON."""

from __future__ import annotations

import json
from typing import Any

from kvblocks.simulate.runner import SimulationResult

__all__ = ["format_json", "format_table"]


def format_table(result: SimulationResult) -> str:
    """A two-column table of the headline numbers."""
    s = result.summary()
    cfg = result.config
    sched = cfg.scheduler
    header = (
        f"kvblocks simulate: {s['num_requests']} requests at {cfg.workload.request_rate:g}/s, "
        f"{cfg.num_blocks} blocks x {cfg.block_size} tokens (+{cfg.num_cpu_blocks} CPU), "
        f"policy {sched.policy}, max_num_seqs {sched.max_num_seqs}, "
        f"max_num_batched_tokens {sched.max_num_batched_tokens}, prefix caching "
        f"{'on' if cfg.enable_prefix_caching else 'off'}"
    )
    rows: list[tuple[str, str]] = [
        ("requests finished / rejected", f"{s['num_finished']} / {s['num_rejected']}"),
        ("scheduling steps", f"{s['num_steps']}"),
        (
            "throughput, simulated clock",
            f"{s['simulated_requests_per_s']:.2f} req/s, "
            f"{s['simulated_output_tokens_per_s']:.0f} output tok/s "
            f"({s['simulated_time_s']:.1f} s simulated)",
        ),
        (
            "scheduler throughput, wall clock",
            f"{s['scheduler_requests_per_s']:.0f} req/s, {s['scheduler_steps_per_s']:.0f} steps/s",
        ),
        (
            "schedule()+update() per step",
            f"mean {s['mean_step_us']:.0f} us, p99 {s['p99_step_us']:.0f} us",
        ),
        (
            "latency (simulated)",
            f"mean {s['mean_latency_s']:.2f} s, p99 {s['p99_latency_s']:.2f} s",
        ),
        (
            "KV memory utilisation",
            f"mean {100 * s['mean_kv_usage']:.1f}%, peak {100 * s['peak_kv_usage']:.1f}%",
        ),
        ("prefix-cache hit rate", f"{100 * s['prefix_hit_rate']:.1f}% of prompt tokens"),
        (
            "preemptions",
            f"{s['preemptions_recompute']} recompute, {s['preemptions_swap']} swap",
        ),
        (
            "KV blocks held, paged",
            f"mean {s['mean_used_blocks']:.0f}, peak {s['peak_used_blocks']:.0f} "
            f"of {s['usable_blocks']}",
        ),
        (
            "same batch, contiguous reservation",
            f"mean {s['mean_contiguous_blocks']:.0f}, peak {s['peak_contiguous_blocks']:.0f} "
            f"(prompt + max_tokens per sequence)",
        ),
        (
            "memory paging saves",
            f"{100 * s['memory_saved_by_paging']:.1f}% "
            f"(contiguous needs {s['contiguous_over_paged']:.2f}x)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [header, ""]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def format_json(result: SimulationResult) -> str:
    """The summary as JSON (one object), plus the configuration."""
    cfg = result.config
    doc: dict[str, Any] = {
        "summary": result.summary(),
        "config": {
            "num_requests": cfg.workload.num_requests,
            "request_rate": cfg.workload.request_rate,
            "seed": cfg.workload.seed,
            "num_blocks": cfg.num_blocks,
            "block_size": cfg.block_size,
            "num_cpu_blocks": cfg.num_cpu_blocks,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "policy": cfg.scheduler.policy,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        },
    }
    return json.dumps(doc, indent=2)
