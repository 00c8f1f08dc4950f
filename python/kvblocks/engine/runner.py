"""The model runner: executes one :class:`~kvblocks.scheduler.SchedulerOutput` on the paged cache.

Per step it applies the scheduler's swaps, copy-on-write copies and host-tier offloads and
loads in the order the block manager issued them (``SchedulerOutput.memory_ops``), brings
its device copy of the scheduler's persistent block table up to date by scattering only
the step's delta, runs the decoder over the flattened batch with every layer's attention
going through :mod:`kvblocks.ops` (CUDA kernels for CUDA tensors, the torch reference on
the CPU), computes logits only at the sampling rows and samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from kvblocks import ops
from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.models import CausalLM
from kvblocks.engine.sampler import Sampler
from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler.block_table import delta_indices
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.transfer import allocate_host_pool, load_blocks, offload_blocks

__all__ = ["ModelRunner", "PagedAttention", "kv_block_bytes"]

KVCaches = list[tuple[Tensor, Tensor]]


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    c = model.config
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * elem


class PagedAttention:
    """Attention backend over the paged KV cache for one step's batch.

    Writes the new tokens' K/V into their slots, then attends each query to its
    sequence's cached context through the block tables. A batch of decodes only uses
    the decode kernel; anything with a prefill chunk uses the varlen prefill kernel,
    which also serves the decodes in the same launch. Each layer brings its own window,
    scale, soft-cap and sinks (its :class:`~kvblocks.engine.config.AttentionSpec`); with
    today's uniform allocation a windowed layer reads its window through the same full
    block table as every other layer.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        *,
        slot_mapping: Tensor,
        block_tables: Tensor,
        query_start_loc: Tensor,
        seq_lens: Tensor,
        seq_lens_host: np.ndarray,
        decode_only: bool,
        max_seq_len: int,
        max_query_len: int,
    ) -> None:
        self.kv_caches = kv_caches
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        # The host copy lets fp16/bf16 decode plan its splits by length without a sync.
        self.seq_lens_host = seq_lens_host
        self.decode_only = decode_only
        # Host-side maxima spare the CUDA path a device sync per layer when planning launches.
        self.max_seq_len = max_seq_len
        self.max_query_len = max_query_len

    def __call__(
        self,
        layer_idx: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        spec: AttentionSpec,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Cache the new K/V and attend (see :class:`~kvblocks.engine.models.AttentionBackend`)."""
        key_cache, value_cache = self.kv_caches[layer_idx]
        ops.reshape_and_cache(key, value, key_cache, value_cache, self.slot_mapping)
        if self.decode_only:
            return ops.paged_attention(
                query,
                key_cache,
                value_cache,
                self.block_tables,
                self.seq_lens,
                scale=spec.scale,
                sliding_window=spec.sliding_window,
                soft_cap=spec.soft_cap,
                sinks=sinks,
                max_seq_len=self.max_seq_len,
                seq_lens_host=self.seq_lens_host,
            )
        return ops.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            scale=spec.scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.soft_cap,
            sinks=sinks,
            max_query_len=self.max_query_len,
        )


class ModelRunner:
    """Owns the KV caches (device and CPU swap space) and runs steps of a model.

    Args:
        model: the decoder (its parameters' device and dtype are used for the caches).
        num_blocks: device cache blocks (block 0 is the manager's null block).
        block_size: tokens per block (8, 16 or 32: the kernels' sizes).
        num_cpu_blocks: CPU swap-space blocks (pinned memory when the model is on CUDA).
        host_cache_blocks: slots of the host tier's pool (the manager's
            ``host_cache_blocks``; 0: no tier). One uint8 row per slot holds a block's K and
            V for every layer (:class:`~kvblocks.tiers.layout.KVLayout`), pinned when the
            model is on CUDA; ``"offload"`` and ``"load"`` ops move blocks in and out.
        seed: seed of the sampler's shared generator.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        host_cache_blocks: int = 0,
        seed: int = 0,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        c = model.config
        layers, heads, dim = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        # ops.allocate_kv_cache validates the block size and the other shapes.
        self.kv_caches: KVCaches = ops.allocate_kv_cache(
            layers, num_blocks, block_size, heads, dim, self.dtype, self.device
        )
        self.cpu_caches: KVCaches = []
        if num_cpu_blocks > 0:
            # Pinned host memory makes device<->host block copies asynchronous DMA.
            self.cpu_caches = ops.allocate_kv_cache(
                layers, num_cpu_blocks, block_size, heads, dim, self.dtype, "cpu",
                pin_memory=self.device.type != "cpu",
            )  # fmt: skip
        if isinstance(host_cache_blocks, bool) or not isinstance(host_cache_blocks, int):
            raise InvalidArgumentError(
                f"host_cache_blocks must be an int, got {host_cache_blocks!r}"
            )
        if host_cache_blocks < 0:
            raise InvalidArgumentError(f"host_cache_blocks must be >= 0, got {host_cache_blocks}")
        self.host_cache_blocks = host_cache_blocks
        self.host_layout = KVLayout.from_caches(self.kv_caches)
        self.host_pool: Tensor | None = None
        if host_cache_blocks > 0:
            self.host_pool = allocate_host_pool(
                self.host_layout, host_cache_blocks, pin_memory=self.device.type != "cpu"
            )
        self.sampler = Sampler(self.device, seed)
        # The device copy of the scheduler's persistent block table (None until the first
        # step that carries one); kept by applying each step's delta, so every output
        # must be executed, in order.
        self.device_block_table: Tensor | None = None

    def apply_memory_ops(self, out: SchedulerOutput) -> None:
        """Apply the step's block moves before the forward pass.

        In the order the block manager issued them (``out.memory_ops``: swaps, copies,
        host-tier ``"offload"`` (gpu block, tier slot) and ``"load"`` (tier slot, gpu
        block)). Each run completes (in stream order on
        CUDA; an offload returns once the pool holds its bytes) before the next one starts,
        so an offload reads its block before a later op or the forward pass overwrites it,
        and the engine may confirm the ops once this returns.
        """
        self.apply_block_ops(out.memory_ops)

    def apply_block_ops(self, memory_ops: Sequence[tuple[str, object]]) -> None:
        """Apply runs ``[(kind, pairs [n, 2]), ...]`` in order (``take_memory_ops``' list).

        What :meth:`apply_memory_ops` does with a step's list; also for ops drained from
        the manager outside a step.
        """
        for kind, raw in memory_ops:
            pairs = np.asarray(raw, dtype=np.int64).reshape(-1, 2)
            if not pairs.size:
                continue
            if kind == "copy":
                for batch in _conflict_free_batches(pairs):
                    ops.copy_blocks(self.kv_caches, batch)
            elif kind in ("swap_out", "swap_in"):
                self._swap(kind, pairs)
            elif kind in ("offload", "load"):
                self._tier_copy(kind, pairs)
            else:
                raise InvalidArgumentError(
                    f"unknown memory op {kind!r}; expected 'swap_out', 'swap_in', 'copy', "
                    "'offload' or 'load'"
                )

    def _tier_copy(self, kind: str, pairs: np.ndarray) -> None:
        if self.host_pool is None:
            raise InvalidArgumentError(
                f"the scheduler asked for a host-tier {kind} but the runner has no host pool "
                "(host_cache_blocks=0)"
            )
        if kind == "offload":
            offload_blocks(self.host_layout, self.kv_caches, self.host_pool, pairs)
        else:
            load_blocks(self.host_layout, self.host_pool, self.kv_caches, pairs)

    def _swap(self, kind: str, pairs: np.ndarray) -> None:
        if not self.cpu_caches:
            raise InvalidArgumentError(
                "the scheduler asked for a swap but the runner has no CPU blocks"
            )
        for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches, strict=True):
            if kind == "swap_out":
                ops.swap_blocks(k, ck, pairs)
                ops.swap_blocks(v, cv, pairs)
            else:
                ops.swap_blocks(ck, k, pairs)
                ops.swap_blocks(cv, v, pairs)

    def step_block_tables(self, out: SchedulerOutput) -> Tensor:
        """The step's ``[S, max_blocks]`` int32 block tables on the device.

        Gathered (one ``index_select``) from the runner's device copy of the scheduler's
        persistent table, which is uploaded whole only when the scheduler reports a new
        array and otherwise patched with the step's delta (one scatter). A hand-built
        output without ``block_table`` uploads its ``block_tables``.
        """
        if out.block_table is None or out.block_table_rows is None:
            return self._to_device(out.block_tables, torch.int32)
        table = self.device_block_table
        if (
            out.block_table_reallocated
            or table is None
            or tuple(table.shape) != out.block_table.shape
        ):
            table = torch.tensor(out.block_table, dtype=torch.int32, device=self.device)
            self.device_block_table = table
        elif out.block_table_delta is not None and len(out.block_table_delta):
            delta = out.block_table_delta
            reset = np.asarray(delta.reset, dtype=bool)
            if reset.any():
                table[self._to_device(np.asarray(delta.rows)[reset], torch.long)] = 0
            rows, cols = delta_indices(delta)
            table[self._to_device(rows, torch.long), self._to_device(cols, torch.long)] = (
                self._to_device(np.asarray(delta.block_ids), torch.int32)
            )
        return table.index_select(0, self._to_device(out.block_table_rows, torch.long))

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelStepResult:
        """Run one step: memory operations, forward, logits at the sampling rows, sampling."""
        self.sampler.forget(out.finished_request_ids)
        self.apply_memory_ops(out)
        logits = self.forward_logits(out)
        if logits is None:
            return ModelStepResult(
                sampled_token_ids=np.zeros(0, dtype=np.int64),
                sampled_logprobs=np.zeros(0, dtype=np.float32),
            )
        return self.sampler.sample(logits, out)

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> Tensor | None:
        """The forward pass of a step (memory operations already applied).

        Writes the step's K/V into the cache and returns float32 logits
        ``[num_sample_rows, vocab]``, or ``None`` when the step samples nothing (its
        chunks still fill the cache).
        """
        if out.num_tokens == 0:
            return None
        input_ids = self._to_device(out.input_token_ids, torch.long)
        positions = self._to_device(out.positions, torch.long)
        attention = PagedAttention(
            self.kv_caches,
            slot_mapping=self._to_device(out.slot_mapping, torch.long),
            block_tables=self.step_block_tables(out),
            query_start_loc=self._to_device(out.query_start_loc, torch.int32),
            seq_lens=self._to_device(out.seq_lens, torch.int32),
            seq_lens_host=np.asarray(out.seq_lens),
            decode_only=out.num_decode_seqs == out.num_seqs,
            max_seq_len=int(np.max(out.seq_lens)),
            max_query_len=int(np.max(out.num_scheduled_tokens)),
        )
        hidden = self.model(input_ids, positions, attention)
        if out.num_sample_rows == 0:
            return None
        rows = hidden[self._to_device(out.logits_indices, torch.long)]
        return self.model.compute_logits(rows)


def _conflict_free_batches(pairs: np.ndarray) -> list[np.ndarray]:
    """Split ``(src, dst)`` copies into runs that one parallel launch may execute.

    The pairs mean "in this order". A copy queued for a sequence that was then freed in
    the same step can leave a later pair writing a block that an earlier pair reads or
    writes; a copy kernel runs its pairs concurrently, so such a pair starts a new
    launch. The common case (no block both read and written, no repeated destination)
    is one launch, decided with array operations only.
    """
    src, dst = pairs[:, 0], pairs[:, 1]
    if len(np.unique(dst)) == len(dst) and not np.isin(dst, src).any():
        return [pairs]
    batches: list[np.ndarray] = []
    start = 0
    reads: set[int] = set()
    writes: set[int] = set()
    for i, (s, d) in enumerate(pairs.tolist()):
        if d in reads or d in writes or s in writes:
            batches.append(pairs[start:i])
            start, reads, writes = i, set(), set()
        reads.add(s)
        writes.add(d)
    batches.append(pairs[start:])
    return batches
