"""``kvblocks simulate``: a synthetic serving workload through the scheduler and block manager."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from kvblocks.cli.arg_types import (
    fraction,
    layer_mix,
    length_dist,
    name_flags,
    non_negative_float,
    non_negative_int,
    option_flags,
    positive_float,
    positive_int,
)
from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate.cost_model import (
    DEFAULT_HOST_BANDWIDTH_GBPS,
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_REMOTE_BANDWIDTH_GBPS,
)

if TYPE_CHECKING:
    from kvblocks.scheduler import SchedulerConfig
    from kvblocks.simulate import CostModel, WorkloadConfig

__all__ = ["add_parser", "run"]

_ROUTER_NAMES = ("round-robin", "least-loaded", "cache-aware")

_DEFAULT_RATE = 5.0
"""Default request rate: about 70% of the default server's capacity (~7 req/s), so
latency is stable and the report shows headroom."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="run a synthetic serving workload through the scheduler and block manager",
        description=(
            "Drive a synthetic ShareGPT-like workload (prompt/output length distributions, "
            "Poisson arrivals, shared system prompts, multi-turn conversations, some n > 1 "
            "requests) through the real scheduler and Rust block manager, with a linear "
            "cost model in place of the forward pass. Reports queueing delay, TTFT, TPOT "
            "and latency percentiles on the simulated clock, the capacity (req/s) at which "
            "latency stays stable, KV utilisation, prefix-cache hits, preemptions, and the "
            "batch size and throughput of contiguous per-request reservation "
            "(prompt + max_tokens) on the same memory. Lengths take lognormal:MEAN,SIGMA, "
            "fixed:N or uniform:LOW,HIGH."
        ),
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=positive_int, default=200, help="default: 200")
    w.add_argument(
        "--request-rate",
        type=positive_float,
        default=None,
        help="mean requests per simulated second (multi-turn turns included); 'inf' starts "
        f"every conversation at once (default {_DEFAULT_RATE:g}; with --instances/--router: "
        "inf, so throughput is the fleet's capacity)",
    )
    w.add_argument(
        "--arrival",
        choices=("poisson", "constant"),
        default="poisson",
        help="spacing of conversation starts (default: poisson)",
    )
    w.add_argument("--seed", type=non_negative_int, default=0, help="default: 0")
    w.add_argument(
        "--prompt-len",
        type=length_dist,
        default="lognormal:161,1.0",
        metavar="DIST",
        help="user message length (default lognormal:161,1.0, ShareGPT's mean)",
    )
    w.add_argument(
        "--output-len",
        type=length_dist,
        default="lognormal:338,0.8",
        metavar="DIST",
        help="generated tokens per sequence (default lognormal:338,0.8, ShareGPT's mean)",
    )
    w.add_argument("--max-prompt-len", type=positive_int, default=1024, help="default: 1024")
    w.add_argument("--max-output-len", type=positive_int, default=2048, help="default: 2048")
    w.add_argument(
        "--max-context-len",
        type=positive_int,
        default=4096,
        help="a conversation ends before a turn that would outgrow it (default 4096)",
    )
    w.add_argument(
        "--system-prompt-share",
        type=fraction,
        default=0.4,
        help="share of conversations that start with a shared system prompt (default 0.4)",
    )
    w.add_argument("--num-system-prompts", type=positive_int, default=4, help="default: 4")
    w.add_argument("--system-prompt-len", type=non_negative_int, default=256, help="default: 256")
    w.add_argument(
        "--multi-turn-share",
        type=fraction,
        default=0.25,
        help="share of conversations with several turns; each turn's prompt is the history "
        "plus a new message (default 0.25)",
    )
    w.add_argument(
        "--max-turns",
        type=positive_int,
        default=5,
        help="turns of a multi-turn conversation: uniform 2..N (default 5)",
    )
    w.add_argument(
        "--think-time",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="mean time from a turn's finish to the next turn's arrival, exponential (5)",
    )
    w.add_argument(
        "--parallel-share",
        type=fraction,
        default=0.05,
        help="share of single-turn requests with n = 2..4 samples (default 0.05)",
    )
    c = p.add_argument_group("block manager")
    c.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (16)")
    c.add_argument(
        "--num-blocks", type=positive_int, default=4096, help="GPU blocks incl. null (4096)"
    )
    c.add_argument("--num-cpu-blocks", type=non_negative_int, default=1024, help="default: 1024")
    c.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    c.add_argument(
        "--layers",
        type=layer_mix,
        default=None,
        metavar="MIX",
        help="the model's layer kinds, e.g. sliding:1024x5,full:1 (Gemma 3) or "
        "sliding:128x1,full:1 (gpt-oss): also report the KV per sequence and the capacity "
        "of one block table per layer kind against uniform allocation on the same trace "
        "(an accounting model: a window-W layer holds min(len, W - 1 + step tokens) "
        "rounded out to blocks, a full layer every token)",
    )
    h = p.add_argument_group(
        "host tier",
        "A host-memory tier below each GPU pool: evicted prefix blocks are offloaded to it and "
        "loaded back on a hit instead of recomputed. The report then runs the paged server "
        "(each router, in fleet mode) without and with the tier on the same trace. Each "
        "step's loads and offloads cost blocks x block bytes / bandwidth; loads and offloads at "
        "eviction add to the step, write-through offloads (commit) overlap its compute; nothing "
        "overlaps the previous step, so the tier's gain shown is a lower bound.",
    )
    h.add_argument(
        "--host-cache-blocks",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="host-tier blocks per instance (default 0: no tier)",
    )
    h.add_argument(
        "--host-offload",
        choices=("evict", "commit"),
        default=None,
        help="evict: copy a cached block to the tier when it is evicted; commit: "
        "write-through when it is cached (default: evict)",
    )
    h.add_argument(
        "--host-bandwidth-gbps",
        type=positive_float,
        default=None,
        metavar="GB/S",
        help=f"effective host<->GPU bandwidth (default {DEFAULT_HOST_BANDWIDTH_GBPS:g}: "
        "PCIe 4.0 x16 at ~80%%)",
    )
    h.add_argument(
        "--kv-bytes-per-token",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help=f"KV bytes per token, all layers (default {DEFAULT_KV_BYTES_PER_TOKEN}: a 7B "
        "fp16 model, 32 layers x K+V x 4096 x 2 bytes)",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--policy", choices=("fcfs", "priority", "lpm"), default="fcfs", help="default: fcfs"
    )
    s.add_argument("--max-num-seqs", type=positive_int, default=256, help="default: 256")
    s.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=2048, help="default: 2048"
    )
    s.add_argument(
        "--preemption-mode",
        choices=("auto", "recompute", "swap"),
        default="auto",
        help="auto: recompute single-sequence requests, swap multi-sequence ones",
    )
    f = p.add_argument_group(
        "fleet (cache-aware routing)",
        "N instances (each its own scheduler and block manager) behind a router fed by "
        "their KV events; one result row per router. The capacity options do not apply.",
    )
    f.add_argument(
        "--instances",
        type=positive_int,
        default=None,
        metavar="N",
        help="simulate a fleet of N instances behind --router",
    )
    f.add_argument(
        "--router",
        choices=(*_ROUTER_NAMES, "all"),
        default=None,
        help="round-robin, least-loaded, cache-aware, or all three (default with --instances: "
        "all; --router alone means --instances 1)",
    )
    f.add_argument(
        "--remote-tier-blocks",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="a remote tier of N blocks shared by all instances (one Valkey, modelled in "
        "process; needs --host-cache-blocks): offloaded blocks are written to it, a routed "
        "request's missing blocks are read from it. Adds a '+ host + remote' row per router "
        "(default 0: none)",
    )
    f.add_argument(
        "--remote-gbps",
        type=positive_float,
        default=None,
        metavar="GB/S",
        help=f"bandwidth of the remote tier's server link, which carries every instance's "
        f"reads and write-backs in turn (default {DEFAULT_REMOTE_BANDWIDTH_GBPS:g}: a 50 Gb/s "
        "link at ~80%%); a request joins its instance once its read arrived, a written "
        "block can be read once it crossed",
    )
    f.add_argument(
        "--remote-fetch-wait",
        type=non_negative_float,
        default=None,
        metavar="S",
        help="a request whose remote read would take longer than S seconds goes ahead "
        "without it and computes its blocks (default 1, the engine's fetch_wait_s)",
    )
    f.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        metavar="N",
        help="at most N conversations in progress, as N closed-loop clients (default: no limit)",
    )
    k = p.add_argument_group("capacity")
    k.add_argument(
        "--capacity",
        choices=("estimate", "search", "off"),
        default="estimate",
        help="estimate: each server's throughput when saturated (cheap, an upper bound); "
        "search: also bisect the highest rate whose queueing delay stays bounded (runs the "
        "trace ~7 times per server; a short trace can be too short to tell); off: neither "
        "(default: estimate)",
    )
    k.add_argument(
        "--saturation-requests",
        type=positive_int,
        default=500,
        help="requests in each saturated run (default 500)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    o.add_argument("--plot", metavar="PNG", help="write a timeline plot (matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run, flags=option_flags(p, {"think_time_s": "--think-time"}))
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``kvblocks simulate``; return the exit status."""
    from kvblocks.simulate import SimulationConfig, WorkloadConfig
    from kvblocks.simulate.planner import run_plan
    from kvblocks.simulate.report import format_json, format_table

    if args.num_blocks < 2:
        raise InvalidArgumentError("--num-blocks must be >= 2 (block 0 is the reserved null block)")
    if args.saturation_requests < 10:
        raise InvalidArgumentError("--saturation-requests must be >= 10")
    fleet = args.instances is not None or args.router is not None
    if args.max_concurrency is not None and not fleet:
        print(
            "kvblocks simulate: error: --max-concurrency needs --instances or --router "
            "(see kvblocks simulate --help)",
            file=sys.stderr,
        )
        return 2
    if args.layers is not None and fleet:
        print(
            "kvblocks simulate: error: --layers applies to one instance, not to "
            "--instances/--router (see kvblocks simulate --help)",
            file=sys.stderr,
        )
        return 2
    tier_error = _check_tier_options(args)
    if tier_error:
        print(
            f"kvblocks simulate: error: {tier_error} (see kvblocks simulate --help)",
            file=sys.stderr,
        )
        return 2
    if args.request_rate is None:
        args.request_rate = math.inf if fleet else _DEFAULT_RATE
    if args.plot is not None:  # "" too: a path naming no file is refused, not ignored
        from kvblocks.simulate.plot import check_plot_path

        # Before the run: a long simulation must not end in an unwritable path.
        check_plot_path(args.plot)
    try:
        workload = WorkloadConfig(
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            arrival=args.arrival,
            seed=args.seed,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            max_prompt_len=args.max_prompt_len,
            max_output_len=args.max_output_len,
            max_context_len=args.max_context_len,
            system_prompt_share=args.system_prompt_share,
            num_system_prompts=args.num_system_prompts,
            system_prompt_len=args.system_prompt_len,
            multi_turn_share=args.multi_turn_share,
            max_turns=args.max_turns,
            think_time_s=args.think_time,
            parallel_share=args.parallel_share,
        )
    except InvalidArgumentError as exc:
        # A combination of options no workload satisfies: a usage error, like argparse's.
        message = name_flags(str(exc), args.flags)
        print(
            f"kvblocks simulate: error: {message} (see kvblocks simulate --help)", file=sys.stderr
        )
        return 2
    if fleet:
        return _run_fleet(args, workload)
    config = SimulationConfig(
        workload=workload,
        scheduler=_scheduler_config(args),
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_cpu_blocks=args.num_cpu_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        host_cache_blocks=args.host_cache_blocks,
        host_offload=args.host_offload or "evict",
        cost_model=_cost_model(args),
        progress=not args.no_progress and not args.json,
        layer_mix=args.layers,
    )
    plan = run_plan(config, args.capacity, args.saturation_requests)
    print(format_json(plan) if args.json else format_table(plan))
    if args.plot is not None:
        from kvblocks.simulate.plot import write_plot

        write_plot(plan.paged, args.plot)
        if not args.json:
            print(f"\ntimeline written to {args.plot}")
    sys.stdout.flush()
    return 0


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler options, the same for every simulated instance."""
    from kvblocks.scheduler import SchedulerConfig

    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        policy=args.policy,
        preemption_mode=None if args.preemption_mode == "auto" else args.preemption_mode,
    )


