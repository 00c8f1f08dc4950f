"""The ``kvblocks`` command line: ``kvblocks simulate`` and ``kvblocks generate``.

Each subcommand module provides ``add_parser(subparsers)`` and ``run(args) -> int``;
heavy imports (torch, the engine, matplotlib) happen only inside ``run``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvblocks.cli.arg_types import name_flags
from kvblocks.errors import KVBlocksError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit with 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from kvblocks import __version__
    from kvblocks.cli import simulate

    parser = _Parser(
        prog="kvblocks",
        description="kvblocks: a KV-cache block manager for LLM serving engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvblocks {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulate.add_parser(subparsers)
    _add_generate(subparsers)
    return parser


def _add_generate(subparsers: Any) -> None:
    """Register ``generate``; if its module cannot be imported, a stub that says why.

    The module imports torch and the engine only inside ``run``, but a broken or partial
    installation must not take ``kvblocks simulate`` down with it.
    """
    try:
        from kvblocks.cli import generate
    except ImportError as exc:
        reason = str(exc)
        stub = subparsers.add_parser("generate", help="(unavailable) run the paged engine")

        def unavailable(args: argparse.Namespace) -> int:
            print(f"kvblocks generate: error: unavailable ({reason})", file=sys.stderr)
            return 1

        stub.set_defaults(run=unavailable)
        return
    generate.add_parser(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvblocks`` console script; returns the exit status.

    Bad options exit with argparse's one-line error (status 2); a
    :class:`kvblocks.KVBlocksError` raised while running is printed as one line
    (status 1) instead of a traceback.
    """
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except KVBlocksError as exc:
        message = name_flags(str(exc), getattr(args, "flags", {}))
        print(f"kvblocks {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
