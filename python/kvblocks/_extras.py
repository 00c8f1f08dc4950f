"""Import guard for the optional dependencies behind the ``[torch]`` / ``[engine]`` extras.

A subpackage that needs an optional dependency imports it in ``try`` and hands the
``ModuleNotFoundError`` to :func:`raise_missing_extra`, so that a missing dependency is one
:class:`ImportError` naming the extra to install instead of a raw ``No module named 'torch'``
from deep inside the package.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NoReturn

__all__ = ["raise_missing_extra"]


def raise_missing_extra(
    exc: ModuleNotFoundError, subpackage: str, extra: str, modules: Collection[str]
) -> NoReturn:
    """Raise ImportError ``"<subpackage> needs <module>: pip install 'kvblocks[<extra>]'"``.

    Only a missing module among ``modules`` (top-level names) is translated; any other missing
    module — a dependency of the dependency, a typo in kvblocks — re-raises ``exc`` unchanged.
    """
    missing = (exc.name or "").split(".")[0]
    if missing not in modules:
        raise exc
    raise ImportError(
        f"{subpackage} needs {missing}: pip install 'kvblocks[{extra}]'", name=missing
    ) from None
