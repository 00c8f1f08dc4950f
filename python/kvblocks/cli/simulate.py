"""``kvblocks simulate``: a synthetic serving workload through the scheduler and block manager."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvblocks.cli.arg_types import non_negative_int, positive_float, positive_int
from kvblocks.errors import InvalidArgumentError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="run a synthetic serving workload through the scheduler and block manager",
        description=(
            "Drive a synthetic ShareGPT-like workload (lognormal prompt/output lengths, "
            "Poisson arrivals, shared system prompts, some n > 1 requests) through the real "
            "scheduler and Rust block manager, with a linear cost model in place of the "
            "forward pass. Prints throughput, scheduling time per step, KV utilisation, "
            "prefix-cache hit rate, preemptions, and the memory contiguous per-request "
            "reservation (prompt + max_tokens) would need for the same batches."
        ),
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=positive_int, default=1000, help="default: 1000")
    w.add_argument(
        "--request-rate",
        type=positive_float,
        default=20.0,
        help="mean arrivals per simulated second, Poisson; 'inf' sends all at once (default 20)",
    )
    w.add_argument("--seed", type=non_negative_int, default=0, help="default: 0")
    c = p.add_argument_group("block manager")
    c.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (16)")
    c.add_argument(
        "--num-blocks", type=positive_int, default=4096, help="GPU blocks incl. null (4096)"
    )
    c.add_argument("--num-cpu-blocks", type=non_negative_int, default=1024, help="default: 1024")
    c.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
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
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    o.add_argument("--plot", metavar="PNG", help="write a timeline plot (matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``kvblocks simulate``; return the exit status."""
    from kvblocks.scheduler import SchedulerConfig
    from kvblocks.simulate import SimulationConfig, WorkloadConfig, run_simulation
    from kvblocks.simulate.report import format_json, format_table

    if args.num_blocks < 2:
        raise InvalidArgumentError("--num-blocks must be >= 2 (block 0 is the reserved null block)")
    if args.plot:
        from kvblocks.simulate.plot import check_plot_path

        # Before the run: a long simulation must not end in an unwritable path.
        check_plot_path(args.plot)
    config = SimulationConfig(
        workload=WorkloadConfig(
            num_requests=args.num_requests, request_rate=args.request_rate, seed=args.seed
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            policy=args.policy,
            preemption_mode=None if args.preemption_mode == "auto" else args.preemption_mode,
        ),
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_cpu_blocks=args.num_cpu_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        progress=not args.no_progress and not args.json,
    )
    result = run_simulation(config)
    print(format_json(result) if args.json else format_table(result))
    if args.plot:
        from kvblocks.simulate.plot import write_plot

        write_plot(result, args.plot)
        if not args.json:
            print(f"\ntimeline written to {args.plot}")
    sys.stdout.flush()
    return 0
