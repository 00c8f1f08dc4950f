"""Run the ``kvblocks`` command line in a subprocess, as a user would (tracebacks included)."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvblocks.cli ARGV`` in a subprocess, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
