"""The public API follows one naming rule (docs/development.md, "Layering and naming").

The checks read the source (the package's modules and the compiled module's stub), so they
cover every class, optional dependencies or not: a name that breaks the rule fails here
rather than in a review.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvblocks

PACKAGE_DIR = Path(kvblocks.__file__).parent


def public_methods(package_dir: Path) -> Iterator[tuple[str, str, ast.FunctionDef]]:
    """``(file, class, method)`` for every public method of every public class."""
    for path in sorted(package_dir.rglob("*.py")) + sorted(package_dir.rglob("*.pyi")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
                continue
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    yield str(path.relative_to(package_dir)), cls.name, node


def rule_breaks(package_dir: Path) -> list[tuple[str, str, str]]:
    """``(file, Class.method, why)`` for every public method that breaks the rule."""
    found = []
    for where, cls, fn in public_methods(package_dir):
        returns = ast.unparse(fn.returns) if fn.returns is not None else None
        takes_args = len(fn.args.args) > 1 or bool(fn.args.kwonlyargs or fn.args.vararg)
        why = None
        if fn.name == "close" and returns != "bool":
            why = f"returns {returns}: close() returns a bool"
        elif fn.name.startswith("get_") and fn.name != "get_many":
            why = "queries are nouns, no get_ prefix"
        elif fn.name.startswith("has_") and takes_args:
            why = "membership is `in` (__contains__)"
        elif fn.name.startswith("abort") and cls in _REQUEST_HOLDERS and fn.name != "abort_request":
            why = "an action on a request is <verb>_request"
        if why is not None:
            found.append((where, f"{cls}.{fn.name}", why))
    return found


_REQUEST_HOLDERS = {"Scheduler", "EngineCore", "LLM"}


def test_the_public_api_follows_the_naming_rule() -> None:
    methods = {f"{cls}.{fn.name}" for _, cls, fn in public_methods(PACKAGE_DIR)}
    assert {"LLM.abort_request", "HostTier.close", "KVCacheManager.num_free_blocks"} <= methods
    breaks = rule_breaks(PACKAGE_DIR)
    assert not breaks, "\n".join(f"{w}: {m}: {why}" for w, m, why in breaks)


def test_the_check_catches_each_kind_of_break(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(
        "class Tier:\n"
        "    def close(self) -> None: ...\n"
        "class Scheduler:\n"
        "    def get_num_requests(self) -> int: ...\n"
        "    def abort(self, request_id: str) -> bool: ...\n"
        "    def has_unfinished_requests(self) -> bool: ...\n"
        "    def get_many(self, keys: list[bytes]) -> list[bytes]: ...\n"
        "class _Private:\n"
        "    def close(self) -> None: ...\n"
    )
    (tmp_path / "stub.pyi").write_text(
        "class Manager:\n    def has_sequence(self, seq_id: int) -> bool: ...\n"
    )
    assert [(w, m) for w, m, _ in rule_breaks(tmp_path)] == [
        ("mod.py", "Tier.close"),
        ("mod.py", "Scheduler.get_num_requests"),
        ("mod.py", "Scheduler.abort"),
        ("stub.pyi", "Manager.has_sequence"),
    ]
