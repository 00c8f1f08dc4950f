"""The model runner: executes one :class:`~kvblocks.scheduler.SchedulerOutput` on the paged cache.

Per step it applies the swaps, copy-on-write copies and host-tier offloads and loads in the
block manager's order (``SchedulerOutput.memory_ops``), scatters the step's delta of the
persistent block table into its device copy, runs the decoder over the flattened batch with
every layer's attention going through :mod:`kvblocks.ops` (CUDA kernels for CUDA tensors; on
the CPU one :class:`~kvblocks.ops.cpu_attention.CpuAttentionPlan` and one
:class:`~kvblocks.ops.cpu_cache.CpuCacheSlots` per step, shared by every layer), computes
logits only at the sampling rows and samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from kvblocks import ops
from kvblocks.engine.chunked_attention import check_chunk_size, chunked_batch, gather_tables
from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.layer_groups import AttentionLayout, HybridLayout
from kvblocks.engine.models import CausalLM
from kvblocks.engine.sampler import Sampler
from kvblocks.engine.state_cache import StateCache
from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.cpu_attention import CpuAttentionPlan
from kvblocks.ops.cpu_cache import CpuCacheSlots
from kvblocks.scheduler.block_table import delta_indices
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.transfer import allocate_host_pool, load_blocks, offload_blocks
from kvblocks.validation import check_int

__all__ = ["ModelRunner", "PagedAttention", "kv_block_bytes"]

KVCaches = list[tuple[Tensor, Tensor]]


def kv_block_bytes(
    model: CausalLM, block_size: int, dtype: torch.dtype, num_slots: int | None = None
) -> int:
    """Bytes one block takes across its layer slots, K and V: ``num_slots`` slots
    (an :class:`~kvblocks.engine.layer_groups.AttentionLayout`'s ``L``), or by default
    every layer that keeps KV (one group)."""
    c = model.config
    elem = torch.empty(0, dtype=dtype).element_size()
    slots = model.num_kv_layers if num_slots is None else num_slots
    return 2 * slots * c.num_key_value_heads * block_size * c.head_dim * elem


@dataclass(frozen=True)
class _Batch:
    """The batch a group's layers attend: the step's, or a chunked layer's virtual one."""

    query_start_loc: Tensor  # int32 [S + 1]
    seq_lens: Tensor  # int32 [S]
    seq_lens_host: np.ndarray
    max_seq_len: int
    max_query_len: int


@dataclass(frozen=True)
class _GroupStep:
    """What one KV cache group's layers read and write this step."""

    slot_mapping: Tensor  # int64 [T]
    block_tables: Tensor  # int32 [S, B]
    cpu_plan: CpuAttentionPlan | None
    cpu_slots: CpuCacheSlots | None
    batch: _Batch


class PagedAttention:
    """Attention backend over the paged KV cache for one step's batch.

    Writes the new tokens' K/V into their slots, then attends each query to its
    sequence's cached context through the block tables. A batch of decodes only uses
    the decode kernel; anything with a prefill chunk uses the varlen prefill kernel,
    which also serves the decodes in the same launch. Each layer brings its own window,
    scale, soft-cap and sinks (its :class:`~kvblocks.engine.config.AttentionSpec`).

    With KV cache groups (``slot_mappings`` ``[G, T]``, ``block_tables`` ``[G, S, B]``),
    layer ``i`` is in group ``layer_group[i]`` and uses the cache of slot
    ``layer_slot[i]``, reading and writing through its group's table and slot mapping
    (a window group's table holds only the blocks its window still sees, the null
    block 0 before them; the null block is never written and stays zero, so a key
    gathered from it and masked adds exactly nothing). Without a placement, layer ``i``
    is group 0's slot ``i``.

    A chunked layer (``spec.chunk_size``, Llama 4) writes its group's slots and attends
    its group's virtual batch for that chunk (:mod:`kvblocks.engine.chunked_attention`):
    its query rows split at chunk boundaries, each piece ordinary causal attention over
    its chunk's blocks, so the blocks of past chunks (freed by a
    ``chunked_local_attention`` group: null entries) are never read.

    On the CPU the step's gathers and cache rows are computed once per group (and
    chunk), on the first layer that needs them, and each later layer of the group runs
    them; the model's own tensors need no per-layer re-validation.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        *,
        slot_mappings: Tensor,
        block_tables: Tensor,
        query_start_loc: Tensor,
        seq_lens: Tensor,
        seq_lens_host: np.ndarray,
        decode_only: bool,
        max_seq_len: int,
        max_query_len: int,
        layer_group: Sequence[int] | None = None,
        layer_slot: Sequence[int] | None = None,
        cpu_plans: bool = True,
        query_start_loc_host: np.ndarray | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        # False runs CPU tensors through the ops front-ends layer by layer, as on CUDA
        # (tests check the CUDA path's arguments that way).
        self.cpu_plans = cpu_plans
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        # The host copy lets fp16/bf16 decode plan its splits by length without a sync.
        self.seq_lens_host = seq_lens_host
        self.decode_only = decode_only
        # Host-side maxima spare the CUDA path a device sync per layer when planning launches.
        self.max_seq_len = max_seq_len
        self.max_query_len = max_query_len
        self.layer_group = layer_group
        self.layer_slot = layer_slot
        # Host copy for the chunked layers' virtual batches (read from the device if absent).
        self.query_start_loc_host = query_start_loc_host
        if slot_mappings.dim() == 1:
            slot_mappings = slot_mappings[None]
        if block_tables.dim() == 2:
            block_tables = block_tables[None]
        if slot_mappings.shape[0] != block_tables.shape[0]:
            raise InvalidArgumentError(
                f"{slot_mappings.shape[0]} slot mappings for {block_tables.shape[0]} block "
                "tables; expected one of each per KV cache group"
            )
        self.slot_mappings = slot_mappings
        self.block_tables = block_tables
        self.key_cache = kv_caches[0][0]
        self._batch = _Batch(query_start_loc, seq_lens, seq_lens_host, max_seq_len, max_query_len)
        # (group, chunk or None) -> its step; built when a layer first needs it.
        self._steps: dict[tuple[int, int | None], _GroupStep] = {}
        self._cpu_slots: dict[int, CpuCacheSlots] = {}
        self._chunk_pieces: dict[int, tuple[_Batch, Tensor]] = {}

    def _step(self, group: int, chunk: int | None) -> _GroupStep:
        step = self._steps.get((group, chunk))
        if step is None:
            step = self._build_step(group, chunk)
            self._steps[(group, chunk)] = step
        return step

    def _pieces(self, chunk: int) -> tuple[_Batch, Tensor]:
        """The virtual batch of ``chunk`` and its flat indices into every group's table
        (the same pieces in every group: built and uploaded once per step)."""
        pieces = self._chunk_pieces.get(chunk)
        if pieces is None:
            qsl = self.query_start_loc_host
            qsl = self.query_start_loc.to("cpu").numpy() if qsl is None else qsl
            block_size = self.key_cache.shape[2]
            split = chunked_batch(
                qsl, self.seq_lens_host, chunk, block_size, decode_only=self.decode_only
            )
            tables = self.block_tables
            qsl_t, lens_t, index = split.to_device(tables.device, tables.shape[2])
            batch = _Batch(qsl_t, lens_t, split.seq_lens, split.max_seq_len, split.max_query_len)
            pieces = self._chunk_pieces[chunk] = (batch, index)
        return pieces

    def _build_step(self, group: int, chunk: int | None) -> _GroupStep:
        slot_mapping, tables, batch = (
            self.slot_mappings[group],
            self.block_tables[group],
            self._batch,
        )
        key_cache = self.key_cache
        if chunk is not None:
            batch, index = self._pieces(chunk)
            tables = gather_tables(tables, index)
        if key_cache.is_cuda or not self.cpu_plans:
            return _GroupStep(slot_mapping, tables, None, None, batch)
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        shape = {"num_blocks": num_blocks, "num_kv_heads": num_kv_heads, "block_size": block_size}
        native = key_cache.dtype == torch.float32
        if self.decode_only:
            plan = CpuAttentionPlan.for_decode(
                tables, batch.seq_lens, native_decode=native, **shape
            )
        else:
            plan = CpuAttentionPlan.for_prefill(
                tables, batch.query_start_loc, batch.seq_lens, native_decode=native, **shape
            )
        # The group's cache rows are the same whichever batch its layers attend.
        cpu_slots = self._cpu_slots.get(group)
        if cpu_slots is None:
            cpu_slots = self._cpu_slots[group] = CpuCacheSlots.build(slot_mapping, **shape)
        return _GroupStep(slot_mapping, tables, plan, cpu_slots, batch)

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
        if self.layer_group is None or self.layer_slot is None:
            group_idx, slot = 0, layer_idx
        else:
            group_idx, slot = self.layer_group[layer_idx], self.layer_slot[layer_idx]
        group = self._step(group_idx, spec.chunk_size)
        batch = group.batch
        key_cache, value_cache = self.kv_caches[slot]
        if group.cpu_plan is not None and group.cpu_slots is not None:
            group.cpu_slots.write(key, value, key_cache, value_cache)
            return group.cpu_plan.run(
                query,
                key_cache,
                value_cache,
                scale=spec.scale,
                sliding_window=spec.sliding_window,
                soft_cap=spec.soft_cap,
                sinks=sinks,
            )
        ops.reshape_and_cache(key, value, key_cache, value_cache, group.slot_mapping)
        if self.decode_only:
            return ops.paged_attention(
                query,
                key_cache,
                value_cache,
                group.block_tables,
                batch.seq_lens,
                scale=spec.scale,
                sliding_window=spec.sliding_window,
                soft_cap=spec.soft_cap,
                sinks=sinks,
                max_seq_len=batch.max_seq_len,
                seq_lens_host=batch.seq_lens_host,
            )
        return ops.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            group.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            scale=spec.scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.soft_cap,
            sinks=sinks,
            max_query_len=batch.max_query_len,
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
            V for every layer slot (``host_layout``; a recurrent hybrid's state group's
            block: its states, the row as wide as ``tier_layout`` says), pinned when the
            model is on CUDA; ``"offload"`` and ``"load"`` ops move blocks in and out.
        seed: seed of the sampler's shared generator.
        layout: a hybrid recurrent model's KV cache groups
            (:func:`~kvblocks.engine.layer_groups.hybrid_layout`): its mixers' states are
            kept in a :class:`~kvblocks.engine.state_cache.StateCache` and each step reads
            and saves them where ``SchedulerOutput.state_mappings`` says. With a host tier
            a pool row is as wide as the wider of a KV payload and a block's states, and
            an offload or load moves the KV of an attention group's block (group 0) or the
            states of a state group's block, by the group of each slot.
        tier_slot_groups: the manager's ``tier_slot_groups`` (the group of the block each
            host-tier slot holds); needed by a recurrent model with a host tier.
        attention_layout: a model mixing attention kinds
            (:func:`~kvblocks.engine.layer_groups.attention_layout`): the runner keeps
            one K/V tensor pair per layer slot (``L``, not one per layer) and each layer
            reads and writes its slot through its group's table and slot mapping. The
            manager must have the layout's groups.
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
        layout: HybridLayout | None = None,
        attention_layout: AttentionLayout | None = None,
        tier_slot_groups: Callable[[np.ndarray], Sequence[int | None]] | None = None,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        c = model.config
        layers, heads, dim = model.num_kv_layers, c.num_key_value_heads, c.head_dim
        for spec in c.layer_attention():  # chunked layers read each chunk from its first block
            if spec.chunk_size is not None:
                check_chunk_size(spec.chunk_size, block_size)
        self.attention_layout = attention_layout
        if attention_layout is not None:
            if len(attention_layout.layer_group) != layers or layout is not None:
                raise InvalidArgumentError(
                    f"the attention layout places {len(attention_layout.layer_group)} layers "
                    f"but the model has {layers} attention layers"
                    + (" and recurrent ones" if layout is not None else "")
                )
            layers = attention_layout.layers_per_group
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
        self.host_cache_blocks = check_int(host_cache_blocks, "host_cache_blocks", minimum=0)
        self.states: StateCache | None = None
        if layout is not None:
            if host_cache_blocks > 0 and tier_slot_groups is None:
                raise InvalidArgumentError(
                    "a recurrent model's host tier needs tier_slot_groups (the manager's): "
                    "a slot holds KV or states by its block's group"
                )
            self.states = StateCache(
                getattr(model, "mixers", []),
                layout,
                num_blocks=num_blocks,
                num_cpu_blocks=num_cpu_blocks,
                device=self.device,
                pin_memory=self.device.type != "cpu" and num_cpu_blocks > 0,
            )
        # The KV tiles of a block (what the transfer functions move) ...
        self.host_layout = KVLayout.from_caches(self.kv_caches)
        # ... and a host-pool row: as wide as the wider of those and a block's states.
        self.tier_layout = self.host_layout
        if self.states is not None:
            self.tier_layout = replace(self.host_layout, state_nbytes=self.states.row_nbytes)
        self.tier_slot_groups = tier_slot_groups
        self.host_pool: Tensor | None = None
        if host_cache_blocks > 0:
            self.host_pool = allocate_host_pool(
                self.tier_layout, host_cache_blocks, pin_memory=self.device.type != "cpu"
            )
        self.sampler = Sampler(self.device, seed)
        # The device copy of the scheduler's persistent block tables, [G, rows, blocks]
        # (None until the first step that carries one); kept by applying each step's
        # deltas, so every output must be executed, in order.
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
                    if self.states is not None:
                        self.states.copy(batch)
            elif kind in ("swap_out", "swap_in"):
                self._swap(kind, pairs)
                if self.states is not None:
                    self.states.swap(kind, pairs)
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
        if self.states is None:
            self._kv_tier_copy(kind, pairs)
            return
        # A recurrent hybrid: group 0's slots hold KV, the state groups' slots states.
        slots = pairs[:, 1] if kind == "offload" else pairs[:, 0]
        assert self.tier_slot_groups is not None  # checked in __init__
        groups = np.asarray(
            [-1 if g is None else g for g in self.tier_slot_groups(slots)], dtype=np.int64
        )
        if (groups < 0).any():
            raise InvalidArgumentError(
                f"host-tier {kind} names slots that hold no block: {slots[groups < 0].tolist()}"
            )
        kv = groups == 0
        if kv.any():
            self._kv_tier_copy(kind, pairs[kv])
        if (~kv).any():
            self._state_tier_copy(kind, pairs[~kv])

    def _kv_tier_copy(self, kind: str, pairs: np.ndarray) -> None:
        assert self.host_pool is not None
        # The pool's rows may be wider than a KV payload (a recurrent model's states).
        pool = self.host_pool[:, : self.host_layout.payload_nbytes]
        if kind == "offload":
            offload_blocks(self.host_layout, self.kv_caches, pool, pairs)
        else:
            load_blocks(self.host_layout, pool, self.kv_caches, pairs)

    def _state_tier_copy(self, kind: str, pairs: np.ndarray) -> None:
        assert self.host_pool is not None and self.states is not None
        width = self.states.row_nbytes
        if kind == "offload":
            rows = self.states.gather_rows(pairs[:, 0])
            slots = torch.from_numpy(np.ascontiguousarray(pairs[:, 1]))
            self.host_pool[:, :width].index_copy_(0, slots, rows)
        else:
            slots = torch.from_numpy(np.ascontiguousarray(pairs[:, 0]))
            self.states.scatter_rows(self.host_pool[:, :width].index_select(0, slots), pairs[:, 1])

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
        """The step's ``[S, max_blocks]`` int32 block tables of group 0 on the device
        (see :meth:`step_group_block_tables`)."""
        return self.step_group_block_tables(out)[0]

    def step_group_block_tables(self, out: SchedulerOutput) -> Tensor:
        """The step's ``[G, S, max_blocks]`` int32 block tables of every group on the device.

        Gathered (one ``index_select``) from the runner's device copy of the scheduler's
        persistent tables, which is uploaded whole only when the scheduler reports a new
        array and otherwise patched with each group's delta (one scatter per group that
        changed). A hand-built output without ``block_table`` uploads its
        ``group_block_tables``.
        """
        if out.block_table is None or out.block_table_rows is None:
            return self._to_device(out.group_block_tables, torch.int32)
        host = out.group_block_table
        if host is None:
            host = out.block_table[None]
        deltas = out.group_block_table_deltas
        if deltas is None:
            deltas = [out.block_table_delta] if out.block_table_delta is not None else []
        table = self.device_block_table
        if out.block_table_reallocated or table is None or tuple(table.shape) != host.shape:
            table = torch.tensor(host, dtype=torch.int32, device=self.device)
            self.device_block_table = table
        else:
            for group, delta in enumerate(deltas):
                if delta is None or not len(delta):
                    continue
                rows_of = table[group]
                reset = np.asarray(delta.reset, dtype=bool)
                if reset.any():
                    rows_of[self._to_device(np.asarray(delta.rows)[reset], torch.long)] = 0
                rows, cols = delta_indices(delta)
                rows_of[self._to_device(rows, torch.long), self._to_device(cols, torch.long)] = (
                    self._to_device(np.asarray(delta.block_ids), torch.int32)
                )
        return table.index_select(1, self._to_device(out.block_table_rows, torch.long))

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
        layout = self.attention_layout
        slot_mappings = out.group_slot_mappings
        if slot_mappings is None:
            slot_mappings = np.asarray(out.slot_mapping)[None]
        block_tables = self.step_group_block_tables(out)
        if layout is None:
            # One group's layers (a model of one attention kind, or Bamba's attention
            # group 0; its state groups' slot mappings are all -1).
            slot_mappings, block_tables = slot_mappings[:1], block_tables[:1]
        elif block_tables.shape[0] != layout.num_groups:
            raise InvalidArgumentError(
                f"the step carries {block_tables.shape[0]} KV cache groups but the runner's "
                f"layout has {layout.num_groups}"
            )
        attention = PagedAttention(
            self.kv_caches,
            slot_mappings=self._to_device(slot_mappings, torch.long),
            block_tables=block_tables,
            layer_group=None if layout is None else layout.layer_group,
            layer_slot=None if layout is None else layout.layer_slot,
            query_start_loc=self._to_device(out.query_start_loc, torch.int32),
            seq_lens=self._to_device(out.seq_lens, torch.int32),
            seq_lens_host=np.asarray(out.seq_lens),
            decode_only=out.num_decode_seqs == out.num_seqs,
            max_seq_len=int(np.max(out.seq_lens)),
            max_query_len=int(np.max(out.num_scheduled_tokens)),
            query_start_loc_host=np.asarray(out.query_start_loc),
        )
        if self.states is None:
            hidden = self.model(input_ids, positions, attention)
        else:
            hidden = self.model(input_ids, positions, attention, states=self.states.step(out))
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
