"""What a client hands the scheduler (:class:`Request`) and what it gets back
(:class:`RequestOutput`, one :class:`CompletionOutput` per returned sequence, with the
request's :class:`RequestMetrics`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams
from kvblocks.validation import (
    RETENTION_PRIORITY_MAX,
    check_int,
    check_number,
    check_optional_int,
)

__all__ = ["CompletionOutput", "FinishReason", "Request", "RequestMetrics", "RequestOutput"]

_MAX_TOKEN_ID = 2**32


class FinishReason(str, enum.Enum):
    """Why a sequence stopped. A ``str`` enum: ``FinishReason.EOS == "eos"``."""

    LENGTH = "length"
    """Reached ``max_tokens``, or could not grow: the sequence alone (the beams of a beam
    search together) needs more blocks than the whole pool has."""
    STOP = "stop"
    """Sampled one of ``stop_token_ids``."""
    EOS = "eos"
    """Sampled the request's ``eos_token_id`` (and ``ignore_eos`` is off)."""
    ABORT = "abort"
    """Aborted by :meth:`Scheduler.abort_request`."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, reason: FinishReason | str) -> FinishReason:
        """``reason`` as a :class:`FinishReason`.

        Raises:
            InvalidArgumentError: a value outside the enum (a caller error).
        """
        try:
            return cls(reason)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"unknown finish reason {reason!r}") from None


@dataclass
class Request:
    """One generation request.

    Attributes:
        request_id: unique among the scheduler's unfinished requests.
        prompt_token_ids: the prompt, non-empty; stored as a read-only ``int64`` array.
        sampling_params: generation parameters.
        arrival_time: seconds on the caller's clock (any monotonic clock); orders fcfs and
            breaks ties in the other policies. ``None``: the scheduler's step counter at
            admission is used, so requests keep the order they were added in.
        priority: smaller is served first under the ``"priority"`` policy (an int64).
        cache_salt: prefix-cache namespace (blocks are shared only within one salt).
        lora_id: LoRA adapter; also a prefix-cache namespace.
        eos_token_id: the model's end-of-sequence token; ``None`` disables EOS stops.
        retention_priority: how long the request's prefix blocks stay in the host tier,
            an int in ``[0, 100]`` (TensorRT-LLM's scale): lower priorities are evicted
            first (see ``KVCacheManager.set_retention_priority``). ``None``: the
            manager's default, 35.
    """

    request_id: str
    prompt_token_ids: npt.NDArray[np.int64] | list[int] | tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | bytes | None = None
    lora_id: int | None = None
    eos_token_id: int | None = None
    retention_priority: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"request_id must be a non-empty str, got {self.request_id!r}"
            )
        if not isinstance(self.sampling_params, SamplingParams):
            raise InvalidArgumentError(
                "sampling_params must be a SamplingParams, got "
                f"{type(self.sampling_params).__name__}"
            )
        try:
            prompt = np.asarray(self.prompt_token_ids)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: prompt_token_ids must be a 1-D sequence of ints"
            ) from exc
        if prompt.ndim != 1 or (prompt.size and not np.issubdtype(prompt.dtype, np.integer)):
            raise InvalidArgumentError(
                f"request {self.request_id!r}: prompt_token_ids must be a 1-D sequence of ints, "
                f"got shape {prompt.shape} dtype {prompt.dtype}"
            )
        if prompt.size == 0:
            raise InvalidArgumentError(f"request {self.request_id!r}: the prompt is empty")
        if int(prompt.min()) < 0 or int(prompt.max()) >= _MAX_TOKEN_ID:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: token ids must be in [0, 2**32)"
            )
        prompt = prompt.astype(np.int64, copy=True)
        prompt.flags.writeable = False
        self.prompt_token_ids = prompt
        where = f"request {self.request_id!r}: "
        # Generated tokens are compared with it: a float or a str would never match.
        self.eos_token_id = check_optional_int(
            self.eos_token_id,
            where + "eos_token_id",
            minimum=0,
            maximum=_MAX_TOKEN_ID - 1,
            expected="None or an int in [0, 2**32)",
            numpy=True,
        )
        if self.arrival_time is not None:
            # The order key of fcfs: a NaN or an infinity would misplace it in the queue.
            self.arrival_time = check_number(
                self.arrival_time,
                where + "arrival_time",
                expected="a finite number or None",
                numpy=True,
            )
        # Running requests keep the priority in an int64 column of the decode table.
        check_int(
            self.priority,
            where + "priority",
            minimum=-(2**63),
            maximum=2**63 - 1,
            expected="an int that fits in int64",
        )
        check_optional_int(
            self.retention_priority,
            where + "retention_priority",
            minimum=0,
            maximum=RETENTION_PRIORITY_MAX,
            expected="an int in [0, 100] or None",
        )
        check_optional_int(
            self.lora_id, where + "lora_id", minimum=0, expected="a non-negative int or None"
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)


@dataclass
class CompletionOutput:
    """One returned sequence of a request, as of one step.

    Attributes:
        index: 0..n-1; with beam search, the rank of the beam (0 = best score).
        token_ids: generated tokens (prompt excluded; a stop/EOS token is included) once
            the sequence has finished (``finish_reason`` set); empty while it runs, when
            the step's tokens are in ``new_token_ids`` (the scheduler does not copy a
            running sequence's history every step).
        cumulative_logprob: sum of the log-probs of the generated tokens, as reported by
            the engine (``ModelStepResult.sampled_logprobs`` / ``topk_logprobs``).
        finish_reason: why it stopped; ``None`` while still running.
        new_token_ids: the tokens this sequence generated in the step whose
            ``Scheduler.update`` returned this record (the delta); concatenated over the
            steps they give ``token_ids``. Empty in the final record of a sequence that
            finished in an earlier step, or that was aborted or ended without a new
            token. Beam search streams nothing: its final record carries the whole beam
            (``new_token_ids == token_ids``), since beams are re-ranked until the end.
        num_tokens: tokens generated so far (``len(token_ids)`` once finished).
    """

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason | None
    new_token_ids: list[int] = field(default_factory=list)
    num_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)

    @property
    def finished(self) -> bool:
        """The sequence has stopped."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request, on the scheduler's clock (``Scheduler(clock=)``).

    Attributes:
        arrival_time: ``Request.arrival_time`` when given (it must then be on the
            scheduler's clock), else the clock at ``add_request``.
        first_scheduled_time: the clock when the request was first admitted (its first
            prefill chunk scheduled); ``None`` before.
        first_token_time: the clock at the ``update`` that produced its first token(s).
        finished_time: the clock when it finished or was aborted.
        num_preemptions: times it was preempted (recompute or swap).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        num_generated_tokens: tokens of the returned sequences once finished (the
            longest sequence's count, which is what TPOT divides by).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival to first admission."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: arrival to the first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """TPOT: mean time between tokens after the first (``None`` under two tokens)."""
        if (
            self.finished_time is None
            or self.first_token_time is None
            or self.num_generated_tokens < 2
        ):
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one request, or what it produced in one step.

    ``Scheduler.update`` returns one per request that produced tokens (or finished) in
    the step: ``finished`` False with the running sequences' ``new_token_ids``, or the
    final record (``finished`` True, every sequence's full ``token_ids``).

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt.
        outputs: the returned sequences, ordered by ``index``: all ``n`` of them when
            ``finished``, else those that produced a token or finished in the step.
        num_cached_tokens: prompt tokens served from the prefix cache at the request's
            first admission, instead of being computed (readmissions after a preemption
            are not counted).
        finished: every sequence has finished.
        metrics: the request's timings; the scheduler keeps updating the same object
            until the request finishes.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    metrics: RequestMetrics | None = None
