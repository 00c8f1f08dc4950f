"""The package is layered: no module of ``kvblocks`` imports, at the top of the file, inside a
function or under ``TYPE_CHECKING``, a module that imports it back (directly or through
others).

A lazy or annotation-only import hides a cycle from Python but not from the reader: the
module below then depends on the one above (issue 17 parts 4 and 7). The scan reads the
source (every ``import`` node, wherever it sits), so it needs none of the optional
dependencies.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import kvblocks

PACKAGE_DIR = Path(kvblocks.__file__).parent


def module_files(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, whether it is a package's ``__init__``).

    A ``.pyi`` stub without a ``.py`` beside it (the compiled ``_core``) is a module too.
    """
    root = package_dir.parent
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(package_dir.rglob("*.py")) + sorted(package_dir.rglob("*.pyi")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found.setdefault(".".join(parts), (path, is_package))
    return found


def _known(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(module: str, modules: dict[str, tuple[Path, bool]]) -> set[str]:
    """The package's modules ``module`` imports anywhere in its source, itself excluded.

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else
    ``pkg`` (a name its ``__init__`` defines or re-exports); relative imports are resolved
    against the module's package.
    """
    path, is_package = modules[module]
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_known(alias.name, modules) or "")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else _known(base, modules) or "")
    return found - {"", module}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_files(package_dir)
    return {name: imported_modules(name, modules) for name in modules}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components (Tarjan's, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _cycle_through(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest import path ``start -> ... -> start`` inside one component."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is on no cycle")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path ``a -> ... -> a``) per group of modules that import each other."""
    return [
        _cycle_through(component[0], set(component), graph)
        for component in _strongly_connected(graph)
        if len(component) > 1
    ]


def test_no_kvblocks_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 100 and "kvblocks._core" in graph
    assert "kvblocks.engine.config" in graph["kvblocks.engine.hf_config"]  # the scan sees
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_scan_sees_lazy_annotation_relative_and_package_imports(tmp_path: Path) -> None:
    # A scan that missed an import kind would pass on a cyclic package.
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.leaf import y\n",
            "pkg/leaf.py": "def g():\n    from pkg import NAME\n",
            "pkg/low.py": "def f():\n    from pkg.sub import high\n    return high\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/high.py": "from ..low import f\n",
            "pkg/mid.py": "import pkg.top.deep\n",
            "pkg/top/__init__.py": "",
            "pkg/top/deep.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.mid import x\n"
            ),
            "pkg/a.py": "from . import b\n",
            "pkg/b.py": "from .c import z\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/alone.py": "import pkg.leaf\nfrom pkg.sub import high\n",
            "pkg/_ext.pyi": "from pkg import ext_user\n",
            "pkg/ext_user.py": "from pkg._ext import thing\n",
        },
    )
    cycles = {tuple(cycle) for cycle in import_cycles(import_graph(package))}
    assert cycles == {
        ("pkg", "pkg.leaf", "pkg"),
        ("pkg.low", "pkg.sub.high", "pkg.low"),
        ("pkg.mid", "pkg.top.deep", "pkg.mid"),
        ("pkg.a", "pkg.b", "pkg.c", "pkg.a"),
        ("pkg._ext", "pkg.ext_user", "pkg._ext"),
    }
