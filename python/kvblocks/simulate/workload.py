"""Synthetic serving workload: length distributions, arrivals, system prompts, conversations.

The default mix is ShareGPT-like: lognormal prompt and output lengths with the means the
vLLM paper reports for ShareGPT (about 161 tokens in, 338 out), a share of requests that
start with one of a few shared system prompts, a share of ``n > 1`` requests, and a share
of multi-turn conversations.

Multi-turn conversations are the main real source of prefix reuse: turn ``k + 1``'s prompt
is turn ``k``'s prompt, followed by turn ``k``'s generated tokens, followed by a new user
message. The follow-up is *closed-loop*: it arrives when the previous turn finishes plus
a think time (exponential, mean ``think_time_s``), so a slow server also delays the next
turns, as with real users. The simulation loop creates it (:meth:`SimRequest.next_turn`)
when the previous turn finishes; everything random about a conversation is drawn when it
starts, so a trace is deterministic for a given seed.

``request_rate`` counts requests (turns), not conversations: conversations start at
``request_rate / mean_turns`` per second, so the long-run arrival rate of requests is
``request_rate`` whenever the server keeps up.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_int, check_number

__all__ = [
    "ARRIVAL_PROCESSES",
    "MAX_SYSTEM_PROMPT_TOKENS",
    "MAX_TURNS",
    "ArrivalQueue",
    "LengthDist",
    "SimRequest",
    "Turn",
    "WorkloadConfig",
    "count_conversations",
    "iter_workload",
    "make_workload",
    "mean_turns",
]

ARRIVAL_PROCESSES = ("poisson", "constant")
"""How conversation starts are spaced: exponential gaps, or exactly ``1 / rate`` apart."""

_KINDS = ("lognormal", "fixed", "uniform")
_MAX_SPREAD = float(2**53)
MAX_SYSTEM_PROMPT_TOKENS = 2**26
"""Tokens of all system prompts together (drawn up front: 512 MiB of int64)."""
MAX_TURNS = 1024
"""Turns a conversation may have: :func:`mean_turns` draws 4096 conversations of
``max_turns`` turns at once."""


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts (drawn as floats, rounded, then clipped).

    Attributes:
        kind: ``"lognormal"`` (``a`` = mean, ``b`` = sigma of the underlying normal),
            ``"fixed"`` (always ``a``) or ``"uniform"`` (integers ``a..b`` inclusive).
        a, b: the parameters (``b`` unused by ``fixed``).

    A lognormal is parameterised by its mean (``mu = ln(mean) - sigma^2 / 2``) because
    published workload statistics are means; its median is ``mean * exp(-sigma^2 / 2)``.
    """

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in _KINDS:
            raise InvalidArgumentError(
                f"length distribution kind must be one of {', '.join(_KINDS)}, got {self.kind!r}"
            )
        for name in ("a", "b"):
            # Not {self} in the message: its __str__ formats the parameters as numbers.
            check_number(getattr(self, name), f"length distribution parameter {name}", numpy=True)
        if self.kind == "lognormal" and not (self.a > 0 and self.b >= 0):
            raise InvalidArgumentError(f"lognormal needs mean > 0 and sigma >= 0, got {self}")
        if self.kind == "fixed" and self.a < 0:
            raise InvalidArgumentError(f"fixed length must be >= 0, got {self.a:g}")
        if self.kind == "uniform" and not 0 <= self.a <= self.b:
            raise InvalidArgumentError(f"uniform needs 0 <= low <= high, got {self}")
        # Wider ones cannot be drawn: numpy's int64 bound (uniform), sigma**2 overflowing.
        if self.kind in ("uniform", "lognormal") and self.b > _MAX_SPREAD:
            raise InvalidArgumentError(
                f"{self.kind}'s second parameter must be at most 2**53, got {self}"
            )

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``lognormal:MEAN,SIGMA``, ``fixed:N`` or ``uniform:LOW,HIGH`` (a bare ``N`` is fixed).

        Raises:
            InvalidArgumentError: not one of those forms.
        """
        kind, _, params = text.partition(":")
        if not params:
            kind, params = "fixed", text
        try:
            values = [float(p) for p in params.split(",")]
        except ValueError:
            values = []
        arity = {"lognormal": 2, "fixed": 1, "uniform": 2}.get(kind.strip())
        if arity is None or len(values) != arity:
            raise InvalidArgumentError(
                f"expected lognormal:MEAN,SIGMA, fixed:N or uniform:LOW,HIGH, got {text!r}"
            )
        return cls(kind.strip(), *values)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"

    @property
    def mean(self) -> float:
        """Mean before rounding and clipping."""
        return self.a if self.kind != "uniform" else (self.a + self.b) / 2

    def draw(
        self, rng: np.random.Generator, low: int, high: int, size: int
    ) -> npt.NDArray[np.int64]:
        """``size`` draws, rounded and clipped to ``[low, high]``."""
        if self.kind == "lognormal":
            mu = math.log(self.a) - self.b**2 / 2
            raw = rng.lognormal(mean=mu, sigma=self.b, size=size)
        elif self.kind == "uniform":
            raw = rng.integers(int(self.a), int(self.b) + 1, size=size).astype(np.float64)
        else:
            raw = np.full(size, self.a)
        return np.clip(np.rint(raw), low, high).astype(np.int64)


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of the synthetic workload.

    Attributes:
        num_requests: requests (conversation turns) in the trace.
        request_rate: mean requests per simulated second; ``inf``: every conversation
            starts at t=0 (follow-up turns still wait for their previous turn).
        arrival: ``"poisson"`` or ``"constant"`` spacing of conversation starts.
        seed: seed of every random draw.
        prompt_len: length of a user message (a first turn's prompt, after any system
            prompt; also each follow-up's new message).
        output_len: tokens each sequence generates.
        max_prompt_len, max_output_len: clipping bounds of one message / one output.
        max_context_len: a conversation ends before a turn whose prompt plus output would
            exceed this (chat front-ends start a new conversation there).
        system_prompt_share: fraction of conversations that start with a shared system prompt.
        num_system_prompts, system_prompt_len: the shared system prompts.
        multi_turn_share: fraction of conversations with more than one turn.
        max_turns: a multi-turn conversation has ``2..max_turns`` turns (uniform).
        think_time_s: mean think time between a turn's finish and the next turn's arrival
            (exponential).
        parallel_share: fraction of single-turn requests with ``n > 1`` (n drawn from 2..4).
        num_priorities: request priorities are drawn from ``0..num_priorities-1`` (used by
            the ``priority`` policy only).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
    """

    num_requests: int = 1000
    request_rate: float = 5.0
    arrival: str = "poisson"
    seed: int = 0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 161, 1.0))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("lognormal", 338, 0.8))
    max_prompt_len: int = 1024
    max_output_len: int = 2048
    max_context_len: int = 4096
    system_prompt_share: float = 0.4
    num_system_prompts: int = 4
    system_prompt_len: int = 256
    multi_turn_share: float = 0.25
    max_turns: int = 5
    think_time_s: float = 5.0
    parallel_share: float = 0.05
    num_priorities: int = 3
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        # Types first: the comparisons below would take a float count, pass a NaN, or
        # raise TypeError; a seed or a length distribution would fail only mid-run.
        check_int(self.num_requests, "num_requests", minimum=1, numpy=True)
        check_number(self.request_rate, "request_rate", positive=True, numpy=True, infinite=True)
        check_int(self.seed, "seed", minimum=0, numpy=True)
        for name in ("prompt_len", "output_len"):
            if not isinstance(getattr(self, name), LengthDist):
                raise InvalidArgumentError(
                    f"{name} must be a LengthDist, got {type(getattr(self, name)).__name__}"
                )
        for name in (
            "max_prompt_len",
            "max_output_len",
            "max_context_len",
            "num_system_prompts",
            "system_prompt_len",
            "max_turns",
        ):
            check_int(getattr(self, name), name, numpy=True)
        check_int(self.vocab_size, "vocab_size", minimum=1, maximum=2**32, numpy=True)
        for name in ("system_prompt_share", "parallel_share", "multi_turn_share"):
            check_number(getattr(self, name), name, minimum=0.0, maximum=1.0, numpy=True)
        check_number(self.think_time_s, "think_time_s", minimum=0.0, numpy=True)
        check_int(self.num_priorities, "num_priorities", minimum=1, numpy=True)
        if not isinstance(self.arrival, str) or self.arrival not in ARRIVAL_PROCESSES:
            raise InvalidArgumentError(
                f"arrival must be one of {', '.join(ARRIVAL_PROCESSES)}, got {self.arrival!r}"
            )
        for name in ("system_prompt_share", "parallel_share", "multi_turn_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"{name} must be in [0, 1], got {value}")
        for name, minimum in (
            ("max_prompt_len", 1),
            ("max_output_len", 1),
            ("num_system_prompts", 1),
            ("system_prompt_len", 0),
            ("max_turns", 1),
            ("vocab_size", 1),
        ):
            if getattr(self, name) < minimum:
                raise InvalidArgumentError(
                    f"{name} must be >= {minimum}, got {getattr(self, name)}"
                )
        if self.num_system_prompts * self.system_prompt_len > MAX_SYSTEM_PROMPT_TOKENS:
            raise InvalidArgumentError(
                f"num_system_prompts * system_prompt_len must be <= 2**26 (the system "
                f"prompts are drawn up front), got {self.num_system_prompts} * "
                f"{self.system_prompt_len}"
            )
        if self.max_turns > MAX_TURNS:
            raise InvalidArgumentError(f"max_turns must be <= {MAX_TURNS}, got {self.max_turns}")
        if not self.think_time_s >= 0 or math.isinf(self.think_time_s):
            raise InvalidArgumentError(f"think_time_s must be >= 0, got {self.think_time_s}")
        first_turn = self.system_prompt_len + self.max_prompt_len + self.max_output_len
        if self.max_context_len < first_turn:
            raise InvalidArgumentError(
                f"max_context_len ({self.max_context_len}) must hold a whole first turn: "
                f"system_prompt_len + max_prompt_len + max_output_len = {first_turn}"
            )


@dataclass(frozen=True)
class Turn:
    """A conversation's later turn, drawn when the conversation starts.

    Attributes:
        message: the new user message appended to the history.
        output_len: tokens the turn generates.
        think_s: seconds between the previous turn's finish and this turn's arrival.
    """

    message: npt.NDArray[np.int64]
    output_len: int
    think_s: float


def declared_max_tokens(output_len: int) -> int:
    """The client's ``max_tokens``: ``output_len`` rounded up to a power of two, >= 256.

    Clients do not know the output length; they ask for a round bound above it. This is
    what a contiguous-reservation server must reserve.
    """
    return max(256, 1 << (max(output_len, 1) - 1).bit_length())


@dataclass
class SimRequest:
    """One request of the trace.

    Attributes:
        request_id: unique id (``req-C`` for a conversation's first turn, ``req-C.K`` for
            its turn ``K``).
        arrival_time: simulated seconds.
        prompt_token_ids: the prompt (for a follow-up: the whole history).
        output_len: tokens each sequence actually generates (the simulated model stops
            there; it is passed to the scheduler as ``max_tokens``).
        declared_max_tokens: the client's ``max_tokens`` (:func:`declared_max_tokens`):
            what a contiguous-reservation server reserves.
        n: parallel samples (always 1 in a multi-turn conversation).
        priority: smaller is more urgent (``priority`` policy).
        turn: 0 for a first turn.
        next_turns: the conversation's remaining turns.
        history_len: prompt tokens carried over from earlier turns.
        conversation: the conversation's index in the order conversations start (the
            ``C`` of ``req-C``).
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: npt.NDArray[np.int64]
    output_len: int
    declared_max_tokens: int
    n: int
    priority: int = 0
    turn: int = 0
    next_turns: tuple[Turn, ...] = ()
    history_len: int = 0
    conversation: int = 0

    def next_turn(self, output_token_ids: npt.ArrayLike, finish_time: float) -> SimRequest | None:
        """The conversation's next request, or ``None`` after its last turn.

        Its prompt is this prompt + ``output_token_ids`` (what this turn generated) + the
        next message; it arrives ``think_s`` after ``finish_time``.
        """
        if not self.next_turns:
            return None
        nxt, rest = self.next_turns[0], self.next_turns[1:]
        history = np.concatenate(
            [self.prompt_token_ids, np.asarray(output_token_ids, dtype=np.int64)]
        )
        base = self.request_id.split(".", 1)[0]
        if not math.isfinite(finish_time + nxt.think_s):
            raise InvalidArgumentError(
                f"the turn after {self.request_id} arrives past the simulated clock's range "
                "(think_time_s too large)"
            )
        return SimRequest(
            request_id=f"{base}.{self.turn + 1}",
            arrival_time=finish_time + nxt.think_s,
            prompt_token_ids=np.concatenate([history, nxt.message]),
            output_len=nxt.output_len,
            declared_max_tokens=declared_max_tokens(nxt.output_len),
            n=1,
            priority=self.priority,
            turn=self.turn + 1,
            next_turns=rest,
            history_len=len(history),
            conversation=self.conversation,
        )


_CHUNK = 1024
"""Conversations drawn per batch of vectorised draws (bounds the generator's memory)."""


def _turn_counts(config: WorkloadConfig, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
    multi = rng.random(n) < config.multi_turn_share
    extra = rng.integers(2, max(config.max_turns, 2) + 1, size=n)
    return np.where(multi & (config.max_turns >= 2), extra, 1).astype(np.int64)


def _fit_context(
    config: WorkloadConfig,
    first_len: int,
    messages: npt.NDArray[np.int64],
    outputs: npt.NDArray[np.int64],
) -> int:
    """Turns that fit ``max_context_len`` (the first always does)."""
    # Turn k's prompt + output = first_len + sum(outputs[:k+1]) + sum(messages[1:k+1]).
    ends = first_len + np.cumsum(outputs) + np.concatenate([[0], np.cumsum(messages[1:])])
    return max(1, int(np.searchsorted(ends, config.max_context_len, side="right")))


@functools.lru_cache(maxsize=64)
def mean_turns(config: WorkloadConfig, samples: int = 4096) -> float:
    """Expected requests per conversation, context-window cut included (Monte Carlo).

    Drawn from a generator of its own, so it does not disturb the trace.
    """
    if config.multi_turn_share == 0.0 or config.max_turns < 2:
        return 1.0
    rng = np.random.default_rng(config.seed + 7919)
    counts = _turn_counts(config, rng, samples)
    width = config.max_turns
    msgs = config.prompt_len.draw(rng, 1, config.max_prompt_len, samples * width)
    outs = config.output_len.draw(rng, 1, config.max_output_len, samples * width)
    msgs, outs = msgs.reshape(samples, width), outs.reshape(samples, width)
    system = config.system_prompt_len * (rng.random(samples) < config.system_prompt_share)
    # Turn k's prompt + output = system + sum(msgs[:k+1]) + sum(outs[:k+1]); see _fit_context.
    ends = system[:, None] + np.cumsum(msgs, axis=1) + np.cumsum(outs, axis=1)
    fits = np.maximum((ends <= config.max_context_len).sum(axis=1), 1)
    return float(np.minimum(counts, fits).mean())


def iter_workload(config: WorkloadConfig) -> Iterator[SimRequest]:
    """Draw the conversations' first turns lazily, in arrival order (deterministic).

    Exactly ``config.num_requests`` requests result, counting every later turn (the
    last conversation is cut short if needed); later turns are carried by each first
    turn's ``next_turns`` and created by :meth:`SimRequest.next_turn`. Parameters are
    drawn in batches of :data:`_CHUNK` conversations, so memory stays the same however
    long the trace is.
    """
    rng = np.random.default_rng(config.seed)
    system_prompts = rng.integers(
        0, config.vocab_size, size=(config.num_system_prompts, config.system_prompt_len)
    )
    start_rate = config.request_rate / mean_turns(config)
    clock = 0.0
    planned = 0
    conv = 0
    while planned < config.num_requests:
        n = _CHUNK
        if math.isinf(config.request_rate):
            arrivals = np.zeros(n)
        else:
            if config.arrival == "constant":
                gaps = np.full(n, 1.0 / start_rate)
            else:
                gaps = rng.exponential(1.0 / start_rate, size=n)
            with np.errstate(over="ignore"):  # an overflow is refused just below
                arrivals = clock + np.cumsum(gaps)
            clock = float(arrivals[-1])
            if not math.isfinite(clock):
                # Times past the float range are inf: every latency would be inf.
                raise InvalidArgumentError(
                    f"request_rate {config.request_rate} is too small: the arrival times "
                    "of the trace overflow the simulated clock"
                )
        first_lens = config.prompt_len.draw(rng, 1, config.max_prompt_len, n)
        output_lens = config.output_len.draw(rng, 1, config.max_output_len, n)
        uses_system = rng.random(n) < config.system_prompt_share
        which_system = rng.integers(0, config.num_system_prompts, size=n)
        turns = _turn_counts(config, rng, n)
        parallel = np.where(rng.random(n) < config.parallel_share, rng.integers(2, 5, size=n), 1)
        priorities = rng.integers(0, max(config.num_priorities, 1), size=n)
        for i in range(n):
            if planned >= config.num_requests:
                return
            body = rng.integers(0, config.vocab_size, size=int(first_lens[i]))
            if uses_system[i]:
                body = np.concatenate([system_prompts[which_system[i]], body])
            out_len = int(output_lens[i])
            later: tuple[Turn, ...] = ()
            if turns[i] > 1:
                k = int(turns[i]) - 1
                msgs = config.prompt_len.draw(rng, 1, config.max_prompt_len, k)
                outs = config.output_len.draw(rng, 1, config.max_output_len, k)
                think = rng.exponential(config.think_time_s, size=k)
                if not np.isfinite(think).all():
                    raise InvalidArgumentError(
                        f"think_time_s {config.think_time_s} is too large: the think times "
                        "drawn overflow the simulated clock"
                    )
                fit = _fit_context(
                    config,
                    len(body),
                    np.concatenate([[0], msgs]),
                    np.concatenate([[out_len], outs]),
                )
                k = min(k, fit - 1, config.num_requests - planned - 1)
                later = tuple(
                    Turn(
                        rng.integers(0, config.vocab_size, size=int(msgs[j])),
                        int(outs[j]),
                        float(think[j]),
                    )
                    for j in range(k)
                )
            planned += 1 + len(later)
            yield SimRequest(
                request_id=f"req-{conv}",
                arrival_time=float(arrivals[i]),
                prompt_token_ids=body.astype(np.int64),
                output_len=out_len,
                declared_max_tokens=declared_max_tokens(out_len),
                n=int(parallel[i]) if not later else 1,
                priority=int(priorities[i]),
                next_turns=later,
                conversation=conv,
            )
            conv += 1


def count_conversations(config: WorkloadConfig) -> int:
    """Conversations in ``config``'s trace (a pass over :func:`iter_workload`, fixed
    memory): the stability rule's quarters split these, not an expected count."""
    return sum(1 for _ in iter_workload(config))


def make_workload(config: WorkloadConfig) -> list[SimRequest]:
    """The conversations' first turns as a list (the requests :func:`iter_workload` yields)."""
    return list(iter_workload(config))


class ArrivalQueue:
    """The trace's conversation starts merged with follow-up turns pushed as turns finish.

    A simulation loop pops every request due by its clock, and pushes a turn's
    :meth:`SimRequest.next_turn` when the turn finishes.
    """

    def __init__(self, config: WorkloadConfig) -> None:
        self._starts = iter_workload(config)
        self._upcoming = next(self._starts, None)
        self._followups: list[tuple[float, int, SimRequest]] = []
        self._seq = 0

    def push(self, request: SimRequest) -> None:
        """Schedule a follow-up turn's arrival."""
        heapq.heappush(self._followups, (request.arrival_time, self._seq, request))
        self._seq += 1

    def next_time(self, starts: bool = True) -> float | None:
        """Arrival time of the next request, ``None`` when none is known yet.

        ``starts=False`` looks at follow-up turns only (a client pool that is full).
        """
        start = self._start_time() if starts else None
        times = [t for t in (start, self._followup_time()) if t is not None]
        return min(times) if times else None

    def pop_due(self, clock: float, starts: bool = True) -> SimRequest | None:
        """The next request that has arrived by ``clock`` (earliest first), or ``None``.

        ``starts=False`` pops follow-up turns only: conversation starts stay queued.
        """
        start = self._start_time() if starts else None
        follow = self._followup_time()
        if follow is not None and follow <= clock and (start is None or follow <= start):
            return heapq.heappop(self._followups)[2]
        if start is not None and start <= clock:
            sim = self._upcoming
            self._upcoming = next(self._starts, None)
            return sim
        return None

    def _start_time(self) -> float | None:
        return None if self._upcoming is None else self._upcoming.arrival_time

    def _followup_time(self) -> float | None:
        return self._followups[0][0] if self._followups else None
