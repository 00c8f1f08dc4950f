"""``kvblocks simulate`` run as a user runs it: a child interpreter, its output captured."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvblocks.cli simulate *argv``; the exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, "-m", "kvblocks.cli", "simulate", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects ``NaN``, ``Infinity`` and ``-Infinity``, which Python
    writes by default but strict parsers (JavaScript's, Go's, jq's) refuse."""
    return json.loads(text, parse_constant=_reject_constant)
