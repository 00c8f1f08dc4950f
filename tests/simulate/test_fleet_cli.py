"""``kvblocks simulate --instances N --router ...``, run as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_runner import loads_strict
from .cli_runner import run_cli as _cli

TINY = [
    *("--num-requests", "40", "--num-blocks", "256", "--block-size", "8"),
    *("--prompt-len", "fixed:40", "--output-len", "fixed:10", "--max-prompt-len", "64"),
    *("--max-output-len", "64", "--max-context-len", "512", "--system-prompt-share", "0"),
    *("--multi-turn-share", "1", "--max-turns", "4", "--think-time", "0.05"),
    *("--parallel-share", "0", "--no-progress"),
]


def test_all_routers_json() -> None:
    proc = _cli(*TINY, "--instances", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = loads_strict(proc.stdout)  # strict JSON: the infinite rate is null, not Infinity
    assert doc["config"]["num_instances"] == 4
    assert doc["config"]["request_rate"] is None  # fleet default: every conversation at t=0
    rows = {r["router"]: r for r in doc["routers"]}
    assert list(rows) == ["round-robin", "least-loaded", "cache-aware"]
    for r in rows.values():
        assert r["num_finished"] == 40 and sum(r["requests_per_instance"]) == 40
        assert r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
    assert rows["cache-aware"]["prefix_hit_rate"] > 2 * rows["round-robin"]["prefix_hit_rate"]


def test_one_router_table_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "fleet.png"
    proc = _cli(
        *TINY, "--instances", "2", "--router", "cache-aware", "--max-concurrency", "4",
        "--plot", str(png),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2 instances" in out and "4 concurrent conversations" in out
    assert "cache-aware" in out and "round-robin" not in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_remote_tier_adds_a_row_per_router() -> None:
    tiers = ["--host-cache-blocks", "64", "--host-offload", "commit", "--num-blocks", "64"]
    remote = ["--remote-tier-blocks", "4096", "--remote-gbps", "2.5", "--remote-fetch-wait", "2"]
    proc = _cli(*TINY, *tiers, *remote, "--instances", "4", "--router", "round-robin", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"]["remote_tier_blocks"] == 4096
    assert doc["config"]["remote_fetch_wait_s"] == 2.0
    assert doc["config"]["cost_model"]["remote_bandwidth_bytes_per_s"] == 2.5e9
    rows = doc["routers"]
    assert [(r["host_cache_blocks"], r["remote_tier_blocks"]) for r in rows] == [
        (0, 0),
        (64, 0),
        (64, 4096),
    ]
    assert rows[2]["remote_blocks_imported"] > 0 and rows[1]["remote_blocks_imported"] == 0
    assert rows[2]["prefix_hit_rate"] > rows[1]["prefix_hit_rate"]
    table = _cli(*TINY, *tiers, *remote, "--instances", "4", "--router", "round-robin")
    assert table.returncode == 0, table.stderr
    assert "round-robin + host + remote vs round-robin + host:" in table.stdout
    assert "remote tier of 4096 blocks shared by all instances" in table.stdout
    assert "2.5 GB/s" in table.stdout


def test_router_alone_means_one_instance() -> None:
    proc = _cli(*TINY, "--router", "round-robin", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"]["num_instances"] == 1 and len(doc["routers"]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--instances", "0"], "--instances"),
        (["--instances", "two"], "--instances"),
        (["--router", "random"], "--router"),
        (["--instances", "2", "--max-concurrency", "0"], "--max-concurrency"),
        (["--max-concurrency", "4"], "--max-concurrency needs --instances"),
        (["--instances", "2", "--remote-tier-blocks", "64"], "needs --host-cache-blocks"),
        (["--host-cache-blocks", "8", "--remote-tier-blocks", "64"], "needs --instances"),
        (["--instances", "2", "--remote-gbps", "5"], "--remote-gbps needs --remote-tier"),
        (["--instances", "2", "--remote-fetch-wait", "1"], "--remote-fetch-wait needs"),
        (["--instances", "2", "--remote-tier-blocks", "-1"], "--remote-tier-blocks"),
    ],
)
def test_bad_fleet_options_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    proc = _cli(*argv)
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kvblocks simulate: error:") and message in err, err
    assert proc.stdout == ""


def test_unwritable_plot_fails_before_the_run() -> None:
    proc = _cli(*TINY, "--instances", "2", "--plot", "/nonexistent-dir/x.png")
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1 and "plot folder" in err, err
    assert proc.stdout == ""
