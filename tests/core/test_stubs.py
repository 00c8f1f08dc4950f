"""The API contract ``kvblocks/_core.pyi`` matches the compiled extension."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_stubs_match_the_compiled_module() -> None:
    """``mypy.stubtest`` finds no difference between _core.pyi and the extension."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvblocks._core"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
