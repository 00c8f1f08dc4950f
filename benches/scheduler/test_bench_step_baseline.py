"""The 1,024-decode scheduler step against a baseline build, in one run (issue 19.5).

Set ``KVBLOCKS_BASELINE_PYTHON`` to the interpreter of another build of kvblocks (e.g. a
venv made by ``make build`` in an unpacked ``git archive`` of the previous commit). The
test runs ``decode_step_probe.py`` alternately under that interpreter and under this
one, several times each, so that both sides share the machine's load; it checks that
both returned the same outputs (the probes' digests) and reports the medians of the
steps' CPU time (``time.thread_time_ns``: the machine's other load shows less there than
in wall-clock time) and their ratio. The pytest-benchmark figure is the current code's
step in this process.

Target (issue 19.5): <= 100 us per step at 1,024 running decode requests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

RUNNING = 1024
STEPS = 200  # per probe run; the first 20 are dropped as warm-up
ALTERNATIONS = 5
PROBE = Path(__file__).with_name("decode_step_probe.py")
_spec = importlib.util.spec_from_file_location("decode_step_probe", PROBE)
assert _spec is not None and _spec.loader is not None
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def _probe(python: str) -> dict[str, Any]:
    done = subprocess.run(
        [python, str(PROBE), str(STEPS), str(RUNNING)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_decode_step_against_baseline(benchmark: Any) -> None:
    """schedule()+update() at 1,024 decodes: current code against a baseline build."""
    baseline = os.environ.get("KVBLOCKS_BASELINE_PYTHON")
    if not baseline:
        pytest.skip("set KVBLOCKS_BASELINE_PYTHON to a baseline build's interpreter")
    times: dict[str, list[int]] = {"current": [], "baseline": []}
    digests: dict[str, set[str]] = {"current": set(), "baseline": set()}
    for _ in range(ALTERNATIONS):
        for side, python in (("baseline", baseline), ("current", sys.executable)):
            report = _probe(python)
            times[side].extend(report["cpu_times_ns"][20:])
            digests[side].add(report["digest"])
    assert len(digests["current"]) == 1  # deterministic
    assert digests["current"] == digests["baseline"]  # the same outputs, step for step
    med = {side: statistics.median(t) / 1e3 for side, t in times.items()}
    best = {side: float(np.percentile(t, 10)) / 1e3 for side, t in times.items()}
    benchmark.group = "scheduler step, decode, 1024 running, against a baseline build"
    benchmark.extra_info.update(
        current_median_us=round(med["current"], 1),
        baseline_median_us=round(med["baseline"], 1),
        median_ratio=round(med["baseline"] / med["current"], 2),
        current_p10_us=round(best["current"], 1),
        baseline_p10_us=round(best["baseline"], 1),
        p10_ratio=round(best["baseline"] / best["current"], 2),
    )
    print(f"\n{benchmark.extra_info}")
    # The current code's step in this process, for pytest-benchmark's table.
    sched = probe.build(RUNNING, 100)
    tokens, logprobs = probe.draws(0, RUNNING)
    benchmark.pedantic(
        probe.step, args=(sched, tokens, logprobs), rounds=60, iterations=1, warmup_rounds=5
    )
