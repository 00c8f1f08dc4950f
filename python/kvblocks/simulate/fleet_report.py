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


def _config_doc(results: Sequence[FleetResult]) -> dict[str, Any]:
    cfg = results[0].config
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
        "host_offload": cfg.host_offload,
        "remote_tier_blocks": max(r.config.remote_tier_blocks for r in results),
        "remote_fetch_wait_s": cfg.remote_fetch_wait_s,
        "remote_max_pending_write_blocks": cfg.remote_max_pending_write_blocks,
        "cost_model": asdict(cfg.cost_model),
    }
    return doc


def format_fleet_json(results: Sequence[FleetResult]) -> str:
    """``{"config": ..., "routers": [summary, ...]}`` (config of the first run).

    Strict JSON (RFC 8259): the infinite request rate is ``null``, and any other
    non-finite number raises ``ValueError`` instead of being written as ``Infinity``.
    """
    doc = {
        "config": _config_doc(results) if results else {},
        "routers": [r.summary() for r in results],
    }
    return json.dumps(doc, indent=2, allow_nan=False)


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
    tiered = any(r.config.host_cache_blocks for r in results)
    remote = any(r.config.remote_tier_blocks for r in results)
    name_w = 29 if remote else 20 if tiered else 13
    header = (
        f"{'router':<{name_w}} {'hit rate':>8} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT ' + q + ' (s)':>24} {'TPOT ' + q + ' (ms)':>22} {'finished':>9}"
    )
    if tiered:
        header += f" {'GPU+host hits':>14} {'loaded/offloaded':>17}"
    if remote:
        header += (
            f" {'remote hits':>11} {'remote in/out':>14} {'timeouts':>8}"
            f" {'dropped':>8} {'link busy':>9}"
        )
    lines += [header, "-" * len(header)]
    for r in results:
        m = r.metrics
        ttft = "/".join(f"{m.ttft.percentile(p):.2f}" for p in PERCENTILES)
        tpot = "/".join(f"{1e3 * m.tpot.percentile(p):.1f}" for p in PERCENTILES)
        line = (
            f"{r.label:<{name_w}} {100 * r.prefix_hit_rate:>7.1f}% {r.requests_per_s:>8.2f} "
            f"{r.output_tokens_per_s:>10.0f} {ttft:>24} {tpot:>22} {r.num_finished:>9}"
        )
        if tiered:
            t = r.summary()
            hits = f"{100 * t['gpu_hit_rate']:.1f}+{100 * t['host_hit_rate']:.1f}%"
            moved = f"{t['blocks_loaded']}/{t['blocks_offloaded']}"
            line += f" {hits:>14} {moved:>17}"
        if remote:
            t = r.summary()
            inout = f"{t['remote_blocks_imported']}/{t['remote_blocks_published']}"
            line += f" {100 * t['remote_hit_rate']:>10.1f}% {inout:>14}"
            line += f" {t['remote_fetch_timeouts']:>8} {t['remote_dropped_writes']:>8}"
            line += f" {100 * t['remote_link_busy']:>8.0f}%"
        lines.append(line)
    lines += _ratios(results)
    if tiered:
        cost = cfg.cost_model
        host = max(r.config.host_cache_blocks for r in results)
        lines += [
            "",
            f"+ host: {host} host-tier blocks per instance (offload at "
            f"{results[-1].config.host_offload}); loads and offloads charged at "
            f"{cost.block_bytes(cfg.block_size) / 2**20:.1f} MiB per block over "
            f"{cost.host_bandwidth_bytes_per_s / 1e9:g} GB/s; loads add to the step, "
            + (
                "write-through offloads overlap its compute."
                if results[-1].config.host_offload == "commit"
                else "offloads at eviction add too."
            ),
        ]
    if remote:
        cost = cfg.cost_model
        blocks = max(r.config.remote_tier_blocks for r in results)
        lines.append(
            f"+ remote: one remote tier of {blocks} blocks shared by all instances (LRU); "
            "every block offloaded to a host tier is written to it off the step path (an "
            f"instance queues {cfg.remote_max_pending_write_blocks} blocks at most, and drops "
            "the rest: dropped), and a routed request's blocks past its instance's own hit "
            "are read into the host tier before the request joins its queue. Reads and writes "
            f"cross the server's one link in turn at "
            f"{cost.block_bytes(cfg.block_size) / 2**20:.1f} MiB per block over "
            f"{cost.remote_bandwidth_bytes_per_s / 1e9:g} GB/s (link busy: their time over the "
            "run; over 100%: writes still queued at the end), and a written block can be "
            f"read once it crossed; a read that would take over {cfg.remote_fetch_wait_s:g} s "
            "is left to finish unused and the request computes its blocks (timeouts). Remote "
            "hits: imported tokens over prompt tokens (part of the host hits)."
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def _ratios(results: Sequence[FleetResult]) -> list[str]:
    """Each router against round-robin (same tier setting), and each tier against none."""
    lines: list[str] = []

    def tiers(r: FleetResult) -> tuple[int, int]:
        return r.config.host_cache_blocks, r.config.remote_tier_blocks

    for setting in sorted({tiers(r) for r in results}):
        same = [r for r in results if tiers(r) == setting]
        base = next((r for r in same if r.config.router == "round-robin"), None)
        for r in same:
            if base is None or r is base:
                continue
            lines.append(
                f"{r.label} vs {base.label}: "
                f"{_ratio(r.prefix_hit_rate, base.prefix_hit_rate):.2f}x hit rate, "
                f"{_ratio(r.requests_per_s, base.requests_per_s):.2f}x throughput"
            )
    for r in results:
        if not r.config.host_cache_blocks:
            continue
        base = next(
            (
                b
                for b in results
                if b.config.router == r.config.router and not b.config.host_cache_blocks
            ),
            None,
        )
        if base is None:
            continue
        lines.append(_tier_ratio(r, base))
        if r.config.remote_tier_blocks:
            host_only = next(
                (
                    b
                    for b in results
                    if b.config.router == r.config.router
                    and b.config.host_cache_blocks == r.config.host_cache_blocks
                    and not b.config.remote_tier_blocks
                ),
                None,
            )
            if host_only is not None:
                lines.append(_tier_ratio(r, host_only))
    return ["", *lines] if lines else []


def _tier_ratio(r: FleetResult, base: FleetResult) -> str:
    """A tiered run against the same router with fewer tiers."""
    ttft = _ratio(r.metrics.ttft.percentile(50), base.metrics.ttft.percentile(50))
    prefill = _ratio(r.tier.prefill_tokens_computed, base.tier.prefill_tokens_computed)
    return (
        f"{r.label} vs {base.label}: "
        f"{_ratio(r.prefix_hit_rate, base.prefix_hit_rate):.2f}x hit rate, "
        f"{_ratio(r.requests_per_s, base.requests_per_s):.2f}x throughput, "
        f"TTFT p50 {ttft:.2f}x, prefill tokens computed {prefill:.2f}x"
    )


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

    names = [r.label for r in results]
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
