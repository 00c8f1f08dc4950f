"""The scheduler's per-request record (:class:`RequestState`).

Per-step data of decoding sequences lives in the :class:`SequenceTable` columns; this
record holds what changes only on events: queue membership, the sequences of the request,
the tokens to (re)compute, finished sequences and beam hypotheses.
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt

from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler.beam import Hypothesis
from kvblocks.scheduler.queues.policy import Key, QueueKey
from kvblocks.scheduler.request import CompletionOutput, FinishReason, Request, RequestMetrics
from kvblocks.scheduler.seq_table import Rows, empty_rows

__all__ = ["RequestState", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    PREFILL = "prefill"  # admitted, prompt (or recomputed sequence) partly computed
    RUNNING = "running"  # decoding; its sequences are rows of the table
    SWAPPED = "swapped"
    SPLIT = "split"  # forked request recomputed as one part per sequence (see parts)
    FINISHED = "finished"


class RequestState:
    """The scheduler's view of one request (per-request data; per-step data is in the table)."""

    def __init__(
        self,
        request: Request,
        counter: int,
        key: Key,
        seq_id: int,
        metrics: RequestMetrics | None = None,
    ) -> None:
        params = request.sampling_params
        self.request = request
        self.params: SamplingParams = params
        self.counter = counter
        self.key = key
        self.status = RequestStatus.WAITING
        self.seq_ids: list[int] = [seq_id]  # live sequences
        self.all_seq_ids: list[int] = [seq_id]
        # Tokens the single sequence must (re)compute while WAITING/PREFILL: the prompt,
        # or prompt + generated tokens after a recompute preemption.
        self.tokens: npt.NDArray[np.int64] = np.asarray(request.prompt_token_ids)
        self.num_prompt = len(self.tokens)
        self.num_computed = 0
        self.num_cached_tokens = 0
        self.cum_logprob = 0.0  # of the single sequence while it is not in the table
        self.multi = False  # forked into several sequences
        # Admitted at least once: later admissions are recompute readmissions, counted
        # apart from first admissions in the prefix-cache statistics.
        self.admitted = False
        # An n > 1 request preempted without swap space continues as one single-sequence
        # part per live sequence (prompt + that sequence's own tokens, recomputed); the
        # parts finish into this request. A part points back to it through ``parent``.
        self.parts: list[RequestState] = []
        self.parent: RequestState | None = None
        # Step at which the waiting sequence was registered with the manager or its prefix
        # probe refreshed, -1 if it is not registered. The manager caps a sequence's cache
        # hit at registration, so the probe is refreshed before admission (see _register).
        self.registered_step = -1
        self.aborted = False
        # Bounded waiting (queues/wait_bound.py): the step it last entered the waiting
        # queue, and whether it waited past the bound (then for good).
        self.wait_since = 0
        self.overdue = False
        self.seq_index: dict[int, int] = {seq_id: 0}
        self.outputs: dict[int, CompletionOutput] = {}
        # Step (``counters.num_steps``) at which each finished sequence's record was made:
        # the final record repeats the earlier ones without their new tokens.
        self.output_step: dict[int, int] = {}
        # Shared by the parts of a split request (one request, one set of timings).
        self.metrics = metrics if metrics is not None else RequestMetrics(0.0)
        self._prompt_list: list[int] | None = None
        self.hypotheses: list[Hypothesis] = []
        self.swapped_rows: Rows | None = None
        eos = request.eos_token_id
        self.eos = -1 if eos is None or params.ignore_eos else int(eos)
        self.stop_set = frozenset(params.stop_token_ids)
        self.beam_stops = self.stop_set | ({self.eos} if self.eos >= 0 else set())

    @property
    def prompt_list(self) -> list[int]:
        """The prompt as a list, converted once (every step's output refers to it)."""
        if self._prompt_list is None:
            self._prompt_list = np.asarray(self.request.prompt_token_ids).tolist()
        return self._prompt_list

    @property
    def queue_key(self) -> QueueKey:
        """The waiting queue's order: overdue requests first by arrival, then by key."""
        if self.overdue:
            return (0, 0, self.key[1], self.key[2])
        return (1, *self.key)

    @property
    def is_waiting(self) -> bool:
        """In the waiting queue."""
        return self.status is RequestStatus.WAITING

    @property
    def root(self) -> RequestState:
        """The request itself (a part's parent)."""
        return self.parent if self.parent is not None else self

    @property
    def width(self) -> int:
        """Sequences this request runs once its prompt is computed (1 for a part)."""
        if self.parent is not None:
            return 1
        if self.multi:
            return len(self.seq_ids)
        return self.params.num_sequences

    @property
    def prompt_sample_count(self) -> int:
        """Tokens the last prompt chunk's row draws: ``n`` before an ``n > 1`` fork, else 1."""
        if self.parent is not None or self.multi:
            return 1
        return self.params.n

    def make_part(
        self, seq_id: int, tokens: npt.NDArray[np.int64], cum_logprob: float
    ) -> RequestState:
        """A single-sequence part of this request that recomputes ``tokens`` for ``seq_id``."""
        part = RequestState(self.request, self.counter, self.key, seq_id, self.metrics)
        part.parent = self
        part.tokens = tokens
        part.cum_logprob = cum_logprob
        part.seq_index = {seq_id: self.seq_index[seq_id]}
        part.admitted = True
        part.overdue = self.overdue
        return part

    def finish_reason_for(self, token: int, num_generated: int) -> FinishReason | None:
        """Stop reason of sampling ``token`` as the ``num_generated``-th token (EOS, stop
        token) or None; none before ``min_tokens`` tokens."""
        if num_generated < self.params.min_tokens:
            return None
        if token == self.eos:
            return FinishReason.EOS
        if token in self.stop_set:
            return FinishReason.STOP
        return None

    def table_rows(
        self,
        seq_ids: npt.NDArray[np.int64],
        last_tokens: npt.NDArray[np.int64],
        num_tokens: int,
        num_generated: int,
        cum_logprobs: npt.NDArray[np.float64],
    ) -> Rows:
        """Table rows for this request's sequences ``seq_ids`` (decoding state)."""
        n = len(seq_ids)
        params = self.params
        rows = empty_rows(n)
        rows["seq_id"][:] = seq_ids
        rows["request_id"][:] = self.request.request_id
        rows["prio"][:] = self.key[0]
        rows["arrival"][:] = self.key[1]
        rows["counter"][:] = self.counter
        rows["num_tokens"][:] = num_tokens
        rows["num_generated"][:] = num_generated
        rows["max_tokens"][:] = params.max_tokens
        rows["last_token"][:] = last_tokens
        rows["eos"][:] = self.eos
        rows["has_stop"][:] = bool(self.stop_set)
        rows["temperature"][:] = params.temperature
        rows["top_p"][:] = params.top_p
        rows["top_k"][:] = params.top_k
        rows["seed"][:] = -1 if params.seed is None else params.seed
        rows["seq_index"][:] = [self.seq_index.get(int(s), 0) for s in seq_ids]
        rows["cum_logprob"][:] = cum_logprobs
        rows["is_beam"][:] = params.use_beam_search
        return rows
