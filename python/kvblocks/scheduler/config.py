"""Scheduler limits and policies (:class:`SchedulerConfig`), and the checks of the
scheduler's other arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvblocks.errors import InvalidArgumentError
from kvblocks.protocols import BlockManager, EventPublisher
from kvblocks.validation import check_optional_int

if TYPE_CHECKING:
    from kvblocks.scheduler.request import Request

__all__ = ["POLICIES", "PREEMPTION_MODES", "SchedulerConfig", "check_scheduler_args"]

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
        max_wait_steps: the wait bound, in scheduler steps (``None``: no bound). A
            waiting request that has waited this many steps (since ``add_request`` or a
            recompute preemption) is overdue: it is admitted before every request that
            is not, overdue requests in arrival order, so no later arrival passes it
            whatever its priority or cached prefix; below the bound the policy's order
            holds. Default 128 (2.6 s of 20 ms steps). ``0`` admits in arrival order
            under every policy. See :mod:`kvblocks.scheduler.queues.wait_bound`.
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
    max_wait_steps: int | None = 128
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
        if self.preemption_mode is not None and (
            not isinstance(self.preemption_mode, str)
            or self.preemption_mode not in PREEMPTION_MODES
        ):
            raise InvalidArgumentError(
                f"preemption_mode must be None, 'recompute' or 'swap'; got {self.preemption_mode!r}"
            )
        for name in ("max_wait_steps", "max_load_blocks_per_step"):
            check_optional_int(
                getattr(self, name),
                name,
                minimum=0,
                maximum=_INT32_MAX,
                expected="None or an int in [0, 2^31)",
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise InvalidArgumentError(
                f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )

    def check_pool(self, num_blocks: int, block_size: int) -> None:
        """Raise unless a decode step fits in a pool of ``num_blocks`` blocks.

        The first decode step holds the prompt's token, the decoded one and the
        lookahead: past what the pool can ever give, every request would stop at its
        first token (and the persistent table would be sized for slots that can never
        exist).
        """
        usable = (num_blocks - 1) * block_size
        if self.num_lookahead_tokens + 2 > usable:
            raise InvalidArgumentError(
                f"num_lookahead_tokens = {self.num_lookahead_tokens} leaves no room "
                f"for a decode step: the pool holds {usable} tokens ({num_blocks - 1} "
                f"usable blocks of {block_size})"
            )

    def check_request(self, request: Request) -> None:
        """Raise unless ``request`` can ever run under these limits: it runs more
        sequences (n, beam_width) than one step holds, or (chunked prefill off) its
        prompt is longer than ``max_num_batched_tokens``."""
        rid = request.request_id
        width = request.sampling_params.num_sequences
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        if width > limit:
            raise InvalidArgumentError(
                f"request {rid!r} runs {width} sequences at once (n / beam_width) but a step "
                f"holds at most {limit} (max_num_seqs, max_num_batched_tokens)"
            )
        num_prompt = request.num_prompt_tokens
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise InvalidArgumentError(
                f"request {rid!r}: prompt of {num_prompt} tokens exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) and chunked prefill is off"
            )


def check_scheduler_args(
    manager: BlockManager,
    config: SchedulerConfig | None,
    clock: Callable[[], float],
    event_publisher: EventPublisher | None,
) -> SchedulerConfig:
    """The scheduler's config (the default for ``None``), checked with its other
    arguments against ``manager``.

    Raises:
        InvalidArgumentError: ``manager`` is no block manager; ``config`` is not a
            :class:`SchedulerConfig` or leaves no
            room for a decode step in the pool, or asks for lookahead slots with a
            recurrent-state group; ``clock`` is not callable;
            ``event_publisher`` has no ``publish()`` or the manager records no events.
    """
    if not all(
        isinstance(getattr(manager, name, None), int) for name in ("num_blocks", "block_size")
    ) or not callable(getattr(manager, "allocate_slots", None)):
        # What the constructor reads first: anything else was an AttributeError.
        raise InvalidArgumentError(
            f"manager must be a block manager (a kvblocks.KVCacheManager), got "
            f"{type(manager).__name__}"
        )
    if not callable(clock):
        raise InvalidArgumentError(f"clock must be callable, got {clock!r}")
    if event_publisher is not None:
        if not callable(getattr(event_publisher, "publish", None)):
            raise InvalidArgumentError(
                f"event_publisher needs a publish() method, got {event_publisher!r}"
            )
        if not getattr(manager, "record_events", False):
            raise InvalidArgumentError(
                "event_publisher needs a manager built with record_events=True"
            )
    config = config if config is not None else SchedulerConfig()
    if not isinstance(config, SchedulerConfig):
        raise InvalidArgumentError(f"config must be a SchedulerConfig, got {type(config).__name__}")
    config.check_pool(int(manager.num_blocks), int(manager.block_size))
    if config.num_lookahead_tokens and state_groups(manager):
        raise InvalidArgumentError(
            "num_lookahead_tokens must be 0 with a recurrent-state group (its state is "
            "saved after the known tokens only)"
        )
    return config


def state_groups(manager: BlockManager) -> list[int]:
    """The manager's recurrent-state groups (``GroupSpec.recurrent``), in group order:
    each step carries where their states are read and saved."""
    return [g for g, spec in enumerate(getattr(manager, "groups", ())) if spec.kind == "mamba"]
