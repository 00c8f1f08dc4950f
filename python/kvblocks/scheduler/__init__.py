"""Continuous-batching scheduler over a :class:`kvblocks.KVCacheManager`.

Requests go in with :meth:`Scheduler.add_request`; every step :meth:`Scheduler.schedule`
returns a :class:`SchedulerOutput` (flat NumPy arrays for one forward pass), the engine
runs it and hands a :class:`ModelStepResult` to :meth:`Scheduler.update`, which appends
the sampled tokens, applies stop conditions and beam-search forks, and returns a
:class:`StepOutputs`: every request's new tokens of the step (deltas, for streaming) and
the finished requests' final records, with their :class:`RequestMetrics`.
See docs/scheduler-engine-interface.md.
"""

from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler.config import SchedulerConfig
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.scheduler.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
)
from kvblocks.scheduler.scheduler import Scheduler
from kvblocks.scheduler.step_outputs import DecodeDeltas, StepOutputs

__all__ = [
    "CompletionOutput",
    "DecodeDeltas",
    "FinishReason",
    "ModelStepResult",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepOutputs",
]
