"""Every exception kvblocks raises is a :class:`kvblocks.KVBlocksError`.

``errors.py`` promises that catching one type catches everything kvblocks raises on bad
input or a bad state. This scans the package's source (AST, no imports) for ``raise``
statements and checks that each raised class is a ``KVBlocksError`` subclass defined in
the package, or one of the few built-ins Python's protocols require.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "kvblocks"

# Built-ins that must stay what they are: the protocol or the reader expects exactly them.
ALLOWED_ANYWHERE = {
    "NotImplementedError",  # an abstract method
    "StopIteration",  # the iterator protocol
    "AssertionError",  # an unreachable branch, never bad input
}
# Built-ins allowed only inside a function of this name (module __getattr__ and a
# descriptor's __get__ on the class must raise AttributeError) or in this module (_extras
# reports a missing optional dependency as the ImportError pip users recognise, with
# ``name`` set; argparse's ``type=`` callables report a bad option value with its
# ArgumentTypeError).
ALLOWED_IN_FUNCTION = {
    "__getattr__": {"AttributeError"},
    "__get__": {"AttributeError"},
}
ALLOWED_IN_MODULE = {"_extras.py": {"ImportError"}, "arg_types.py": {"ArgumentTypeError"}}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _kvblocks_errors() -> set[str]:
    """Names of the classes defined in the package that derive from KVBlocksError."""
    bases: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(_name(b) or "" for b in node.bases)
    errors = {"KVBlocksError"}
    grew = True
    while grew:
        grew = False
        for name, parents in bases.items():
            if name not in errors and parents & errors:
                errors.add(name)
                grew = True
    return errors


def _name(node: ast.expr | None) -> str | None:
    """The class name a raise or base expression names (``X``, ``m.X``, ``X(...)``)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


class _Raises(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.functions: list[str] = []
        self.found: list[tuple[int, str, str]] = []  # (line, class, enclosing function)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Raise(self, node: ast.Raise) -> None:
        name = _name(node.exc)
        # A bare ``raise`` or ``raise exc`` re-raises something already caught; a class
        # is named in CapWords.
        if name is not None and name[:1].isupper():
            self.found.append((node.lineno, name, self.functions[-1] if self.functions else ""))
        self.generic_visit(node)


def _escapes() -> list[str]:
    errors = _kvblocks_errors()
    escapes = []
    for path in _sources():
        visitor = _Raises(path.name)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for line, name, function in visitor.found:
            allowed = (
                ALLOWED_ANYWHERE
                | ALLOWED_IN_FUNCTION.get(function, set())
                | ALLOWED_IN_MODULE.get(path.name, set())
            )
            if name not in errors and name not in allowed:
                escapes.append(f"{path.relative_to(PACKAGE)}:{line}: raise {name}")
    return escapes


def test_every_raised_exception_is_a_kvblocks_error() -> None:
    escapes = _escapes()
    assert not escapes, "raises of non-KVBlocksError classes:\n" + "\n".join(escapes)


def test_the_scan_sees_the_package() -> None:
    # A scan that finds nothing proves nothing: the package raises its own errors in
    # many places, and the hierarchy has its known members.
    errors = _kvblocks_errors()
    assert {"InvalidArgumentError", "CorruptBlockError", "SimulationError"} <= errors
    raised = sum(len(_collect(path)) for path in _sources())
    assert raised > 50


def _collect(path: Path) -> list[tuple[int, str, str]]:
    visitor = _Raises(path.name)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found
