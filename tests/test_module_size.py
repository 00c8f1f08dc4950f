"""Modules stay small enough to read (the guide's ~600-line limit; issue 17's bound).

Every source file of the project counts, in every language: the package, the Rust crates,
the CUDA kernels and their emulator, the tests and the benchmarks. The two classes that once
carried most of the code (``Scheduler`` at 1,525 lines, ``LLM`` at 887) were split by
responsibility; these bounds keep the splits from growing back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvblocks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = Path(kvblocks.__file__).parent
MAX_MODULE_LINES = 600
MAX_SCHEDULER_LINES = 400
SOURCE_DIRS = ("python", "rust", "cuda", "tests", "benches")
SUFFIXES = frozenset({".py", ".rs", ".cu", ".cuh", ".h", ".cpp"})
# Build outputs and environments that may sit inside the source directories.
SKIP_DIRS = frozenset({"target", "build", "__pycache__", ".venv"})
# Not counted: ``.pyi`` stubs, since a compiled module's names must all be in its one stub
# (``kvblocks/_core.pyi`` mirrors the whole extension module), and links (the package's
# ``ops/_cuda/*.cu`` point at ``cuda/``, counted there).


def source_files(root: Path) -> list[Path]:
    """Every source file under ``root``'s :data:`SOURCE_DIRS`."""
    found = []
    for top in SOURCE_DIRS:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root)
            if SKIP_DIRS.intersection(rel.parts) or path.is_symlink() or not path.is_file():
                continue
            if path.suffix in SUFFIXES:
                found.append(path)
    return found


def too_long(root: Path) -> dict[str, int]:
    """Every source file under ``root`` over the limit, with its line count."""
    sizes = {p: len(p.read_text(errors="replace").splitlines()) for p in source_files(root)}
    return {str(p.relative_to(root)): n for p, n in sizes.items() if n > MAX_MODULE_LINES}


def test_no_module_is_over_the_limit():
    files = source_files(ROOT)
    # The scan finds every language, and the package it tests.
    assert {p.suffix for p in files} == SUFFIXES
    assert sum(1 for p in files if PACKAGE_DIR.resolve() in p.resolve().parents) > 50
    assert not too_long(ROOT), f"over {MAX_MODULE_LINES} lines"


def test_the_scan_catches_a_long_module_in_any_language(tmp_path):
    long = "x\n" * (MAX_MODULE_LINES + 1)
    for rel in ("python/kvblocks/sub/long.py", "rust/core/src/long.rs", "cuda/emu/long.h",
                "tests/short.py", "benches/target/long.rs", "rust/stub.pyi"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n" * MAX_MODULE_LINES if "short" in rel else long)
    (tmp_path / "cuda" / "link.cu").symlink_to(tmp_path / "cuda" / "emu" / "long.h")
    assert too_long(tmp_path) == {
        "python/kvblocks/sub/long.py": MAX_MODULE_LINES + 1,
        "rust/core/src/long.rs": MAX_MODULE_LINES + 1,
        "cuda/emu/long.h": MAX_MODULE_LINES + 1,
    }


def _class_lines(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_the_scheduler_class_keeps_only_the_api_and_the_phases():
    lines = _class_lines(PACKAGE_DIR / "scheduler" / "scheduler.py", "Scheduler")
    assert 100 < lines <= MAX_SCHEDULER_LINES
