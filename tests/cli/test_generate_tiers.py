"""``kvblocks generate --disk-tier DIR`` / ``--valkey-url URL``: a remote tier below the host
tier, shared across processes; real restarts (one subprocess per run) and a real server."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_run import run_cli

pytest.importorskip("torch")

from kvblocks.tiers.weights import RACY_WINDOW_NS

PROMPT = ",".join(str(t) for t in range(1, 65))  # four 16-token blocks of the tiny model
BASE = ["generate", "--device", "cpu", "--prompt-ids", PROMPT, "--max-tokens", "4", "--json"]
TIER = [*BASE, "--host-cache-blocks", "16"]


def _run(*argv: str) -> dict[str, Any]:
    proc = run_cli(*argv)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    doc["stderr"] = proc.stderr
    return doc


def _tokens(doc: dict[str, Any]) -> list[int]:
    return list(doc["outputs"][0]["completions"][0]["token_ids"])


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """The prompt's tokens without any tier."""
    return _tokens(_run(*BASE))


def _check_shared(first: dict[str, Any], second: dict[str, Any], reference: list[int]) -> None:
    """The first process computed the prompt and wrote its blocks; the second, a new
    process, loaded the three full blocks before the last token and computed the rest."""
    assert _tokens(first) == _tokens(second) == reference
    assert first["stats"]["remote"]["published_blocks"] >= 3
    assert first["outputs"][0]["num_cached_tokens"] == 0
    assert first["stats"]["engine"]["computed_tokens"] == 64 + 3
    assert second["stats"]["remote"]["imported_blocks"] == 3
    assert second["outputs"][0]["num_cached_tokens"] == 48
    assert second["stats"]["cache"]["host_loads"] == 3
    assert second["stats"]["engine"]["computed_tokens"] == 16 + 3


# Two CLI processes (~8 s); the fast tier keeps the engine-level restart
# (test_disk_tier_engine.py::test_a_restarted_process_loads_the_prefix_from_disk).
@pytest.mark.slow
def test_a_disk_tier_carries_a_prefix_across_processes(tmp_path: Path, reference) -> None:
    argv = [*TIER, "--disk-tier", str(tmp_path / "kv")]
    first = _run(*argv)
    second = _run(*argv)
    _check_shared(first, second, reference)
    # Another model id is another namespace: nothing is shared with it.
    other = _run(*argv, "--model-id", "someone-else")
    assert other["stats"]["remote"]["imported_blocks"] == 0 and _tokens(other) == reference


def test_a_valkey_server_shares_a_prefix_and_a_dead_one_reads_as_misses(reference) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the server helper
    from tiers.valkey_server import running_server

    with running_server() as server:
        url = f"valkey://127.0.0.1:{server.port}/0"
        first = _run(*TIER, "--valkey-url", url)
        second = _run(*TIER, "--valkey-url", url)
        _check_shared(first, second, reference)
        assert not first["stderr"] and not second["stderr"]
        server.kill()
        # The server is gone: one warning line, every block computed, the same tokens.
        dead = _run(*TIER, "--valkey-url", url)
    lines = dead["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks generate: warning: "), lines
    assert "unreachable" in lines[0]
    assert _tokens(dead) == reference
    assert dead["stats"]["remote"]["imported_blocks"] == 0
    assert dead["stats"]["engine"]["computed_tokens"] == 64 + 3


# A time well in the past: a file last changed then is not "racy" for the digest cache.
OLD_NS = 1_600_000_000 * 10**9


def _save_tiny(directory: Path, seed: int) -> Path:
    """The tiny Llama with weights of ``seed`` as a checkpoint, its files dated in the past
    (so that the digest of the first version is cached)."""
    from kvblocks.engine.loader import save_checkpoint
    from kvblocks.engine.tiny import build_tiny_model

    save_checkpoint(build_tiny_model(seed=seed), directory)
    for f in directory.iterdir():
        os.utime(f, ns=(OLD_NS, OLD_NS))
    return directory


