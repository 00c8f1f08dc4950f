"""``kvblocks simulate`` run as a user runs it: a child interpreter, its output captured."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvblocks.cli simulate *argv``; the exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", "simulate", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
