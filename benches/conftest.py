"""Benchmarks compare the core with the pure-Python reference model, which lives with the
test oracles in ``tests/oracle`` (it is not part of the installed package)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
