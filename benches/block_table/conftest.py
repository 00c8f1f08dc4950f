"""Collects the decode-step times of the block-table benches and prints, at the end of
the session, the persistent-table step beside the full ``block_tables`` rebuild measured
in the same run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

# (shape, way) -> best seconds per decode step.
RESULTS: dict[tuple[str, str], float] = {}
#: The issue's target for the incremental step at 1,024 x 32k (release build).
TARGET_SECONDS = 100e-6


@pytest.fixture
def record(benchmark: Any) -> Any:
    """``record(shape, way)``: store the best (minimum) round: on a shared machine other
    processes only ever add time."""

    def store(shape: str, way: str) -> float:
        best = float(benchmark.stats.stats.min)
        RESULTS[(shape, way)] = best
        benchmark.extra_info.update({"shape": shape, "way": way, "seconds_per_step": best})
        return best

    return store


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print incremental vs rebuild per shape, with the ratio and the target."""
    shapes = sorted({s for s, _ in RESULTS})
    if not shapes:
        return
    tr = terminalreporter
    tr.section("kvblocks decode step: persistent block table vs full rebuild (same run)")
    tr.write_line(f"{'shape':<22}{'rebuild':>12}{'incremental':>14}{'ratio':>9}  target")
    for shape in shapes:
        old = RESULTS.get((shape, "rebuild"))
        new = RESULTS.get((shape, "incremental"))
        ratio = f"{old / new:8.1f}x" if old and new else "        -"
        target = ""
        if shape.endswith("32k") and new:
            met = "met" if new <= TARGET_SECONDS else "MISSED"
            target = f"<= {TARGET_SECONDS * 1e6:.0f} us {met}"
        tr.write_line(f"{shape:<22}{_us(old):>12}{_us(new):>14}{ratio}  {target}")


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} us"
