"""The continuous-batching scheduler (API skeleton; the implementation follows)."""

from __future__ import annotations

from typing import Any

from kvblocks.scheduler.config import SchedulerConfig
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.scheduler.request import Request, RequestOutput

__all__ = ["Scheduler"]


class Scheduler:
    """Continuous-batching scheduler over a block manager (see the package docstring)."""

    def __init__(self, manager: Any, config: SchedulerConfig | None = None) -> None:
        self.manager = manager
        self.config = config if config is not None else SchedulerConfig()
        self.stats_history: list[dict[str, float]] = []

    def add_request(self, request: Request) -> None:
        """Queue a request (raises InvalidArgumentError/DuplicateSequenceError on bad input)."""
        raise NotImplementedError

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort an unfinished request; return its output (reason "abort") or None if unknown."""
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        """True while some request is waiting, running or swapped."""
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        """Build the next step's batch."""
        raise NotImplementedError

    def update(self, output: SchedulerOutput, result: ModelStepResult) -> list[RequestOutput]:
        """Apply the engine's results for ``output``; return the requests that finished."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Counters of the latest step."""
        raise NotImplementedError
