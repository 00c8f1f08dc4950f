"""The ``kvblocks simulate`` report: a plain-text table or JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from kvblocks.simulate.capacity import CapacityResult
from kvblocks.simulate.metrics import PERCENTILES
from kvblocks.simulate.planner import GROUPED_SERVER, PlanResult, ServerReport

__all__ = ["format_json", "format_table"]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _finished(s: dict[str, Any]) -> str:
    text = f"{s['num_finished']} / {s['num_rejected']}"
    if s["num_cut_short"]:
        text += (
            f" ({s['num_cut_short']} cut short: a sequence alone filled the pool and ended"
            " with reason 'length')"
        )
    return text


def _percentiles(s: dict[str, Any], name: str) -> str:
    return " / ".join(_ms(float(s[f"{name}_p{q}_s"])) for q in PERCENTILES)


def _capacity_text(server: ServerReport) -> str:
    cap = server.capacity
    if cap is None:
        return "not measured (--capacity off)"
    if cap.rejected_share >= 1:
        return "none: the saturated run rejected every request (longer than the pool holds)"
    text = _capacity_rate_text(cap)
    if cap.rejected_share > 0:
        text += (
            f"; of the requests that fit: the saturated run rejected "
            f"{100 * cap.rejected_share:.0f}% (longer than the pool holds)"
        )
    return text


def _capacity_rate_text(cap: CapacityResult) -> str:
    if cap.mode == "search" and cap.trace_too_short:
        return (
            f"not found: the trace is too short (stable up to {cap.requests_per_s:.2f} req/s, "
            f"above the saturation {cap.estimate_requests_per_s:.2f}; raise --num-requests)"
        )
    if cap.mode == "search":
        return (
            f"{cap.requests_per_s:.2f} req/s (search; saturation {cap.estimate_requests_per_s:.2f})"
        )
    if cap.lower_bound:
        return (
            f"at least {cap.requests_per_s:.2f} req/s (the saturated run never queued a "
            "request: raise --saturation-requests, or --capacity search)"
        )
    return f"at most {cap.requests_per_s:.2f} req/s (saturation estimate; --capacity search)"


def _workload_rows(plan: PlanResult) -> list[tuple[str, str]]:
    res = plan.paged
    w = res.config.workload
    admitted = max(res.num_admitted, 1)
    history = 100 * res.history_tokens / max(res.prompt_tokens, 1)
    return [
        (
            "workload",
            f"messages {w.prompt_len} (+ a shared system prompt for "
            f"{100 * w.system_prompt_share:.0f}%), outputs {w.output_len}",
        ),
        (
            "conversations",
            f"{100 * w.multi_turn_share:.0f}% multi-turn (2..{w.max_turns} turns, think "
            f"{w.think_time_s:g} s): mean prompt {res.prompt_tokens / admitted:.0f} tokens, "
            f"{history:.0f}% from earlier turns",
        ),
    ]


def format_table(plan: PlanResult) -> str:
    """The headline numbers, then the paged pool against the contiguous baselines."""
    result = plan.paged
    s = result.summary()
    cfg = result.config
    sched = cfg.scheduler
    w = cfg.workload
    header = (
        f"kvblocks simulate: {s['num_requests']} requests at {w.request_rate:g}/s "
        f"({w.arrival}), {cfg.num_blocks} blocks x {cfg.block_size} tokens "
        f"(+{cfg.num_cpu_blocks} CPU), policy {sched.policy}, max_num_seqs "
        f"{sched.max_num_seqs}, max_num_batched_tokens {sched.max_num_batched_tokens}, "
        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}"
    )
    paged = plan.servers[0]
    rows: list[tuple[str, str]] = [
        *_workload_rows(plan),
        ("requests finished / rejected", _finished(s)),
        ("scheduling steps", f"{s['num_steps']}"),
        (
            "throughput, simulated clock",
            f"{s['simulated_requests_per_s']:.2f} req/s, "
            f"{s['simulated_output_tokens_per_s']:.0f} output tok/s "
            f"over the whole run, drain included ({s['simulated_time_s']:.1f} s simulated)",
        ),
        ("queueing delay p50 / p90 / p99", _percentiles(s, "queue_delay")),
        ("time to first token p50 / p90 / p99", _percentiles(s, "ttft")),
        ("time per output token p50 / p90 / p99", _percentiles(s, "tpot")),
        ("latency p50 / p90 / p99", _percentiles(s, "latency")),
        (
            "latency stable at this rate",
            "yes" if s["latency_stable"] else "NO: the queue grows with the trace",
        ),
        ("capacity (stable latency)", _capacity_text(paged)),
        (
            "scheduler throughput, wall clock",
            f"{s['scheduler_requests_per_s']:.0f} req/s, {s['scheduler_steps_per_s']:.0f} steps/s",
        ),
        (
            "schedule()+update() per step",
            f"mean {s['mean_step_us']:.0f} us, p99 {s['p99_step_us']:.0f} us",
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
    lines += ["", *_comparison(plan)]
    if "layer_mix" in s:
        lines += ["", *_layer_mix_lines(plan, s["layer_mix"])]
    if plan.tiered is not None:
        lines += ["", *_tier_comparison(plan)]
    return "\n".join(lines)


def _layer_mix_lines(plan: PlanResult, mix: dict[str, Any]) -> list[str]:
    """KV per sequence and capacity of per-layer-kind allocation against uniform."""
    block_size = plan.paged.config.block_size
    out = [
        f"Layer mix {mix['layers']} ({mix['num_layers']} layers): one block table per layer "
        "kind against uniform",
        f"allocation; a window-W layer holds min(len, W - 1 + step tokens) rounded out to "
        f"{block_size}-token",
        "blocks, a full layer every token (an accounting model: kvblocks.simulate.layer_mix):",
        "",
    ]
    for row in mix["per_sequence"]:
        kinds = ", ".join(f"{k} {v}" for k, v in row["blocks_per_layer"].items())
        out.append(
            f"  {row['context']} context, {row['seq_len']:,} tokens: "
            f"{row['grouped_layer_blocks']:,} layer-blocks vs {row['uniform_layer_blocks']:,} "
            f"uniform ({100 * row['grouped_over_uniform']:.1f}%; per layer: {kinds})"
        )
    out.append(
        f"  this trace's batches: mean {mix['mean_grouped_layer_blocks']:,.0f} layer-blocks "
        f"grouped vs {mix['mean_uniform_layer_blocks']:,.0f} uniform "
        f"({100 * mix['grouped_over_uniform']:.1f}%): "
        f"{mix['sequences_in_same_memory']:.2f}x the sequences in the same memory"
    )
    caps = {server.name: server.capacity for server in plan.servers}
    paged, grouped = caps.get("paged"), caps.get(GROUPED_SERVER)
    if paged is not None and grouped is not None and paged.requests_per_s > 0:
        out.append(
            f"  capacity: {grouped.requests_per_s:.2f} req/s grouped vs "
            f"{paged.requests_per_s:.2f} uniform "
            f"({grouped.requests_per_s / paged.requests_per_s:.2f}x, same trace and memory)"
        )
    return out


def _tier_comparison(plan: PlanResult) -> list[str]:
    """The paged server without and with the host tier, on the same trace and rate."""
    assert plan.tiered is not None
    cfg = plan.tiered.config
    cost = cfg.cost_model
    runs = [("paged", plan.paged.summary()), ("paged + host tier", plan.tiered.summary())]
    caps = {server.name: server.capacity for server in plan.servers}
    rows: list[tuple[str, list[str]]] = [
        (
            "prefix hit rate: GPU + host tier",
            [f"{100 * s['gpu_hit_rate']:.1f}% + {100 * s['host_hit_rate']:.1f}%" for _, s in runs],
        ),
        ("prefill tokens computed", [f"{s['prefill_tokens_computed']:,}" for _, s in runs]),
        (
            "blocks loaded / offloaded",
            [f"{s['blocks_loaded']:,} / {s['blocks_offloaded']:,}" for _, s in runs],
        ),
        (
            "transfers: GB / s on the link / s added",
            [
                f"{s['transfer_bytes'] / 1e9:.1f} GB / {s['transfer_s']:.2f} s / "
                f"{s['transfer_added_s']:.2f} s"
                for _, s in runs
            ],
        ),
        ("TTFT p50 / p99", [f"{_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])}" for _, s in runs]),
        ("latency stable at this rate", ["yes" if s["latency_stable"] else "NO" for _, s in runs]),
        (
            "throughput, simulated clock",
            [
                f"{s['simulated_requests_per_s']:.2f} req/s, "
                f"{s['simulated_output_tokens_per_s']:.0f} tok/s"
                for _, s in runs
            ],
        ),
    ]
    if all(caps.get(name) is not None for name, _ in runs):
        rows.append(
            (
                "capacity, req/s",
                [f"{caps[name].requests_per_s:.2f}" for name, _ in runs],  # type: ignore[union-attr]
            )
        )
    label_w = max(len(label) for label, _ in rows)
    widths = [
        max(len(name), *(len(cells[k]) for _, cells in rows)) for k, (name, _) in enumerate(runs)
    ]
    out = [
        f"What the host tier adds ({cfg.host_cache_blocks} host blocks, offload at "
        f"{cfg.host_offload}; loads and offloads charged at "
        f"{cost.block_bytes(cfg.block_size) / 2**20:.1f} MiB per block over "
        f"{cost.host_bandwidth_bytes_per_s / 1e9:g} GB/s; loads add to the step, "
        + (
            "write-through offloads overlap its compute):"
            if cfg.host_offload == "commit"
            else "offloads at eviction add too):"
        ),
        "",
        "  "
        + " " * label_w
        + "  "
        + "  ".join(name.rjust(w) for (name, _), w in zip(runs, widths, strict=True)),
    ]
    for label, cells in rows:
        row = "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
        out.append(f"  {label:<{label_w}}  {row}")
    return out


def _comparison(plan: PlanResult) -> list[str]:
    """Paged against contiguous reservation: same memory, limits, cost model and trace."""
    shown = {
        "contiguous max_tokens": "contiguous, max_tokens",
        "contiguous exact": "contiguous, exact (lower bound)",
    }
    names = [shown.get(server.name, server.name) for server in plan.servers]
    cells: list[list[str]] = []
    labels = [
        "at this rate: mean / peak batch (seqs)",
        "at this rate: TTFT p99",
        "at this rate: queueing delay p99",
        "at this rate: stable",
        "saturated: mean / peak batch (seqs)",
        "capacity, req/s",
    ]
    base = plan.servers[0].capacity
    for server in plan.servers:
        a, sat, cap = server.at_rate, server.saturated, server.capacity
        col = [
            f"{float(a['mean_batch_seqs']):.1f} / {float(a['peak_batch_seqs']):.0f}",
            _ms(float(a["ttft_p99_s"])),
            _ms(float(a["queue_delay_p99_s"])),
            "yes" if a["latency_stable"] else "NO",
        ]
        if sat is None or cap is None:
            col += ["-", "-"]
        else:
            ratio = ""
            if (
                server is not plan.servers[0]
                and base is not None
                and cap.requests_per_s > 0
                and not (base.trace_too_short or cap.trace_too_short)
                and not (base.lower_bound or cap.lower_bound)
                and not (base.rejected_share or cap.rejected_share)
            ):
                ratio = f" (paged {base.requests_per_s / cap.requests_per_s:.2f}x)"
            capacity = (
                "trace too short" if cap.trace_too_short else f"{cap.requests_per_s:.2f}{ratio}"
            )
            if cap.lower_bound:
                capacity = f">= {cap.requests_per_s:.2f} (never queued)"
            if cap.rejected_share >= 1:
                capacity = "none (all rejected)"
            elif cap.rejected_share > 0:
                capacity += f" ({100 * cap.rejected_share:.0f}% rejected)"
            col += [
                f"{float(sat['mean_batch_seqs']):.1f} / {float(sat['peak_batch_seqs']):.0f}",
                capacity,
            ]
        cells.append(col)
    label_w = max(len(x) for x in labels)
    widths = [max(len(n), *(len(c) for c in col)) for n, col in zip(names, cells, strict=True)]
    out = [
        "Paged pool against contiguous per-request reservation (same GPU memory, step limits,",
        "cost model and trace; contiguous reserves n * (prompt + max_tokens) at admission, or",
        "n * (prompt + actual output) for the lower bound, and shares nothing):",
        "",
        "  "
        + " " * label_w
        + "  "
        + "  ".join(n.rjust(wd) for n, wd in zip(names, widths, strict=True)),
    ]
    for i, label in enumerate(labels):
        row = "  ".join(col[i].rjust(wd) for col, wd in zip(cells, widths, strict=True))
        out.append(f"  {label:<{label_w}}  {row}")
    return out


def format_json(plan: PlanResult) -> str:
    """The summary, each server's numbers, capacity, and the configuration, as JSON.

    Strict JSON (RFC 8259): an infinite request rate (every conversation at t=0) is
    ``null``, and any other non-finite number raises ``ValueError`` instead of being
    written as ``Infinity`` or ``NaN``, which strict parsers reject.
    """
    result = plan.paged
    cfg = result.config
    w = cfg.workload
    servers = []
    for server in plan.servers:
        cap = server.capacity
        servers.append(
            {
                "name": server.name,
                "at_rate": server.at_rate,
                "saturated": server.saturated,
                "capacity": None
                if cap is None
                else {
                    "mode": cap.mode,
                    "requests_per_s": cap.requests_per_s,
                    "estimate_requests_per_s": cap.estimate_requests_per_s,
                    "probes": [{"rate": r, "stable": ok} for r, ok in cap.probes],
                    "trace_too_short": cap.trace_too_short,
                    "saturated": cap.saturated,
                    "rejected_share": cap.rejected_share,
                },
            }
        )
    doc: dict[str, Any] = {
        "summary": result.summary(),
        "servers": servers,
        "config": {
            "num_requests": w.num_requests,
            "request_rate": None if math.isinf(w.request_rate) else w.request_rate,
            "arrival": w.arrival,
            "seed": w.seed,
            "prompt_len": str(w.prompt_len),
            "output_len": str(w.output_len),
            "max_prompt_len": w.max_prompt_len,
            "max_output_len": w.max_output_len,
            "max_context_len": w.max_context_len,
            "system_prompt_share": w.system_prompt_share,
            "num_system_prompts": w.num_system_prompts,
            "system_prompt_len": w.system_prompt_len,
            "multi_turn_share": w.multi_turn_share,
            "max_turns": w.max_turns,
            "think_time_s": w.think_time_s,
            "parallel_share": w.parallel_share,
            "num_blocks": cfg.num_blocks,
            "block_size": cfg.block_size,
            "num_cpu_blocks": cfg.num_cpu_blocks,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "host_cache_blocks": 0 if plan.tiered is None else plan.tiered.config.host_cache_blocks,
            "host_offload": None if plan.tiered is None else plan.tiered.config.host_offload,
            "kv_bytes_per_token": cfg.cost_model.kv_bytes_per_token,
            "host_bandwidth_gbps": cfg.cost_model.host_bandwidth_bytes_per_s / 1e9,
            "policy": cfg.scheduler.policy,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "capacity": plan.capacity_mode,
            "layers": None if cfg.layer_mix is None else str(cfg.layer_mix),
        },
    }
    return json.dumps(doc, indent=2, allow_nan=False)
