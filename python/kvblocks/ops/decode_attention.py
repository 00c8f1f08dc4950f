"""Plan/run decode attention: ``decode_attention_kernel`` driven by a length-aware plan.

:class:`DecodeAttention` is the object an engine keeps per model (or per CUDA-graph batch
size): :meth:`~DecodeAttention.plan` once per step from the host-side lengths, then
:meth:`~DecodeAttention.run` once per layer. The plan (work items, item count, merge
ranges; see :mod:`kvblocks.ops.decode_plan`) lives in device buffers that the object
allocates once, together with the fp32 partials of split sequences, so

* a step's layers reuse one plan (``run`` does no planning, no host-to-device copy and
  no re-validation of what ``plan`` and earlier calls checked: about 5 us of Python per
  layer, see ``benches/ops/test_bench_host_overhead.py``);
* a plan for lengths seen before is taken from a small cache, and re-planning the
  lengths already in the device buffers copies nothing;
* with ``cuda_graph=True`` the attention grid is fixed at ``max_items`` (CTAs past the
  device-side item count return at once) and the merge kernel always runs (empty
  ranges do nothing), so a graph captured once replays correctly after ``plan`` has
  rewritten the buffers for other, longer or shorter, lengths.

The kernels' argument layout is the decode plan ABI in ``cuda/decode_attention.cu``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import cuda_device
from kvblocks.ops.checks import (
    INT32_MAX,
    SUPPORTED_HEAD_SIZES,
    check_block_size,
    check_cache_pair,
    check_head_size,
    check_index_tensor,
    check_ints,
    check_optional_positive,
    check_scale,
    check_sliding_window,
)
from kvblocks.ops.cuda_sources import (
    DECODE_BLOCK_SIZES,
    DECODE_GROUPS,
    DECODE_STAGES,
    DECODE_THREADS,
    decode_kernel_name,
    decode_smem_bytes,
    decode_stages_instantiated,
    merge_partials_name,
)
from kvblocks.ops.decode_plan import (
    DEFAULT_GRANULARITY,
    DEFAULT_MIN_CHUNK_TOKENS,
    DecodeItems,
    plan_decode,
)
from kvblocks.ops.launch_plan import CTAS_PER_SM, KernelLaunch, Launcher
from kvblocks.validation import check_int, check_optional_int

__all__ = [
    "DECODE_DTYPES",
    "DecodeAttention",
    "decode_kernel_group",
    "decode_kernel_stages",
    "decode_kernel_supported",
]

DECODE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
"""Element types ``decode_attention_kernel`` is instantiated for (fp32 keeps the old kernel)."""
_NULL = np.uint64(0)  # a null kernel pointer: no attention sinks
_PLAN_CACHE = 16  # plans kept per object: a step's lengths plus a few alternating batches


def decode_kernel_group(head_size: int, group: int) -> int:
    """The ``GROUP`` instantiation serving ``group`` query heads per KV head.

    The smallest instantiated value at least ``group``; a larger group is split into
    ``ceil(group / GROUP)`` CTAs per KV head (grid.y).
    """
    values = [g for g in DECODE_GROUPS if decode_stages_instantiated(head_size, g)]
    return next((g for g in values if g >= group), values[-1])


def decode_kernel_stages(head_size: int, group_t: int, smem_limit: int | None) -> int | None:
    """The ``STAGES`` variant of ``decode_attention_kernel<.., GROUP=group_t>`` to launch on a
    device that allows ``smem_limit`` bytes of dynamic shared memory per CTA (its
    ``sharedMemPerBlockOptin``; None: no limit): the first compiled variant that fits, in
    the order of :data:`~kvblocks.ops.cuda_sources.DECODE_STAGES`, or None if none does."""
    for stages in decode_stages_instantiated(head_size, group_t):
        need = decode_smem_bytes(torch.float16, head_size, 16, group_t, stages)
        if smem_limit is None or need <= smem_limit:
            return stages
    return None


def decode_kernel_supported(
    dtype: torch.dtype, head_size: int, block_size: int, smem_limit: int | None = None
) -> bool:
    """Whether ``decode_attention_kernel`` is instantiated for these parameters and, with
    ``smem_limit`` (the device's per-CTA opt-in limit), has a variant that fits it at every
    GQA group size."""
    if not (
        dtype in DECODE_DTYPES
        and head_size in SUPPORTED_HEAD_SIZES
        and block_size in DECODE_BLOCK_SIZES
    ):
        return False
    groups = [g for g in DECODE_GROUPS if decode_stages_instantiated(head_size, g)]
    return all(decode_kernel_stages(head_size, g, smem_limit) is not None for g in groups)


@dataclass(frozen=True)
class _Launches:
    """What a plan fixes of the launches; ``run`` adds the per-layer pointers."""

    attention_grid: tuple[int, int, int]
    merge: bool
    num_seqs: int
    query_shape: torch.Size
    tail: tuple[np.generic, ...]  # attention args after value_cache, block_tables onwards
    merge_tail: tuple[np.generic, ...]  # merge args after out


class DecodeAttention:
    """Decode attention over the paged cache with a cached, device-resident split plan.

    Args:
        num_heads, num_kv_heads, head_size, block_size, dtype: the model's attention
            shape (``num_heads`` a multiple of ``num_kv_heads``; fp16 or bf16).
        device: where the caches live (``"cpu"`` only with an explicit ``launcher``,
            e.g. the CPU emulation in the tests).
        max_seqs: the largest batch :meth:`plan` accepts.
        scale, sliding_window, soft_cap: as in :func:`kvblocks.ops.paged_attention`
            (fixed per object: a model with per-layer windows keeps one object per
            window).
        target_ctas: CTAs that fill the device once; default on CUDA the SM count times
            the CTAs whose shared memory fits an SM (2 at head 128 on H100/A100).
        smem_limit: dynamic shared memory a CTA may use (bytes); default on CUDA the
            device's ``sharedMemPerBlockOptin``, elsewhere no limit. The kernel variant
            with two K/V buffers per warp is launched where it fits, else the one-buffer
            variant (head 256 on sm_86/sm_89).
        max_items: capacity of the item buffer (and of the partials); default
            ``target_ctas / (num_kv_heads x head_chunks) + max_seqs``, enough for every
            plan :func:`~kvblocks.ops.decode_plan.plan_decode` makes.
        cuda_graph: launch the fixed grid (``max_items``) and always the merge kernel,
            so a captured graph replays correctly after :meth:`plan` with other lengths.
        launcher: runs one :class:`~kvblocks.ops.launch_plan.KernelLaunch`; default the
            CUDA device layer's launcher for ``device``
            (:func:`kvblocks.ops.cuda_device.decode_launcher`).

    ``plan`` and ``run`` must be issued on the same stream. In graph mode the kernel
    arguments are captured, so each ``run`` replayed must use the same ``query``,
    ``out``, ``sinks`` and cache tensors, and ``plan`` the same ``block_tables`` buffer
    and batch size as at capture (pad the batch with zero lengths).
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_seqs: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        target_ctas: int | None = None,
        smem_limit: int | None = None,
        max_items: int | None = None,
        cuda_graph: bool = False,
        launcher: Launcher | None = None,
        granularity: int = DEFAULT_GRANULARITY,
        min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
    ) -> None:
        for name, value in (
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("max_seqs", max_seqs),
        ):
            check_int(value, name, minimum=1, expected="a positive int")
        # plan_decode's check, made before any buffer is allocated.
        check_ints(granularity=granularity, min_chunk_tokens=min_chunk_tokens, minimum=1)
        if num_heads % num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        check_head_size(head_size)
        check_block_size(block_size)
        if dtype not in DECODE_DTYPES:
            raise InvalidArgumentError(
                f"DecodeAttention runs fp16 and bf16, got {dtype}; use "
                "kvblocks.ops.paged_attention for fp32"
            )
        check_scale(scale)
        check_sliding_window(sliding_window)
        check_optional_positive(soft_cap, "soft_cap")
        if not isinstance(cuda_graph, bool):
            raise InvalidArgumentError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        if launcher is not None and not callable(launcher):
            raise InvalidArgumentError(
                f"launcher must be callable or None, got {type(launcher).__name__}"
            )
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(f"device {device!r} is not a torch device: {exc}") from exc
        if self.device.type == "cuda" and (
            not torch.cuda.is_available() or (self.device.index or 0) >= torch.cuda.device_count()
        ):
            raise InvalidArgumentError(f"device {device!r}: no such CUDA device")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_optional_int(smem_limit, "smem_limit", minimum=1, expected="a positive int")
        group = num_heads // num_kv_heads
        group_t = decode_kernel_group(head_size, group)
        if self.device.type == "cuda" and smem_limit is None:
            smem_limit = cuda_device.smem_optin(self.device.index or 0)
        stages = decode_kernel_stages(head_size, group_t, smem_limit)
        if stages is None:
            need = decode_smem_bytes(dtype, head_size, block_size, group_t, DECODE_STAGES[-1])
            raise InvalidArgumentError(
                f"decode at head size {head_size} needs {need} bytes of shared memory per "
                f"CTA, the device allows {smem_limit}; use kvblocks.ops.paged_attention "
                "with max_seq_len (the split-K kernel)"
            )
        self.stages = stages
        self.smem_bytes = decode_smem_bytes(dtype, head_size, block_size, group_t, stages)
        if self.device.type == "cuda":
            if launcher is None:
                launcher = cuda_device.decode_launcher(self.device.index or 0)
            if target_ctas is None:
                target_ctas = cuda_device.decode_target_ctas(
                    self.device.index or 0, self.smem_bytes
                )
        elif launcher is None:
            raise InvalidArgumentError(
                f"DecodeAttention on {self.device} needs an explicit launcher"
            )
        if target_ctas is None:
            target_ctas = CTAS_PER_SM
        check_int(target_ctas, "target_ctas", minimum=1, expected="a positive int")
        self._launch = launcher
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.dtype = dtype
        self.max_seqs = max_seqs
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.cuda_graph = bool(cuda_graph)
        self.granularity = granularity
        self.min_chunk_tokens = min_chunk_tokens
        self.head_chunks = math.ceil(group / group_t)
        self.target_items = max(1, target_ctas // (num_kv_heads * self.head_chunks))
        if max_items is None:
            max_items = self.target_items + max_seqs
        check_int(
            max_items,
            "max_items",
            minimum=max_seqs,
            expected=f"an int of at least max_seqs {max_seqs}",
        )
        if max_items > INT32_MAX or num_kv_heads * self.head_chunks > 65535:
            raise InvalidArgumentError(
                f"the decode grid exceeds CUDA's limits: max_items {max_items} (at most "
                f"2^31 - 1), num_kv_heads x head chunks {num_kv_heads * self.head_chunks} "
                "(at most 65535)"
            )
        self.max_items = max_items
        self.kernel = decode_kernel_name(dtype, head_size, block_size, group_t, stages)
        self.merge_kernel = merge_partials_name(dtype, head_size)
        # One int32 buffer = one host-to-device copy per new plan: [0] item count,
        # [4, 4 + 4 * max_items) items (int4, 16-byte aligned), then merge_indptr.
        self._items_at = 4
        self._indptr_at = 4 + 4 * max_items
        size = self._indptr_at + max_seqs + 1
        pinned = self.device.type == "cuda"
        try:
            self._host = torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
            self._plan_buf = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._part_out = torch.empty(
                max_items * num_heads * head_size, dtype=torch.float32, device=self.device
            )
            self._part_ml = torch.empty(
                max_items * num_heads * 2, dtype=torch.float32, device=self.device
            )
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory is a RuntimeError
            raise InvalidArgumentError(
                f"max_items {max_items} (max_seqs {max_seqs}) x num_heads {num_heads}: the "
                f"plan buffers and partials do not fit on {self.device}: {exc}"
            ) from exc
        self._host_np = self._host.numpy()
        self._copied: torch.cuda.Event | None = None
        base = self._plan_buf.data_ptr()
        self._items_ptr = np.uint64(base + 4 * self._items_at)
        self._count_ptr = np.uint64(base)
        self._indptr_ptr = np.uint64(base + 4 * self._indptr_at)
        self._workspace_args = (
            np.uint64(self._part_out.data_ptr()),
            np.uint64(self._part_ml.data_ptr()),
        )
        self._scalar_args = (np.float32(self.scale), np.float32(soft_cap or 0.0))
        self._plans: OrderedDict[tuple[str, bytes], DecodeItems] = OrderedDict()
        self._uploaded: tuple[str, bytes] | None = None  # the plan in the device buffer
        self._tables: tuple[int, torch.Size] | None = None
        self._block_tables: torch.Tensor | None = None
        self._caches: dict[tuple[int, int], tuple[torch.Size, np.int32]] = {}
        self._launches: _Launches | None = None
        self.last_plan: DecodeItems | None = None
        """The plan the next :meth:`run` executes (host copy, for inspection)."""

    def plan(self, seq_lens: np.ndarray, block_tables: torch.Tensor) -> DecodeItems:
        """Plan the batch: host int ``seq_lens [num_seqs]``, ``block_tables`` int32
        ``[num_seqs, max_blocks]`` on the device (read by every later :meth:`run`).

        Returns the plan (host arrays). Re-planning the lengths already uploaded copies
        nothing; other lengths seen recently skip the planner but are copied.
        """
        if (
            type(seq_lens) is np.ndarray
            and seq_lens.ndim == 1
            and type(block_tables) is torch.Tensor
            and (seq_lens.dtype.char, seq_lens.tobytes()) == self._uploaded
            and (block_tables.data_ptr(), block_tables.shape) == self._tables
            and block_tables.dtype is torch.int32
            and block_tables.device == self.device
            and block_tables.is_contiguous()
            and self.last_plan is not None
        ):
            return self.last_plan  # the next layer of the same step: nothing to do
        if (
            not isinstance(seq_lens, np.ndarray)
            or seq_lens.ndim != 1
            or seq_lens.dtype.kind not in "iu"
        ):
            raise InvalidArgumentError("seq_lens must be a 1-D NumPy integer array")
        num_seqs = int(seq_lens.shape[0])
        if num_seqs > self.max_seqs:
            raise InvalidArgumentError(
                f"a batch of {num_seqs} exceeds this DecodeAttention's max_seqs {self.max_seqs}"
            )
        check_index_tensor(
            block_tables, "block_tables", (torch.int32,), (num_seqs, None), self.device
        )
        max_blocks = int(block_tables.shape[1])
        if num_seqs and (
            int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_blocks * self.block_size
        ):
            raise InvalidArgumentError(
                f"seq_lens must be in [0, {max_blocks * self.block_size}] (max_blocks "
                f"{max_blocks} * block_size {self.block_size}), got range "
                f"[{int(seq_lens.min())}, {int(seq_lens.max())}]"
            )
        key = (seq_lens.dtype.char, seq_lens.tobytes())
        items = self._plans.get(key)
        if items is None:
            items = plan_decode(
                seq_lens,
                target_items=self.target_items,
                max_items=self.max_items,
                sliding_window=self.sliding_window,
                granularity=self.granularity,
                min_chunk_tokens=self.min_chunk_tokens,
            )
            self._plans[key] = items
            if len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        if key != self._uploaded:
            self._uploaded = None  # a failed copy must not leave a stale key behind
            self._upload(items)
            self._uploaded = key
        tables = (block_tables.data_ptr(), block_tables.shape)
        if self._launches is None or tables != self._tables or items is not self.last_plan:
            self._launches = self._pack(items, num_seqs, block_tables)
            self._tables = tables
        # The packed arguments hold its address: keep the tensor alive (a caller's
        # temporary would otherwise be freed and its memory reused before run()).
        self._block_tables = block_tables
        self.last_plan = items
        return items

    def _upload(self, items: DecodeItems) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer may still feed the last copy
        host = self._host_np
        host[0] = items.num_items
        host[self._items_at : self._items_at + 4 * items.num_items] = items.items.reshape(-1)
        n = items.merge_indptr.shape[0]
        host[self._indptr_at : self._indptr_at + n] = items.merge_indptr
        if self.device.type == "cuda":
            self._plan_buf.copy_(self._host, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record(torch.cuda.current_stream(self.device))
        else:
            self._plan_buf.copy_(self._host)

    def _pack(self, items: DecodeItems, num_seqs: int, block_tables: torch.Tensor) -> _Launches:
        grid_x = self.max_items if self.cuda_graph else items.num_items
        tail = (
            np.uint64(block_tables.data_ptr()), self._items_ptr, self._count_ptr,
            np.int32(num_seqs), np.int32(self.num_heads), np.int32(self.num_kv_heads),
            np.int32(block_tables.shape[1]),
        )  # fmt: skip
        merge_tail = (
            *self._workspace_args, self._indptr_ptr, np.int32(num_seqs), np.int32(self.num_heads),
        )  # fmt: skip
        return _Launches(
            attention_grid=(grid_x, self.num_kv_heads * self.head_chunks, 1),
            merge=self.cuda_graph or items.num_slots > 0,
            num_seqs=num_seqs,
            query_shape=torch.Size((num_seqs, self.num_heads, self.head_size)),
            tail=tail,
            merge_tail=merge_tail,
        )

    def _check_caches(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> tuple[torch.Size, np.int32]:
        """Full validation of a cache pair seen for the first time; remembered by address."""
        if not isinstance(key_cache, torch.Tensor) or not isinstance(value_cache, torch.Tensor):
            raise InvalidArgumentError("key_cache and value_cache must be torch tensors")
        check_cache_pair(key_cache, value_cache)
        _, kv_heads, block_size, head_size = key_cache.shape
        if (
            key_cache.dtype != self.dtype
            or key_cache.device != self.device
            or (kv_heads, block_size, head_size)
            != (self.num_kv_heads, self.block_size, self.head_size)
        ):
            raise InvalidArgumentError(
                f"caches {tuple(key_cache.shape)} {key_cache.dtype} on {key_cache.device} do "
                f"not match this DecodeAttention ([*, {self.num_kv_heads}, {self.block_size}, "
                f"{self.head_size}] {self.dtype} on {self.device})"
            )
        entry = (key_cache.shape, np.int32(key_cache.shape[0]))
        if len(self._caches) > 1024:  # a caller cycling through fresh caches
            self._caches.clear()
        self._caches[(key_cache.data_ptr(), value_cache.data_ptr())] = entry
        return entry

    def _check_query(self, query: torch.Tensor, launches: _Launches) -> None:
        if not isinstance(query, torch.Tensor):
            raise InvalidArgumentError(f"query must be a torch.Tensor, got {type(query).__name__}")
        if query.shape != launches.query_shape:
            raise InvalidArgumentError(
                f"query has shape {list(query.shape)}, the plan expects "
                f"{list(launches.query_shape)} ([num_seqs, num_heads, head_size])"
            )
        if query.dtype != self.dtype or query.device != self.device:
            raise InvalidArgumentError(
                f"query is {query.dtype} on {query.device}, expected {self.dtype} on {self.device}"
            )
        if not query.is_contiguous():
            raise InvalidArgumentError("query must be contiguous")

    def _sinks_address(self, sinks: torch.Tensor) -> np.uint64:
        if not (
            type(sinks) is torch.Tensor
            and sinks.dtype is torch.float32
            and sinks.shape == (self.num_heads,)
            and sinks.device == self.device
            and sinks.is_contiguous()
        ):
            raise InvalidArgumentError(
                f"sinks must be a contiguous float32 tensor [{self.num_heads}] on "
                f"{self.device} (one logit per query head), got "
                + (
                    f"{sinks.dtype} {list(sinks.shape)} on {sinks.device}"
                    if isinstance(sinks, torch.Tensor)
                    else type(sinks).__name__
                )
            )
        address: np.uint64 = np.uint64(sinks.data_ptr())
        return address

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``query [num_seqs, num_heads, head_size]`` over one layer's caches with
        the current plan; returns ``out`` (allocated when not given).

        ``sinks``: the layer's attention-sink logits, contiguous fp32 ``[num_heads]`` on
        the device (gpt-oss; see :mod:`kvblocks.ops.reference`), added once per row where
        it is normalized (by the attention kernel for an unsplit sequence, by the merge
        for a split one). Their values are read by the kernel, not checked here (that
        would sync): :func:`kvblocks.ops.paged_attention` refuses non-finite ones.
        """
        launches = self._launches
        if launches is None:
            raise InvalidArgumentError("DecodeAttention.run needs a plan(): call plan() first")
        # The fast path checks only what can differ from a validated call; anything
        # unexpected takes the full checks, which raise with a precise message.
        if not (
            type(query) is torch.Tensor
            and query.shape == launches.query_shape
            and query.dtype is self.dtype
            and query.device == self.device
            and query.is_contiguous()
        ):
            self._check_query(query, launches)
        try:
            cache = self._caches.get((key_cache.data_ptr(), value_cache.data_ptr()))
        except AttributeError:  # not tensors: the full checks below name them
            cache = None
        if (
            cache is None
            or key_cache.shape != cache[0]
            or value_cache.shape != cache[0]
            or key_cache.dtype is not self.dtype
            or value_cache.dtype is not self.dtype
            or key_cache.device != self.device
            or value_cache.device != self.device
            or not key_cache.is_contiguous()
            or not value_cache.is_contiguous()
        ):
            cache = self._check_caches(key_cache, value_cache)
        if query.data_ptr() % 16:
            query = query.clone()
        if out is None:
            out = torch.empty_like(query)
        elif not (
            type(out) is torch.Tensor
            and out.shape == launches.query_shape
            and out.dtype is self.dtype
            and out.device == self.device
            and out.is_contiguous()
            and out.data_ptr() % 16 == 0
        ):
            raise InvalidArgumentError(
                "out must be a contiguous, 16-byte aligned tensor like the query "
                f"{list(launches.query_shape)} {self.dtype} on {self.device}"
            )
        sinks_ptr = _NULL if sinks is None else self._sinks_address(sinks)
        if launches.num_seqs == 0:
            return out
        out_ptr = np.uint64(out.data_ptr())
        args = (
            out_ptr, *self._workspace_args, np.uint64(query.data_ptr()),
            np.uint64(key_cache.data_ptr()), np.uint64(value_cache.data_ptr()), *launches.tail,
            cache[1], *self._scalar_args, sinks_ptr,
        )  # fmt: skip
        self._launch(
            KernelLaunch(
                self.kernel,
                launches.attention_grid,
                (DECODE_THREADS, 1, 1),
                self.smem_bytes,
                args,
            )
        )
        if launches.merge:
            self._launch(
                KernelLaunch(
                    self.merge_kernel, (launches.num_seqs, self.num_heads, 1),
                    (DECODE_THREADS, 1, 1), 0, (out_ptr, *launches.merge_tail, sinks_ptr),
                )
            )  # fmt: skip
        return out
