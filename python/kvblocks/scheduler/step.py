"""Per-step state, passed explicitly: what one ``schedule()`` is deciding
(:class:`StepState`) and what one ``update()`` is collecting (:class:`UpdateState`).

Nothing of a step lives on the scheduler between its phases: each helper that preempts,
swaps, admits or ends a request is handed the step's record and writes there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvblocks.scheduler.request import CompletionOutput, RequestOutput
from kvblocks.scheduler.request_state import RequestState
from kvblocks.scheduler.seq_table import Rows

__all__ = ["Chunk", "StepState", "UpdateState"]


class Chunk(NamedTuple):
    """A prefill chunk: ``length`` tokens of ``state.tokens`` from ``start``."""

    state: RequestState
    start: int
    length: int


@dataclass
class StepState:
    """The step ``schedule()`` is building.

    Attributes:
        now: the clock, read once at the start: every event of the step shares it.
        step: the step's number (``counters.num_steps`` while it is scheduled).
        budget: tokens the step may still compute.
        num_seqs: sequences scheduled so far.
        preempted: something was preempted (or ended for lack of room): nothing comes
            back from swap and nothing new is admitted in this step.
        num_loads: host-tier loads queued by this step's admissions.
        chunks: prefill chunks scheduled so far.
        ended: final records of requests ended for lack of room, returned by the step's
            ``update()``.
    """

    now: float
    step: int
    budget: int
    num_seqs: int = 0
    preempted: bool = False
    num_loads: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    ended: list[RequestOutput] = field(default_factory=list)


@dataclass
class UpdateState:
    """What ``update()`` collects while it applies a step's results.

    Attributes:
        now: the clock, read once before anything changed.
        step: ``counters.num_steps`` (the step whose results these are).
        finished: final records of the requests that finished.
        events: records of sequences that started or finished, by request id then
            completion index (decode tokens are kept as columns instead).
        add_rows: decode-table rows to add (prompts completed, forks, beams).
        remove_rows: decode-table rows to remove (finished sequences, beams replaced).
    """

    now: float
    step: int
    finished: list[RequestOutput]
    events: dict[str, dict[int, CompletionOutput]] = field(default_factory=dict)
    add_rows: list[Rows] = field(default_factory=list)
    remove_rows: list[npt.NDArray[np.int64]] = field(default_factory=list)
