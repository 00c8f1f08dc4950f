"""``kvblocks simulate`` end to end on small workloads, plus the top-level CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvblocks.cli import main

SMALL = ["--num-requests", "60", "--request-rate", "50", "--num-blocks", "256", "--no-progress"]


def test_table_report(capsys) -> None:
    assert main(["simulate", *SMALL]) == 0
    out = capsys.readouterr().out
    for label in (
        "requests finished / rejected",
        "throughput, simulated clock",
        "schedule()+update() per step",
        "KV memory utilisation",
        "prefix-cache hit rate",
        "preemptions",
        "contiguous reservation",
        "memory paging saves",
    ):
        assert label in out
    assert "60 / 0" in out


def test_json_report_is_consistent(capsys) -> None:
    assert main(["simulate", *SMALL, "--json", "--policy", "lpm", "--seed", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["summary"]
    assert doc["config"]["policy"] == "lpm" and doc["config"]["seed"] == 3
    assert s["num_finished"] == 60 and s["generated_tokens"] > 0
    assert 0.0 < s["peak_kv_usage"] <= 1.0
    assert s["peak_used_blocks"] <= s["usable_blocks"]
    # Contiguous reservation holds prompt + max_tokens for every sequence: never less.
    assert s["mean_contiguous_blocks"] > s["mean_used_blocks"] > 0
    assert 0.0 < s["memory_saved_by_paging"] < 1.0
    assert s["prefix_hit_rate"] > 0.0  # the workload shares system prompts


def test_pressure_shows_preemptions_and_no_prefix_caching_shows_no_hits(capsys) -> None:
    argv = [*SMALL[:-3], "--num-blocks", "96", "--request-rate", "1000", "--no-progress"]
    assert main(["simulate", *argv, "--json", "--no-prefix-caching"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert s["prefix_hit_rate"] == 0.0
    assert s["preemptions_recompute"] + s["preemptions_swap"] > 0
    assert s["num_finished"] + s["num_rejected"] == 60


def test_plot_writes_a_png(tmp_path: Path, capsys) -> None:
    path = tmp_path / "timeline.png"
    assert main(["simulate", *SMALL, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "timeline written" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--num-requests", "0"],
        ["simulate", "--request-rate", "-1"],
        ["simulate", "--policy", "lifo"],
        ["simulate", "--block-size", "x"],
        ["simulate", "--bogus"],
        ["nope"],
    ],
)
def test_bad_options_exit_non_zero_with_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err


def test_runtime_errors_are_one_line_too(capsys) -> None:
    assert main(["simulate", "--num-blocks", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvblocks simulate: error:") and len(err.splitlines()) == 1


def test_help_of_every_subcommand(capsys) -> None:
    for argv in (["--help"], ["simulate", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    out = capsys.readouterr().out
    assert "simulate" in out and "--num-requests" in out and "--prompt-ids" in out


def test_console_module_runs_in_a_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", "simulate", "--num-requests", "10", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["num_finished"] == 10


def test_a_broken_generate_module_does_not_break_simulate(monkeypatch, capsys) -> None:
    import kvblocks.cli

    monkeypatch.setitem(sys.modules, "kvblocks.cli.generate", None)  # import fails
    monkeypatch.delattr(kvblocks.cli, "generate", raising=False)
    assert main(["simulate", "--num-requests", "5", "--no-progress"]) == 0
    assert main(["generate"]) == 1
    assert "unavailable" in capsys.readouterr().err
