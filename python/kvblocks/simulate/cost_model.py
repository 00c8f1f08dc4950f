"""A linear cost model of one forward pass, standing in for the GPU in simulations."""

from __future__ import annotations

from dataclasses import dataclass

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler.output import SchedulerOutput
from kvblocks.validation import check_int, check_number

__all__ = [
    "DEFAULT_HOST_BANDWIDTH_GBPS",
    "DEFAULT_KV_BYTES_PER_TOKEN",
    "DEFAULT_REMOTE_BANDWIDTH_GBPS",
    "CostModel",
    "tier_ops",
]

DEFAULT_KV_BYTES_PER_TOKEN = 32 * 2 * 4096 * 2
"""KV bytes per token of the modelled 7B fp16 model: 32 layers x (K + V) x 4,096 x 2 bytes
(512 KiB; a 16-token block is 8 MiB)."""

DEFAULT_HOST_BANDWIDTH_GBPS = 25.0
"""Effective host<->GPU bandwidth, GB/s: PCIe 4.0 x16 (32 GB/s raw) at ~80% for pinned
copies."""

DEFAULT_REMOTE_BANDWIDTH_GBPS = 5.0
"""Effective bandwidth of a shared remote store's (Valkey's) link, GB/s, which every
instance's reads share: a 50 Gb/s network link at ~80%."""


def tier_ops(output: SchedulerOutput) -> tuple[int, int]:
    """``(blocks loaded, blocks offloaded)`` by ``output``'s host-tier memory ops."""
    loads = offloads = 0
    for kind, pairs in output.memory_ops:
        if kind == "load":
            loads += len(pairs)
        elif kind == "offload":
            offloads += len(pairs)
    return loads, offloads


@dataclass(frozen=True)
class CostModel:
    """``step_time = fixed + per_token * tokens + per_context_token * context + transfers``.

    The defaults are illustrative for a 7B fp16 model on one A100-class GPU: reading the
    weights once per step (~7 ms), ~14k prefill tokens/s of compute, and reading ~0.5 MB
    of KV per context token at ~2 TB/s. Only ratios between runs are meaningful.

    Host-tier transfers (the step's ``"load"`` and ``"offload"`` memory ops) cost
    ``blocks * block_size * kv_bytes_per_token / host_bandwidth`` each way:

    - loads are *added* to the step: a loaded block must land before attention reads it;
    - offloads at eviction (``"evict"``) are added too: the block must be read before its
      new owner (a load or this step's forward pass) writes it;
    - write-through offloads (``"commit"``, ``overlap_offloads=True``) copy blocks
      committed by the previous step, which nothing overwrites while the copy is in
      flight, so they run on the device-to-host copy engine beside the step's compute and
      only the part longer than the compute adds: ``max(0, offload - compute)``.

    Nothing overlaps the previous step or runs layer by layer, so an engine that does
    better pays less: the tier's gain shown is a lower bound. Swaps to the CPU swap space
    are not charged (as before the tier).

    A shared remote tier (fleet simulations) moves blocks into a host tier over the
    network: ``blocks * block bytes / remote_bandwidth`` (:meth:`remote_transfer_time`),
    which delays the reading request, not the step.

    Attributes:
        fixed_s: seconds per step regardless of the batch.
        per_token_s: seconds per token computed in the step.
        per_context_token_s: seconds per token of attended context (sum of ``seq_lens``).
        kv_bytes_per_token: KV bytes one token occupies over all layers (K and V).
        host_bandwidth_bytes_per_s: effective host<->GPU copy bandwidth.
        remote_bandwidth_bytes_per_s: effective remote store -> host memory bandwidth.
    """

    fixed_s: float = 7e-3
    per_token_s: float = 7e-5
    per_context_token_s: float = 2.5e-7
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    host_bandwidth_bytes_per_s: float = DEFAULT_HOST_BANDWIDTH_GBPS * 1e9
    remote_bandwidth_bytes_per_s: float = DEFAULT_REMOTE_BANDWIDTH_GBPS * 1e9

    def __post_init__(self) -> None:
        # A NaN or negative time would make every step's time NaN or run time backwards.
        # Kept as Python floats: a NumPy float16 overflowed to inf in the step-time sums.
        for name in ("fixed_s", "per_token_s", "per_context_token_s"):
            value = check_number(getattr(self, name), name, minimum=0.0, numpy=True)
            object.__setattr__(self, name, value)
        check_int(self.kv_bytes_per_token, "kv_bytes_per_token", numpy=True)
        for name in ("host_bandwidth_bytes_per_s", "remote_bandwidth_bytes_per_s"):
            object.__setattr__(self, name, check_number(getattr(self, name), name, numpy=True))
        if self.kv_bytes_per_token < 1:
            raise InvalidArgumentError(
                f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}"
            )
        if not self.host_bandwidth_bytes_per_s > 0:
            raise InvalidArgumentError(
                f"host_bandwidth_bytes_per_s must be > 0, got {self.host_bandwidth_bytes_per_s}"
            )
        if not self.remote_bandwidth_bytes_per_s > 0:
            raise InvalidArgumentError(
                f"remote_bandwidth_bytes_per_s must be > 0, got {self.remote_bandwidth_bytes_per_s}"
            )

    def step_time(
        self,
        output: SchedulerOutput,
        block_size: int | None = None,
        overlap_offloads: bool = False,
    ) -> float:
        """Simulated seconds to run ``output``: its forward pass (0 for an empty step) plus
        its host-tier transfers (offloads overlapped with compute if ``overlap_offloads``).

        Raises:
            InvalidArgumentError: ``output`` has tier ops and ``block_size`` is not given
                (their bytes depend on it).
        """
        loads, offloads = tier_ops(output)
        load_s = offload_s = 0.0
        if loads or offloads:
            if block_size is None or block_size < 1:
                raise InvalidArgumentError("step_time needs block_size to charge tier ops")
            load_s = self.transfer_time(loads, block_size)
            offload_s = self.transfer_time(offloads, block_size)
        compute = 0.0
        if not output.is_empty:
            compute = self.time(output.num_tokens, int(output.seq_lens.sum(dtype="int64")))
        if overlap_offloads:
            offload_s = max(0.0, offload_s - compute)
        return compute + load_s + offload_s

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of ``block_size`` tokens (all layers, K and V)."""
        return block_size * self.kv_bytes_per_token

    def transfer_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move ``num_blocks`` blocks between host and GPU memory."""
        return num_blocks * self.block_bytes(block_size) / self.host_bandwidth_bytes_per_s

    def remote_transfer_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to read ``num_blocks`` blocks from the shared remote store."""
        return num_blocks * self.block_bytes(block_size) / self.remote_bandwidth_bytes_per_s

    def time(self, num_tokens: int, context_tokens: int) -> float:
        """Simulated seconds of a non-empty step computing ``num_tokens`` over
        ``context_tokens`` of attended context (used by the contiguous baseline too)."""
        return (
            self.fixed_s + self.per_token_s * num_tokens + self.per_context_token_s * context_tokens
        )
