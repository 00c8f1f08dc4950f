"""``kvblocks simulate``'s workload, capacity and report options, run as a user runs them."""

from __future__ import annotations

import json

import pytest

from .cli_runner import loads_strict
from .cli_runner import run_cli as _cli

SMALL = ["--num-requests", "40", "--num-blocks", "512", "--saturation-requests", "60"]


def test_workload_options_reach_the_trace() -> None:
    proc = _cli(
        *SMALL,
        *("--prompt-len", "fixed:32", "--output-len", "uniform:4,8", "--arrival", "constant"),
        *("--multi-turn-share", "1", "--max-turns", "3", "--think-time", "0.5"),
        *("--system-prompt-share", "0", "--parallel-share", "0", "--request-rate", "3"),
        *("--capacity", "off", "--json"),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    cfg, s = doc["config"], doc["summary"]
    assert cfg["prompt_len"] == "fixed:32" and cfg["output_len"] == "uniform:4,8"
    assert cfg["multi_turn_share"] == 1.0 and cfg["max_turns"] == 3
    assert cfg["think_time_s"] == 0.5 and cfg["arrival"] == "constant"
    assert s["num_finished"] == 40
    # Every conversation has 2..3 turns, so most prompts carry earlier turns.
    assert s["history_tokens"] > 0 and s["prefix_hit_rate"] > 0.3
    assert all(server["capacity"] is None for server in doc["servers"])
    assert s["generated_tokens"] <= 40 * 8


def test_json_is_strict_with_an_infinite_rate() -> None:
    # json.dumps wrote the rate as the bare token Infinity, which strict parsers refuse.
    proc = _cli(*SMALL, "--request-rate", "inf", "--capacity", "off", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    doc = loads_strict(proc.stdout)
    assert doc["config"]["request_rate"] is None  # every conversation at t=0
    assert doc["summary"]["num_finished"] == 40


def test_report_shows_percentiles_capacity_and_the_baselines() -> None:
    proc = _cli(*SMALL, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in (
        "queueing delay p50 / p90 / p99",
        "time to first token p50 / p90 / p99",
        "time per output token p50 / p90 / p99",
        "latency stable at this rate",
        "capacity (stable latency)",
        "saturation estimate; --capacity search",
        "contiguous, max_tokens",
        "contiguous, exact (lower bound)",
        "saturated: mean / peak batch (seqs)",
        "capacity, req/s",
    ):
        assert label in out, label


def test_json_has_every_server_and_capacity() -> None:
    proc = _cli(*SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    names = [server["name"] for server in doc["servers"]]
    assert names == ["paged", "contiguous max_tokens", "contiguous exact"]
    caps = [server["capacity"]["requests_per_s"] for server in doc["servers"]]
    assert all(cap > 0 for cap in caps)
    for server in doc["servers"]:
        for key in ("ttft_p99_s", "tpot_p50_s", "queue_delay_p90_s", "mean_batch_seqs"):
            assert key in server["at_rate"] and key in server["saturated"]
    # The exact-size reservation bounds contiguous from below: never fewer in the batch.
    fair, exact = doc["servers"][1]["saturated"], doc["servers"][2]["saturated"]
    assert exact["peak_reserved_tokens"] <= 511 * 16 and fair["peak_reserved_tokens"] <= 511 * 16


def test_capacity_search_lists_its_probes() -> None:
    proc = _cli(*SMALL, "--capacity", "search", "--json", "--num-requests", "60")
    assert proc.returncode == 0, proc.stderr
    paged = json.loads(proc.stdout)["servers"][0]["capacity"]
    assert paged["mode"] == "search" and len(paged["probes"]) >= 2
    stable = [p["rate"] for p in paged["probes"] if p["stable"]]
    assert paged["requests_per_s"] == (max(stable) if stable else 0.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-len", "lognormal:abc"], "--prompt-len: expected lognormal:MEAN,SIGMA"),
        (["--output-len", "weibull:1,2"], "--output-len: expected lognormal:MEAN,SIGMA"),
        (["--prompt-len", "uniform:9,3"], "--prompt-len: uniform needs 0 <= low <= high"),
        (["--multi-turn-share", "1.5"], "--multi-turn-share"),
        (["--system-prompt-share", "-0.1"], "--system-prompt-share"),
        (["--think-time", "-1"], "--think-time"),
        (["--think-time", "inf"], "--think-time"),
        (["--capacity", "maybe"], "--capacity"),
        (["--arrival", "bursty"], "--arrival"),
        (["--max-turns", "0"], "--max-turns"),
        (["--saturation-requests", "x"], "--saturation-requests"),
        (["--max-context-len", "100"], "--max-context-len (100) must hold"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    proc = _cli(*argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kvblocks simulate: error:") and message in err, err
    assert proc.stdout == ""
