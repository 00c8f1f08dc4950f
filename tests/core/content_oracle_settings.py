"""The budget, the draws and the coverage counters of the level (a) content oracle
(:mod:`core.content_oracle`).

Budget: ``ORACLE_EXAMPLES * ORACLE_STEPS`` random operations per run (at least 10,000),
multiplied by the environment variable ``KVBLOCKS_ORACLE_SCALE`` for long runs. The
counters are module state shared by every machine of the oracle (the grouped and state
machines too): each test clears the ones it asserts on before it runs.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

T = TypeVar("T")

SCALE = int(os.environ.get("KVBLOCKS_ORACLE_SCALE", "1"))
MIN_OPERATIONS = 10_000 * SCALE
ORACLE_EXAMPLES = 200 * SCALE
ORACLE_STEPS = 90

#: What the runs reached, summed over examples: operations that changed something, and
#: the events whose content effects the oracle exists to check.
COVERAGE: Counter[str] = Counter()

# A small vocabulary and a few shared stems make prefix-cache hits and duplicates common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4]]
NAMESPACES = [(None, None), ("salt", None), (None, 3)]
#: Columns of the persistent table: more than any table of a run can reach.
TABLE_WIDTH = 256
#: A sequence's retention priority until it is set.
DEFAULT_PRIORITY = 35
#: What ``prioritize`` sets: valid priorities and two out of range (refused, no change).
PRIORITIES = [0, 10, 35, 60, 100, -1, 101]
#: First token of one-off flood prompts: above the vocabulary, one per sequence id, so a
#: flood prompt shares no block with any other prompt.
FLOOD_TOKEN = 1000


#: ``st.sampled_from(range(n))`` by ``n``, built once (see :func:`pick`).
_INDICES: dict[int, st.SearchStrategy[int]] = {}


def pick(data: Any, items: Sequence[T]) -> T:
    """One of ``items``, drawn as its index: the same choice ``st.sampled_from(items)``
    makes (and shrinks the same way, to the first), without building, validating and
    labelling a new strategy for every draw (the lists change every step)."""
    n = len(items)
    index = _INDICES.get(n)
    if index is None:
        index = _INDICES[n] = st.sampled_from(range(n))
    return items[data.draw(index)]


def _oracle_settings(
    max_examples: int = ORACLE_EXAMPLES, attempt: int = 0, **overrides: Any
) -> settings:
    """The budget of one oracle run (``max_examples`` runs of ``ORACLE_STEPS`` steps, no
    deadline, no health checks), with further ``settings`` options in ``overrides``.

    ``attempt`` > 0 is a repeat because the budget or the coverage was not reached: it
    draws new examples even where the profile derandomizes (``CI=true``), whose repeats
    would replay the same draws and never reach what the first run missed (the draws
    depend on what the manager does, so a change elsewhere can move them)."""
    if attempt:
        overrides.setdefault("derandomize", False)
    return settings(
        max_examples=max_examples,
        stateful_step_count=ORACLE_STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **overrides,
    )
