"""Scheduler limits and policies (:class:`SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.errors import InvalidArgumentError

__all__ = ["POLICIES", "PREEMPTION_MODES", "SchedulerConfig"]

POLICIES = ("fcfs", "priority", "lpm")
"""Admission orders of the waiting queue."""

PREEMPTION_MODES = ("recompute", "swap")
"""How a running request gives its blocks back when the pool runs short."""

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step and the scheduler's policies.

    Attributes:
        max_num_batched_tokens: most tokens computed in one step (decodes count 1 each).
        max_num_seqs: most sequences computed in one step (each sequence of an ``n > 1``
            or beam request counts).
        policy: order in which waiting requests are admitted:
            ``"fcfs"`` (arrival time), ``"priority"`` (``Request.priority``, smaller first,
            then arrival) or ``"lpm"`` (longest cached prefix first, then arrival; a
            cache-aware order as in SGLang).
        preemption_mode: ``None`` (auto: recompute single-sequence requests, swap
            multi-sequence ones), ``"recompute"`` or ``"swap"``. Multi-sequence requests
            swap when the CPU pool has room, else are recomputed (``n > 1``: each sequence
            on its own; beam search: from the prompt); see
            docs/scheduler-engine-interface.md.
        enable_chunked_prefill: split prompts longer than the remaining token budget
            across steps. Off: a prompt is scheduled whole or waits (and a prompt longer
            than ``max_num_batched_tokens`` is rejected at ``add_request``); only a
            preempted sequence recomputed with more tokens than the budget is chunked.
        num_lookahead_tokens: extra slots reserved per decode step (speculative decoding).
        max_load_blocks_per_step: most host-tier loads (host -> GPU block copies) one
            step queues; ``None``: unbounded. Loads are transfers, not compute, so they
            never count against ``max_num_batched_tokens``; this bounds them instead. A
            request whose loads exceed what the step has left waits for the next step;
            one whose loads exceed the whole bound is admitted in a step that has
            queued no load yet, with only the prefix whose loads fit (the rest is
            computed), so no request waits forever. Only matters with a host tier.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: str = "fcfs"
    preemption_mode: str | None = None
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0
    max_load_blocks_per_step: int | None = None

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_num_batched_tokens", 1),
            ("max_num_seqs", 1),
            ("num_lookahead_tokens", 0),
        ):
            value = getattr(self, name)
            # Token counts and positions are int32 in the block tables and the kernels.
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not minimum <= value <= _INT32_MAX
            ):
                raise InvalidArgumentError(
                    f"{name} must be an int in [{minimum}, 2^31), got {value!r}"
                )
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise InvalidArgumentError(
                f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}"
            )
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidArgumentError(
                f"preemption_mode must be None, 'recompute' or 'swap'; got {self.preemption_mode!r}"
            )
        bound = self.max_load_blocks_per_step
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, int) or not 0 <= bound <= _INT32_MAX
        ):
            raise InvalidArgumentError(
                f"max_load_blocks_per_step must be None or an int in [0, 2^31), got {bound!r}"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise InvalidArgumentError(
                f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
