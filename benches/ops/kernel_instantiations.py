"""What the static kernel model (:mod:`kernel_model`) models: the GPUs it compares
against (per-SM limits and peaks), the kernel instantiations (kind, dtype, head, GQA
ratio, block size, architecture), the shape each runs (as its ``.cu`` file and the host
planner compute it) and the default set of instantiations."""

from __future__ import annotations

from dataclasses import dataclass

import ceilings

THREADS = 128
WARPS = THREADS // 32
ISSUE_PER_CYCLE = 4
"""Warp-instructions an SM issues per cycle (4 sub-partitions, one each), sm_80 and sm_90."""


@dataclass(frozen=True)
class Gpu:
    """The per-SM limits and peaks the model compares against."""

    name: str
    arch: str
    sms: int
    clock_ghz: float
    hbm_tb_s: float
    tensor_tflops: float
    """Dense fp16/bf16 tensor-core peak (no sparsity)."""
    smem_per_sm: int
    regs_per_sm: int = 65536
    max_warps: int = 64
    max_ctas: int = 32
    latency_cycles: int = 800
    """Assumed HBM load latency under load (an assumption, not a measured figure)."""
    fp32_lanes_per_smsp: int = 32
    mma_sync_fraction: float = 1.0
    """Share of ``tensor_tflops`` that ``mma.sync`` reaches (H100's peak needs wgmma)."""
    l2_tb_s: float = 5.0
    """Assumed L2 bandwidth (K/V of prefill tiles that other CTAs read before)."""
    l2_latency_cycles: int = 400
    """Assumed L2 hit latency under load."""

    @property
    def hbm_bytes_per_cycle_sm(self) -> float:
        """HBM bandwidth per SM per cycle."""
        return self.hbm_tb_s * 1e12 / self.sms / (self.clock_ghz * 1e9)

    @property
    def tensor_flops_per_cycle_sm(self) -> float:
        """Dense tensor-core FLOP per SM per cycle."""
        return self.tensor_tflops * 1e12 / self.sms / (self.clock_ghz * 1e9)

    @property
    def rates(self) -> ceilings.Rates:
        """What :mod:`ceilings` needs of this GPU."""
        return ceilings.Rates(
            tensor_flops_per_cycle=self.tensor_flops_per_cycle_sm,
            mma_sync_fraction=self.mma_sync_fraction,
            fp32_lanes_per_smsp=self.fp32_lanes_per_smsp,
            hbm_bytes_per_cycle=self.hbm_bytes_per_cycle_sm,
            hbm_latency=self.latency_cycles,
            l2_bytes_per_cycle=self.l2_tb_s * 1e12 / self.sms / (self.clock_ghz * 1e9),
            l2_latency=self.l2_latency_cycles,
        )


GPUS = {
    # H100 SXM5: 3.35 TB/s HBM3, 132 SMs, 1.83 GHz (the clock NVIDIA's 989.4 TFLOPS is quoted
    # at), 128 FP32 lanes per SM; mma.sync reaches about 62% of the dense (wgmma) peak; L2
    # ~7 TB/s (an assumption after public microbenchmarks).
    "sm_90": Gpu("H100 SXM", "sm_90", 132, 1.83, 3.35, 989.4, 228 * 1024,
                 fp32_lanes_per_smsp=32, mma_sync_fraction=0.62, l2_tb_s=7.0),
    # A100 SXM 80 GB: 2.039 TB/s HBM2e, 108 SMs, 1.41 GHz, 312 TFLOPS dense bf16 (mma.sync is
    # its peak), 64 FP32 lanes per SM, L2 ~4.8 TB/s (assumed).
    "sm_80": Gpu("A100 SXM", "sm_80", 108, 1.41, 2.039, 312.0, 164 * 1024,
                 fp32_lanes_per_smsp=16, mma_sync_fraction=1.0, l2_tb_s=4.8),
}  # fmt: skip
"""The GPU each architecture is modeled on."""

_CTYPES = {"fp16": ("__half", 2), "bf16": ("__nv_bfloat16", 2), "fp32": ("float", 4)}
DECODE_ROWS = 8
PREFILL_ROWS = 16