# The disk tier in the fast tier, a real Valkey server in the slow one (both in `make test`).
@pytest.fixture(params=["disk", pytest.param("valkey", marks=pytest.mark.slow)])
def tier_args(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """``--disk-tier DIR`` or ``--valkey-url`` of a real server, for one test."""
    if request.param == "disk":
        yield ["--disk-tier", str(tmp_path / "kv")]
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the server helper
    from tiers.valkey_server import running_server

    with running_server() as server:
        yield ["--valkey-url", f"valkey://127.0.0.1:{server.port}/0"]


def test_a_checkpoint_overwritten_in_place_never_reads_the_old_blocks(
    tmp_path: Path, tier_args: list[str]
) -> None:
    """Issue 16: W1 saved to DIR and run, then W2 saved to DIR (same names, sizes and
    modification times) and run: no block of W1 is imported, W2's own tokens are printed."""
    model = tmp_path / "model"
    _save_tiny(model, seed=0)
    # Past the racy window (its files' change time is now): the run caches W1's digest.
    time.sleep(RACY_WINDOW_NS / 1e9)
    first = _run(*TIER, "--model", str(model), *tier_args)
    assert first["stats"]["remote"]["published_blocks"] >= 3
    _save_tiny(model, seed=1)
    alone = _tokens(_run(*BASE, "--model", str(model)))
    second = _run(*TIER, "--model", str(model), *tier_args)
    assert second["stats"]["remote"]["imported_blocks"] == 0
    assert _tokens(second) == alone != _tokens(first)
    # W2 is now in the tier: a third run of it loads its blocks.
    third = _run(*TIER, "--model", str(model), *tier_args)
    assert third["stats"]["remote"]["imported_blocks"] == 3 and _tokens(third) == alone


def test_two_copies_of_a_checkpoint_share(tmp_path: Path) -> None:
    """The weights name the blocks, not the directory (tests/engine checks Valkey too)."""
    tier_args = ["--disk-tier", str(tmp_path / "kv")]
    first = _run(*TIER, "--model", str(_save_tiny(tmp_path / "a", seed=0)), *tier_args)
    second = _run(*TIER, "--model", str(_save_tiny(tmp_path / "b", seed=0)), *tier_args)
    assert second["stats"]["remote"]["imported_blocks"] == 3
    assert _tokens(second) == _tokens(first)


def test_trust_model_id_is_the_opt_out_by_name(tmp_path: Path) -> None:
    """Other weights under one trusted id share (the documented danger of the opt-out);
    without the flag the same id is only an addition to the weights' digest."""
    tier_args = ["--disk-tier", str(tmp_path / "kv"), "--model-id", "my-model"]
    a = str(_save_tiny(tmp_path / "a", seed=0))
    b = str(_save_tiny(tmp_path / "b", seed=1))
    _run(*TIER, "--model", a, *tier_args)
    assert _run(*TIER, "--model", b, *tier_args)["stats"]["remote"]["imported_blocks"] == 0
    _run(*TIER, "--model", a, *tier_args, "--trust-model-id")
    trusted = _run(*TIER, "--model", b, *tier_args, "--trust-model-id")
    assert trusted["stats"]["remote"]["imported_blocks"] == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--host-cache-blocks", "4", "--valkey-url", "http://x"], "--valkey-url 'http://x'"),
        (["--host-cache-blocks", "4", "--disk-tier", "FILE"], "--disk-tier"),
        (["--disk-tier", "DIR"], "needs a host tier"),
        (["--host-cache-blocks", "4", "--disk-tier", "DIR", "--valkey-url", "valkey://h"],
         "not allowed with"),
        (["--host-cache-blocks", "4", "--disk-tier", "DIR", "--disk-tier-blocks", "0"],
         "--disk-tier-blocks"),
        (["--host-cache-blocks", "4", "--disk-tier-blocks", "8"], "--disk-tier-blocks needs"),
        (["--host-cache-blocks", "4", "--model-id", "m"], "--model-id needs"),
        (["--host-cache-blocks", "4", "--trust-model-id"], "--trust-model-id needs --disk"),
        (["--host-cache-blocks", "4", "--disk-tier", "DIR", "--trust-model-id"],
         "--trust-model-id needs --model-id"),
        (["--host-cache-blocks", "4", "--valkey-url", "valkey://h", "--disk-tier-blocks", "8"],
         "--disk-tier-blocks needs --disk-tier"),
    ],
)  # fmt: skip
def test_bad_tier_options_are_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    argv = [str(file) if a == "FILE" else str(tmp_path / "kv") if a == "DIR" else a for a in argv]
    proc = run_cli("generate", "--device", "cpu", "--max-tokens", "2", *argv)
    assert proc.returncode in (1, 2) and not proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks generate: error: "), lines
    assert message in lines[0], lines
