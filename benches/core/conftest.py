"""Collects per-operation times of the core benchmarks and prints the Rust/reference
ratio table at the end of the session (ratios of best-round times measured in the same
run)."""

from __future__ import annotations

from typing import Any

import pytest

# (trace, implementation) -> seconds per operation of that trace.
RESULTS: dict[tuple[str, str], float] = {}
# trace -> human description of "one operation".
UNITS: dict[str, str] = {}


@pytest.fixture
def record(benchmark: Any) -> Any:
    """``record(trace, impl, ops, unit)``: store the best (minimum) time per operation.

    The minimum, not the mean: on a shared machine other processes only ever add time,
    so the fastest round is the least disturbed estimate of each side.
    """

    def store(trace: str, impl: str, ops: int, unit: str) -> float:
        per_op = benchmark.stats.stats.min / ops
        RESULTS[(trace, impl)] = per_op
        UNITS[trace] = unit
        benchmark.extra_info.update({"trace": trace, "impl": impl, "seconds_per_op": per_op})
        return per_op

    return store


# The targets: every trace at least this much faster than the reference ...
MIN_RATIO = 20.0
# ... and the decode step (trace "c") under this many seconds (release build).
MAX_SECONDS = {"c": 200e-6}


def _target(trace: str, rust: float | None, ref: float | None) -> str:
    """The trace's targets and whether this run met them."""
    limit = MAX_SECONDS.get(trace.split(":")[0])
    text = f">={MIN_RATIO:.0f}x" + (f", <{_fmt(limit)}" if limit else "")
    if not rust or not ref:
        return f"{text} -"
    met = ref / rust >= MIN_RATIO and (limit is None or rust < limit)
    return f"{text} {'met' if met else 'MISSED'}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the ratio table: reference time / Rust time per trace, against the targets."""
    traces = sorted({t for t, _ in RESULTS})
    if not traces:
        return
    tr = terminalreporter
    tr.section("kvblocks core: Rust manager vs pure-Python reference (same run)")
    tr.write_line(
        f"{'trace':<34}{'unit':<34}{'rust':>12}{'reference':>12}{'ratio':>9}  {'target':<20}"
    )
    for trace in traces:
        rust = RESULTS.get((trace, "rust"))
        ref = RESULTS.get((trace, "reference"))
        ratio = f"{ref / rust:8.1f}x" if rust and ref else "       -"
        tr.write_line(
            f"{trace:<34}{UNITS[trace]:<34}{_fmt(rust):>12}{_fmt(ref):>12}{ratio:>9}  "
            f"{_target(trace, rust, ref):<20}"
        )


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"
