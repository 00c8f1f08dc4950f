"""Modules stay small enough to read (issue 17's bound; the guide's ~600-line limit).

The two classes that once carried most of the code (``Scheduler`` at 1,525 lines, ``LLM`` at
887) were split by responsibility; these bounds keep the split from growing back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvblocks

PACKAGE_DIR = Path(kvblocks.__file__).parent
MAX_MODULE_LINES = 600
MAX_SCHEDULER_LINES = 400


def too_long(package_dir: Path) -> dict[str, int]:
    """Every module of ``package_dir`` over the limit, with its line count."""
    sizes = {p: len(p.read_text().splitlines()) for p in sorted(package_dir.rglob("*.py"))}
    return {str(p.relative_to(package_dir)): n for p, n in sizes.items() if n > MAX_MODULE_LINES}


def test_no_module_is_over_the_limit():
    assert len(list(PACKAGE_DIR.rglob("*.py"))) > 50  # the scan finds the package
    assert not too_long(PACKAGE_DIR), f"over {MAX_MODULE_LINES} lines"


def test_the_scan_catches_a_long_module_in_a_subpackage(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert too_long(tmp_path) == {"sub/long.py": MAX_MODULE_LINES + 1}


def _class_lines(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_the_scheduler_class_keeps_only_the_api_and_the_phases():
    lines = _class_lines(PACKAGE_DIR / "scheduler" / "scheduler.py", "Scheduler")
    assert 100 < lines <= MAX_SCHEDULER_LINES
