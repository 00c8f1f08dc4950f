"""Synthetic serving workload: ShareGPT-like lengths, Poisson arrivals, shared system prompts.

Prompt and output lengths are drawn from lognormal fits in the range of the ShareGPT
conversations that vLLM's benchmarks replay (median prompt ~150 tokens, median output
~120, long tails). A share of the requests starts with one of a few long system prompts
(so the prefix cache has something to share), and a share asks for ``n > 1`` samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError

__all__ = ["SimRequest", "WorkloadConfig", "iter_workload", "make_workload"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of the synthetic workload.

    Attributes:
        num_requests: requests in the trace.
        request_rate: mean arrivals per simulated second (Poisson); ``inf``: all at t=0.
        seed: seed of every random draw.
        prompt_median, prompt_sigma: lognormal prompt length (tokens).
        output_median, output_sigma: lognormal output length (tokens).
        max_prompt_len, max_output_len: clipping bounds.
        system_prompt_share: fraction of requests that start with a shared system prompt.
        num_system_prompts, system_prompt_len: the shared system prompts.
        parallel_share: fraction of requests with ``n > 1`` (n drawn from 2..4).
        num_priorities: request priorities are drawn from ``0..num_priorities-1`` (used by
            the ``priority`` policy only).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
    """

    num_requests: int = 1000
    request_rate: float = 20.0
    seed: int = 0
    prompt_median: float = 150.0
    prompt_sigma: float = 1.0
    output_median: float = 120.0
    output_sigma: float = 0.9
    max_prompt_len: int = 2048
    max_output_len: int = 1024
    system_prompt_share: float = 0.4
    num_system_prompts: int = 4
    system_prompt_len: int = 256
    parallel_share: float = 0.05
    num_priorities: int = 3
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise InvalidArgumentError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise InvalidArgumentError(f"request_rate must be > 0, got {self.request_rate}")
        for name in ("system_prompt_share", "parallel_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"{name} must be in [0, 1], got {value}")


@dataclass
class SimRequest:
    """One request of the trace.

    Attributes:
        request_id: unique id.
        arrival_time: simulated seconds.
        prompt_token_ids: the prompt.
        output_len: tokens each sequence actually generates (the simulated model stops
            there; it is passed to the scheduler as ``max_tokens``).
        declared_max_tokens: the client's ``max_tokens`` (``output_len`` rounded up to a
            power of two, at least 256): what a contiguous-reservation server reserves.
        n: parallel samples.
        priority: smaller is more urgent (``priority`` policy).
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: npt.NDArray[np.int64]
    output_len: int
    declared_max_tokens: int
    n: int
    priority: int = 0


def _lognormal(
    rng: np.random.Generator, median: float, sigma: float, low: int, high: int, size: int
) -> npt.NDArray[np.int64]:
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=size)
    return np.clip(np.rint(draws), low, high).astype(np.int64)


_CHUNK = 1024
"""Requests drawn per batch of vectorised draws (bounds the generator's memory)."""


def iter_workload(config: WorkloadConfig) -> Iterator[SimRequest]:
    """Draw the trace lazily, in arrival order (deterministic for a given config).

    The per-request parameters are drawn in batches of :data:`_CHUNK` requests from one
    generator, so memory stays the same however long the trace is.
    """
    rng = np.random.default_rng(config.seed)
    system_prompts = rng.integers(
        0, config.vocab_size, size=(config.num_system_prompts, config.system_prompt_len)
    )
    clock = 0.0
    for first in range(0, config.num_requests, _CHUNK):
        n = min(_CHUNK, config.num_requests - first)
        if math.isinf(config.request_rate):
            arrivals = np.zeros(n)
        else:
            arrivals = clock + np.cumsum(rng.exponential(1.0 / config.request_rate, size=n))
            clock = float(arrivals[-1])
        prompt_lens = _lognormal(
            rng, config.prompt_median, config.prompt_sigma, 4, config.max_prompt_len, n
        )
        output_lens = _lognormal(
            rng, config.output_median, config.output_sigma, 1, config.max_output_len, n
        )
        uses_system = rng.random(n) < config.system_prompt_share
        which_system = rng.integers(0, config.num_system_prompts, size=n)
        parallel = np.where(rng.random(n) < config.parallel_share, rng.integers(2, 5, size=n), 1)
        priorities = rng.integers(0, max(config.num_priorities, 1), size=n)
        for i in range(n):
            body = rng.integers(0, config.vocab_size, size=int(prompt_lens[i]))
            if uses_system[i]:
                body = np.concatenate([system_prompts[which_system[i]], body])
            out_len = int(output_lens[i])
            declared = max(256, 1 << (out_len - 1).bit_length())
            yield SimRequest(
                request_id=f"req-{first + i}",
                arrival_time=float(arrivals[i]),
                prompt_token_ids=body.astype(np.int64),
                output_len=out_len,
                declared_max_tokens=declared,
                n=int(parallel[i]),
                priority=int(priorities[i]),
            )


def make_workload(config: WorkloadConfig) -> list[SimRequest]:
    """The whole trace as a list (the same requests :func:`iter_workload` yields)."""
    return list(iter_workload(config))