def _run_fleet(args: argparse.Namespace, workload: WorkloadConfig) -> int:
    """``--instances`` / ``--router``: one fleet simulation per router, one table."""
    from kvblocks.simulate.fleet import FleetConfig, run_fleet
    from kvblocks.simulate.fleet_report import (
        format_fleet_json,
        format_fleet_table,
        write_fleet_plot,
    )

    routers = _ROUTER_NAMES if args.router in (None, "all") else (args.router,)
    tiers: list[tuple[int, int]] = [(0, 0)]
    if args.host_cache_blocks:
        tiers.append((args.host_cache_blocks, 0))
    if args.remote_tier_blocks:
        tiers.append((args.host_cache_blocks, args.remote_tier_blocks))
    results = []
    for name, (host_blocks, remote_blocks) in [(r, t) for r in routers for t in tiers]:
        config = FleetConfig(
            workload=workload,
            num_instances=args.instances or 1,
            router=name,
            scheduler=_scheduler_config(args),
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            num_cpu_blocks=args.num_cpu_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            host_cache_blocks=host_blocks,
            host_offload=args.host_offload or "evict",
            remote_tier_blocks=remote_blocks,
            remote_fetch_wait_s=1.0 if args.remote_fetch_wait is None else args.remote_fetch_wait,
            cost_model=_cost_model(args),
            max_concurrency=args.max_concurrency,
            progress=not args.no_progress and not args.json,
        )
        results.append(run_fleet(config))
    print(format_fleet_json(results) if args.json else format_fleet_table(results))
    if args.plot is not None:
        write_fleet_plot(results, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    sys.stdout.flush()
    return 0


def _check_tier_options(args: argparse.Namespace) -> str | None:
    """A usage error in the host- and remote-tier options, or ``None``."""
    for flag, value in (
        ("--remote-gbps", args.remote_gbps),
        ("--remote-fetch-wait", args.remote_fetch_wait),
    ):
        if value is not None and not args.remote_tier_blocks:
            return f"{flag} needs --remote-tier-blocks N (N > 0)"
    if args.remote_tier_blocks:
        if args.instances is None and args.router is None:
            return "--remote-tier-blocks needs --instances or --router (a fleet)"
        if not args.host_cache_blocks:
            return "--remote-tier-blocks needs --host-cache-blocks N (N > 0)"
    if args.host_cache_blocks == 0:
        for flag, value in (
            ("--host-offload", args.host_offload),
            ("--host-bandwidth-gbps", args.host_bandwidth_gbps),
            ("--kv-bytes-per-token", args.kv_bytes_per_token),
        ):
            if value is not None:
                return f"{flag} needs --host-cache-blocks N (N > 0)"
        return None
    if args.no_prefix_caching:
        return "--host-cache-blocks needs prefix caching (drop --no-prefix-caching)"
    return None


def _cost_model(args: argparse.Namespace) -> CostModel:
    from kvblocks.simulate import CostModel

    gbps = args.host_bandwidth_gbps or DEFAULT_HOST_BANDWIDTH_GBPS
    remote_gbps = args.remote_gbps or DEFAULT_REMOTE_BANDWIDTH_GBPS
    return CostModel(
        kv_bytes_per_token=args.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN,
        host_bandwidth_bytes_per_s=gbps * 1e9,
        remote_bandwidth_bytes_per_s=remote_gbps * 1e9,
    )