@dataclass(frozen=True)
class Instantiation:
    """One modeled launch: a kernel template instance plus the runtime shape it runs."""

    kind: str  # "decode", "decode_tc" (tensor-core decode_attention_kernel) or "prefill"
    dtype: str  # "fp16", "bf16"
    head: int
    group: int  # query heads per KV head (GQA ratio)
    block_size: int
    arch: str
    sinks: bool = False
    """With attention sinks: the prefill kernel's ``SINKS`` instantiation; the decode
    kernels take them at run time (the same code: :attr:`ModelRow.sink_instructions`)."""

    @property
    def template_rows(self) -> int:
        """``ROWS`` template argument."""
        return DECODE_ROWS if self.kind == "decode" else PREFILL_ROWS

    @property
    def source(self) -> str:
        """The ``.cu`` file of the kernel."""
        if self.kind == "decode_tc":
            return _DECODE_SOURCE
        return _PREFILL_SOURCE if self.kind == "prefill" else _RULES_SOURCE

    @property
    def kernel_name(self) -> str:
        """Name expression of the instantiation."""
        if self.kind == "prefill":
            tail = ", true" if self.sinks else ""
            return f"prefill_attention_kernel<{_CTYPES[self.dtype][0]}, {self.head}{tail}>"
        if self.kind == "decode_tc":
            return (
                f"decode_attention_kernel<{_CTYPES[self.dtype][0]}, {self.head}, "
                f"{self.block_size}, {decode_group_t(self.group)}>"
            )
        return (
            f"split_k_attention_kernel<{_CTYPES[self.dtype][0]}, {self.head}, {self.template_rows}>"
        )

    @property
    def label(self) -> str:
        """Short row label."""
        return (
            f"{self.kind} {self.dtype} h{self.head} gqa{self.group} bs{self.block_size} {self.arch}"
            + (" sinks" if self.sinks else "")
        )


@dataclass(frozen=True)
class Shape:
    """The kernel's compile-time and runtime shape (mirrors ``SplitKShape`` and the plan)."""

    esize: int
    head: int
    tile: int
    vpr: int
    rows: int
    nslice: int
    items: int
    warps: int = WARPS
    """Warps per CTA."""

    @classmethod
    def of(cls, inst: Instantiation) -> Shape:
        """Shape of ``inst`` as its ``.cu`` file and host planner compute it."""
        esize = _CTYPES[inst.dtype][1]
        if inst.kind == "prefill":
            return _prefill_shape(inst, esize)
        if inst.kind == "decode_tc":
            return _decode_tc_shape(inst, esize)
        row_bytes = inst.head * esize
        per_tile = 8192 // row_bytes
        tile = 32 if per_tile >= 32 else 16 if per_tile >= 16 else 8
        vpr = row_bytes // 16
        heads_per_cta = min(inst.group, inst.template_rows)
        queries = 1 if inst.kind == "decode" else max(1, inst.template_rows // heads_per_cta)
        rows = heads_per_cta * queries
        nslice = max(1, THREADS // (rows * vpr))
        return cls(esize, inst.head, tile, vpr, rows, nslice, rows * vpr * nslice)


_RULES_SOURCE = "split_k_attention.cu"
_PREFILL_SOURCE = "prefill_attention.cu"
_DECODE_SOURCE = "decode_attention.cu"
DECODE_TC_WARP_TOKENS = 32
"""Keys per warp per main-loop iteration of ``decode_attention_kernel`` (wmma M = 32)."""


def decode_group_t(group: int) -> int:
    """The ``GROUP`` instantiation of ``decode_attention_kernel`` that serves ``group``."""
    from kvblocks.ops.cuda_sources import DECODE_GROUPS

    return next((g for g in DECODE_GROUPS if g >= group), DECODE_GROUPS[-1])


def _decode_tc_shape(inst: Instantiation, esize: int) -> Shape:
    """``kvb::DecodeShape``: a main-loop iteration is one 32-key tile per warp (128 keys per
    CTA); ``rows`` is the padded N of the tensor-core products (8 or 16 heads)."""
    rows = 8 * -(-min(inst.group, 16) // 8)
    vpr = inst.head * esize // 16
    return Shape(esize, inst.head, DECODE_TC_WARP_TOKENS * WARPS, vpr, rows, 1, rows * vpr)


def _prefill_shape(inst: Instantiation, esize: int) -> Shape:
    """``kvb::PrefillShape`` of the tensor-core prefill kernel (long chunks: one head's
    queries fill the CTA's rows); ``nslice``/``items`` have no meaning there."""
    from kvblocks.ops.prefill_launch import prefill_rows, prefill_threads, prefill_tile

    rows, tile = prefill_rows(inst.head), prefill_tile(inst.head)
    vpr = inst.head * esize // 16
    return Shape(esize, inst.head, tile, vpr, rows, 1, rows * vpr, prefill_threads(inst.head) // 32)


def default_instantiations(archs: list[str]) -> list[Instantiation]:
    """Decode at GQA 1/4/8, head 64/128/256, fp16/bf16, block 16/32; prefill at GQA 8,
    without and with attention sinks."""
    out = []
    for arch in archs:
        for dtype in ("fp16", "bf16"):
            for head in (64, 128, 256):
                for group in (1, 4, 8):
                    for block in (16, 32):
                        out.append(Instantiation("decode", dtype, head, group, block, arch))
                        out.append(Instantiation("decode_tc", dtype, head, group, block, arch))
                out.append(Instantiation("prefill", dtype, head, 8, 16, arch))
                out.append(Instantiation("prefill", dtype, head, 8, 16, arch, sinks=True))
    return out
