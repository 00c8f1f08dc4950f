"""kvblocks.tiers without its optional dependencies: one ImportError naming the extra."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = """
import json, sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
report = {{}}
try:
    {statement}
except ImportError as exc:
    report = {{"type": type(exc).__name__, "message": str(exc)}}
print(json.dumps(report))
"""


def _run(blocked: set[str], statement: str) -> dict:
    script = f"BLOCKED = {sorted(blocked)!r}\n" + textwrap.dedent(
        _SCRIPT.format(statement=statement)
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_local_tiers_need_no_valkey() -> None:
    assert _run({"valkey"}, "from kvblocks.tiers import DiskTier, HostTier, KVLayout") == {}


@pytest.mark.parametrize(
    ("blocked", "statement", "message"),
    [
        ({"valkey"}, "from kvblocks.tiers import ValkeyTier", "pip install 'kvblocks[tiers]'"),
        ({"torch"}, "import kvblocks.tiers", "kvblocks.tiers needs torch"),
    ],
)
def test_missing_extra_is_one_import_error(blocked: set[str], statement: str, message: str) -> None:
    report = _run(blocked, statement)
    assert report.get("type") == "ImportError" and message in report["message"], report
