"""Text, JSON and plot output of fleet simulations, one row per router."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate.fleet import FleetResult
from kvblocks.simulate.metrics import PERCENTILES

__all__ = ["format_fleet_json", "format_fleet_table", "write_fleet_plot"]


def _config_doc(result: FleetResult) -> dict[str, Any]:
    cfg = result.config
    w = cfg.workload
    doc: dict[str, Any] = {
        "num_instances": cfg.num_instances,
        "max_concurrency": cfg.max_concurrency,
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.block_size,
        "num_requests": w.num_requests,
        "request_rate": None if math.isinf(w.request_rate) else w.request_rate,
        "prompt_len": str(w.prompt_len),
        "output_len": str(w.output_len),
        "multi_turn_share": w.multi_turn_share,
        "max_turns": w.max_turns,
        "think_time_s": w.think_time_s,
        "system_prompt_share": w.system_prompt_share,
        "num_system_prompts": w.num_system_prompts,
        "system_prompt_len": w.system_prompt_len,
        "seed": w.seed,
        "cost_model": asdict(cfg.cost_model),
    }
    return doc


def format_fleet_json(results: Sequence[FleetResult]) -> str:
    """``{"config": ..., "routers": [summary, ...]}`` (config of the first run)."""
    doc = {
        "config": _config_doc(results[0]) if results else {},
        "routers": [r.summary() for r in results],
    }
    return json.dumps(doc, indent=2)


def format_fleet_table(results: Sequence[FleetResult]) -> str:
    """A table with one row per router, plus ratios to round-robin when it ran."""
    if not results:
        return ""
    cfg = results[0].config
    w = cfg.workload
    lines = [
        f"fleet: {cfg.num_instances} instances x {cfg.num_blocks - 1} blocks of "
        f"{cfg.block_size} tokens; {w.num_requests} requests, "
        + (
            "all conversations due at t=0"
            if math.isinf(w.request_rate)
            else f"{w.request_rate:g} req/s"
        )
        + (f", {cfg.max_concurrency} concurrent conversations" if cfg.max_concurrency else ""),
        "",
    ]
    q = "/".join(f"p{p}" for p in PERCENTILES)
    header = (
        f"{'router':<13} {'hit rate':>8} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT ' + q + ' (s)':>24} {'TPOT ' + q + ' (ms)':>22} {'finished':>9}"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        m = r.metrics
        ttft = "/".join(f"{m.ttft.percentile(p):.2f}" for p in PERCENTILES)
        tpot = "/".join(f"{1e3 * m.tpot.percentile(p):.1f}" for p in PERCENTILES)
        lines.append(
            f"{r.config.router:<13} {100 * r.prefix_hit_rate:>7.1f}% {r.requests_per_s:>8.2f} "
            f"{r.output_tokens_per_s:>10.0f} {ttft:>24} {tpot:>22} {r.num_finished:>9}"
        )
    base = next((r for r in results if r.config.router == "round-robin"), None)
    if base is not None and len(results) > 1:
        lines.append("")
        for r in results:
            if r is base:
                continue
            hit = r.prefix_hit_rate / base.prefix_hit_rate if base.prefix_hit_rate else math.inf
            rps = r.requests_per_s / base.requests_per_s if base.requests_per_s else math.inf
            lines.append(
                f"{r.config.router} vs round-robin: {hit:.2f}x hit rate, {rps:.2f}x throughput"
            )
    return "\n".join(lines)


def write_fleet_plot(results: Sequence[FleetResult], path: str | Path) -> None:
    """Bar charts per router: prefix hit rate, throughput, TTFT and TPOT percentiles.

    Raises:
        InvalidArgumentError: the file cannot be written (check the path first with
            :func:`kvblocks.simulate.plot.check_plot_path`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r.config.router for r in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    axes[0].bar(x, [100 * r.prefix_hit_rate for r in results])
    axes[0].set_ylabel("prefix hit rate, %")
    axes[1].bar(x, [r.requests_per_s for r in results])
    axes[1].set_ylabel("throughput, req/s")
    width = 0.8 / len(PERCENTILES)
    for k, p in enumerate(PERCENTILES):
        off = (k - (len(PERCENTILES) - 1) / 2) * width
        axes[2].bar(x + off, [r.metrics.ttft.percentile(p) for r in results], width, label=f"p{p}")
        axes[3].bar(
            x + off, [1e3 * r.metrics.tpot.percentile(p) for r in results], width, label=f"p{p}"
        )
    axes[2].set_ylabel("TTFT, s")
    axes[3].set_ylabel("TPOT, ms")
    for ax in axes[2:]:
        ax.set_ylim(top=1.3 * ax.get_ylim()[1])  # room for the legend above the bars
    axes[2].legend(fontsize="small", ncol=len(PERCENTILES), loc="upper center")
    for ax in axes:
        ax.set_xticks(x, names, rotation=20, fontsize="small")
    cfg = results[0].config
    fig.suptitle(f"kvblocks simulate: {cfg.num_instances} instances behind each router")
    fig.tight_layout()
    try:
        fig.savefig(str(path), dpi=100)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot write plot {str(path)!r}: {exc}") from None
    finally:
        plt.close(fig)
