"""Value types for the subcommands' ``argparse`` options.

Each converts one option string or raises :class:`argparse.ArgumentTypeError`, which
argparse turns into a one-line usage error naming the option. Also the options' flags by
the library parameter each sets, for errors the library raises later.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvblocks.simulate.layer_mix import LayerMix

__all__ = [
    "MAX_THREADS",
    "fraction",
    "layer_mix",
    "length_dist",
    "name_flags",
    "non_negative_float",
    "non_negative_int",
    "option_flags",
    "positive_float",
    "positive_int",
    "thread_count",
    "token_ids",
]

#: A library parameter's name as messages write it: snake_case with at least one underscore.
_PARAMETER = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def option_flags(
    parser: argparse.ArgumentParser, aliases: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``{destination: its long flag}`` of ``parser``'s options, and ``aliases``: the
    library parameters an option sets under another name (``think_time_s``)."""
    flags = {
        action.dest: max(action.option_strings, key=len)
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }
    return {**flags, **(aliases or {})}


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` (a library error's) with each parameter an option sets written as that
    option's flag: the user typed ``--max-context-len``, not ``max_context_len``."""
    return _PARAMETER.sub(lambda m: flags.get(m.group(0), m.group(0)), message)


MAX_THREADS = 1024
"""Most torch CPU threads ``--threads`` takes: more made libgomp fail to create threads
(exit 1) or crash the process (SIGSEGV at 100000)."""


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def thread_count(text: str) -> int:
    """An integer in ``[1, MAX_THREADS]``."""
    value = _int_at_least(text, 1, f"an integer in [1, {MAX_THREADS}]")
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_THREADS}], got {value}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (``inf`` allowed, ``nan`` not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in ``[0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text}")
    return value


def length_dist(text: str) -> Any:
    """A token-length distribution: ``lognormal:MEAN,SIGMA``, ``fixed:N`` or
    ``uniform:LOW,HIGH`` (:class:`kvblocks.simulate.workload.LengthDist`)."""
    from kvblocks.errors import InvalidArgumentError
    from kvblocks.simulate.workload import LengthDist

    try:
        return LengthDist.parse(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def layer_mix(text: str) -> LayerMix:
    """A model's layer kinds such as ``sliding:1024x5,full:1`` (see ``LayerMix.parse``)."""
    from kvblocks.errors import InvalidArgumentError
    from kvblocks.simulate.layer_mix import LayerMix as Mix

    try:
        return Mix.parse(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def token_ids(text: str) -> list[int]:
    """Comma-separated non-negative token ids such as ``1,2,3``.

    Every field must be an id: an empty one (``1,,2``, a leading or trailing comma) is
    rejected rather than skipped, since it most likely stands for a missing id.
    """
    try:
        # int() rejects an empty or blank field, so "1,,2" fails here.
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}"
        ) from None
    if not ids or any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(
            f"expected one or more non-negative token ids such as 1,2,3, got {text!r}"
        )
    return ids
