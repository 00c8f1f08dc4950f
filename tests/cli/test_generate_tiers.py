"""``kvblocks generate --disk-tier DIR`` / ``--valkey-url URL``: a remote tier below the host
tier, shared across processes; real restarts (one subprocess per run) and a real server."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_run import run_cli

pytest.importorskip("torch")

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
