"""A static performance model of the attention kernels, read from their SASS (no GPU needed).

    python benches/ops/kernel_model.py [--json | --summary] [--arch sm_90 ...] [--ftz]

For each instantiation (decode at GQA 1/4/8, head 64/128/256, fp16/bf16, block 16/32;
prefill at head 64/128/256), the kernel is compiled exactly as the CUDA backend compiles it
(``kernel_cache``'s NVRTC options; ``-lineinfo`` and ``--ptxas-options=-v`` added, which
change no instruction), disassembled with nvdisasm, and its main loop (the smallest loop
holding a barrier and a global load: one K/V tile per iteration) is counted per tile with
:func:`sass.count_loop`. Runtime parameters (rows per CTA, token slices) enter through the
rules in :data:`PAGED_ATTENTION_RULES`, keyed by the source line of each branch.

The model (numbers per SM and per cycle, so the clock cancels out of the fraction); work is
the tile's K/V bytes (decode, against HBM) or ``4 x rows x tile x head`` FLOP (prefill,
against the dense tensor-core peak, wgmma's on H100). :mod:`ceilings` computes every
ceiling on its own (issue, ``mma.sync``'s tensor rate, shared-memory bandwidth, integer
instructions, latency with barriers against the resident warps, and for decode the bytes in
flight), names the binding one, and estimates the fraction with a cycle-level simulation of
the SM running the loop (:mod:`sm_sim`), where they meet. The estimate is the model's
figure (``fraction``); it still sees nothing of DRAM efficiency, bank conflicts, partial
tiles, split merging or grid balance. The flight term assumes one prefetched tile per
resident CTA (the kernels keep exactly one tile of loads in flight while computing) and
:attr:`Gpu.latency_cycles`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ceilings
import sass

__all__ = [
    "GPUS",
    "PAGED_ATTENTION_RULES",
    "Gpu",
    "Instantiation",
    "ModelRow",
    "Shape",
    "TileCount",
    "count_tile",
    "default_instantiations",
    "disassemble",
    "find_nvdisasm",
    "loop_ceilings",
    "main",
    "model",
    "occupancy",
    "render_summary",
    "render_table",
]

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


def _warp_fraction(threads: int) -> float:
    return sass.active_warps(threads, WARPS) / WARPS


PAGED_ATTENTION_RULES: dict[str, dict[str, object]] = {
    # Scores: one thread per (row, token); warps past rows * tile skip, the rest loop.
    "for (int i = tid; i < rows * TILE; i += NT)": {
        "fallthrough": lambda s, k: _warp_fraction(s.rows * s.tile),
        "trips": lambda s, k: (
            sass.ceil_div(s.rows * s.tile, 32) / max(1, sass.active_warps(s.rows * s.tile, WARPS))
        ),
    },
    # Online softmax: one thread per row.
    "if (tid < rows)": {"fallthrough": lambda s, k: _warp_fraction(s.rows)},
    # P*V: the k-th unrolled item covers threads tid + k * 128 < items.
    "if (i < items)": {"fallthrough": lambda s, k: _warp_fraction(s.items - k * THREADS)},
    "for (int t = slice; t < TILE; t += nslice)": {
        "trips": lambda s, k: sass.ceil_div(s.tile, s.nslice)
    },
}
"""Branch rules of ``split_k_attention_kernel``: source-line text -> fall-through fraction
(share of the flow that runs the guarded code) and trip count per entry, as functions of
the :class:`Shape` and the occurrence number of that line's branch. A steady-state tile:
full, every key visible, next tile prefetched, no soft cap or window (every other branch
falls through, i.e. the default of :func:`sass.count_loop`)."""


PREFILL_ATTENTION_RULES: dict[str, dict[str, object]] = {
    # Steady state: no soft cap and a positive scale (the score transform is skipped), a
    # stable running max (no row rescales), a tile below the causal diagonal, inside the
    # window and the keys (no per-score mask), past the first tile (Q's fragments loaded).
    "if (transform)": {"fallthrough": lambda s, k: 0.0},
    "if (mask_tile)": {"fallthrough": lambda s, k: 0.0},
    "mx > m_run[mt][h] + kvb::kRescaleLog2": {"fallthrough": lambda s, k: 0.0},
    "if (first)": {"fallthrough": lambda s, k: 0.0},
    # The block ids of the next tile: one per key row, threads below the tile's keys.
    "if (tid < TILE)": {"fallthrough": lambda s, k: min(1.0, s.tile / THREADS)},
    # The Q K^T loop over 16-column steps, rolled where Q is read from shared memory.
    "for (int kk = 0; kk < S::kKSteps; ++kk)": {"trips": lambda s, k: s.head // 16},
}
"""Branch rules of ``prefill_attention_kernel`` (as :data:`PAGED_ATTENTION_RULES`). Every
other branch of the tile loop falls through: full tiles, every key loaded."""

DECODE_ATTENTION_RULES: dict[str | tuple[str, str], dict[str, object]] = {
    # Steady state: no soft cap (its tanh is skipped).
    "if (capped)": {"fallthrough": lambda s, k: 0.0},
    # Where the compiler predicates the whole-tile copies and then branches over the
    # masked copies (a branch at the copy's asm statement in cp_async.cuh, whose line info
    # is its operand line), the masked path is not taken.
    ("cp_async.cuh", '"r"(src_bytes)'): {"fallthrough": lambda s, k: 0.0},
    # Back-edge of a warp-synchronous divergent slow path (BRA.DIV, never taken): one pass.
    "every lane's key copies landed": {"trips": lambda s, k: 1},
}
"""Branch rules of ``decode_attention_kernel`` (as :data:`PAGED_ATTENTION_RULES`): a tile
wholly inside the item (the unmasked copy path), the next tile prefetched."""

RULES = {
    _RULES_SOURCE: PAGED_ATTENTION_RULES,
    _PREFILL_SOURCE: PREFILL_ATTENTION_RULES,
    _DECODE_SOURCE: DECODE_ATTENTION_RULES,
}
"""Branch rules by the kernel's source file."""


def find_nvdisasm() -> str | None:
    """Path of nvdisasm: ``$KVBLOCKS_NVDISASM``, ``PATH``, the ``nvidia-cuda-nvdisasm``
    wheel, or the copy inside triton; None if there is none."""
    if env := os.environ.get("KVBLOCKS_NVDISASM"):
        return env if Path(env).is_file() else None
    if found := shutil.which("nvdisasm"):
        return found
    candidates = []
    for pkg, subs in (
        ("nvidia", ("cu13/bin", "cuda_nvdisasm/bin", "cu12/bin")),
        ("triton", ("backends/nvidia/bin",)),
    ):
        spec = importlib.util.find_spec(pkg)
        for root in spec.submodule_search_locations or [] if spec else []:
            candidates += [Path(root) / sub / "nvdisasm" for sub in subs]
    return next((str(c) for c in candidates if c.is_file()), None)


@dataclass
class Compiled:
    """SASS listing and ptxas resources of every kernel of one program."""

    sass_text: str
    resources: dict[str, object]
    lowered: dict[str, str]
    options: list[str]


def _cache_path(key: str) -> Path:
    from kvblocks.ops import kernel_cache

    return kernel_cache.cache_dir() / "model" / key


def compile_and_disassemble(
    names: tuple[str, ...], arch: str, ftz: bool = False, source: str | None = None
) -> Compiled:
    """Compile ``names`` in one NVRTC program for ``arch`` and disassemble the cubin.

    The result is kept on disk next to the kernel cache, keyed by the sources, options,
    NVRTC version and names, so a second run (or the CI test) does not compile again.
    """
    from kvblocks.ops import kernel_cache, nvrtc_build
    from kvblocks.ops.cuda_sources import SPLIT_K_SOURCE, cuda_dir

    source = source or SPLIT_K_SOURCE

    options = [*kernel_cache._options(arch), *(["-ftz=true"] if ftz else [])]
    tool = find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    src = cuda_dir()
    material = {
        "sources": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted([*src.glob("*.cu"), *src.glob("*.cuh")])
        },
        "options": options,
        "names": list(names),
        "program": source,
        "nvrtc": list(nvrtc_build.nvrtc_version()),
        "nvdisasm": Path(tool).stat().st_size,
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    path = _cache_path(key)
    try:
        cached = json.loads((path.with_suffix(".json")).read_text())
        return Compiled(**cached)
    except (OSError, ValueError, TypeError):
        pass
    program = nvrtc_build.compile_program(
        source, list(names), [*options, "-lineinfo", "--ptxas-options=-v"]
    )
    by_lowered = {low: expr for expr, low in program.lowered.items()}
    resources = {
        name: dataclasses.asdict(res)
        for name, res in nvrtc_build._parse_ptxas(program.log, by_lowered).items()
    }
    compiled = Compiled(disassemble(program.binary, tool), resources, program.lowered, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
        tmp_path.write_text(json.dumps(dataclasses.asdict(compiled)))
        tmp_path.replace(path.with_suffix(".json"))
    except OSError:
        pass  # a read-only cache only costs a recompile
    return compiled


def disassemble(cubin: bytes, tool: str | None = None) -> str:
    """``nvdisasm -c -g`` of a cubin (``tool``: its path, default :func:`find_nvdisasm`)."""
    tool = tool or find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run(
            [tool, "-c", "-g", str(path)], check=True, capture_output=True, text=True
        ).stdout


@dataclass(frozen=True)
class Occupancy:
    """Resident CTAs per SM and what limits them."""

    ctas: int
    limiter: str
    warps_fraction: float


def occupancy(registers: int, smem_bytes: int, gpu: Gpu, threads: int = THREADS) -> Occupancy:
    """CTAs per SM from registers (256-register allocation units per warp, 4 sub-partitions),
    shared memory (plus the 1 KiB the driver reserves per CTA) and the warp/CTA limits."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(registers * 32 / 256) * 256
    warps_by_regs = (gpu.regs_per_sm // 4 // per_warp) * 4 if per_warp else gpu.max_warps
    limits = {
        "registers": warps_by_regs // warps,
        "shared memory": gpu.smem_per_sm // (smem_bytes + 1024),
        "warps": gpu.max_warps // warps,
        "CTAs": gpu.max_ctas,
    }
    limiter = min(limits, key=lambda k: limits[k])
    ctas = limits[limiter]
    return Occupancy(ctas, limiter, ctas * warps / gpu.max_warps)


@dataclass
class ModelRow:
    """The model's figures for one instantiation (per CTA, per K/V tile)."""

    inst: Instantiation
    rows: int
    tile_tokens: int
    kv_bytes: int
    warp_instructions: float
    by_class: dict[str, float]
    global_load_bytes: float
    global_store_bytes: float
    shared_load_bytes: float
    shared_store_bytes: float
    registers: int
    spill_bytes: int
    smem_bytes: int
    ctas_per_sm: int
    occupancy_limiter: str
    gpu: str
    metric: str  # "HBM" (decode) or "tensor" (prefill)
    issue_rate: float  # bytes or FLOP per cycle per SM at full issue
    peak_rate: float
    warp0_instructions: int
    path_cycles: int
    ceilings: dict[str, float]
    """Each ceiling on its own (fraction of the peak): :data:`ceilings.CEILINGS`."""
    binding: str
    """The smallest ceiling."""
    fraction: float
    """The estimate: the SM simulation with every ceiling at once."""
    shared_bytes: float
    """Bytes through shared memory per tile (loads, stores, ldmatrix, shuffles, cp.async)."""
    hmma: float
    """HMMA.16816 per tile (all warps)."""
    formula: str
    notes: list[str] = field(default_factory=list)
    async_copy_bytes: float = 0.0
    """Of ``global_load_bytes``, the bytes cp.async (LDGSTS) copies into shared memory."""
    sink_instructions: int = 0
    """SASS instructions of the attention-sink path (:func:`sink_path`), all outside the
    main loop: the kernel's whole delta for sinks, run once per output row."""
    sink_in_loop: int = 0
    """Of those, the ones inside the main loop (0: a tile costs the same with sinks)."""

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["inst"] = dataclasses.asdict(self.inst)
        out["name"] = self.inst.kernel_name
        out["label"] = self.inst.label
        return out


@functools.cache
def _header_lines(name: str) -> dict[int, str]:
    from kvblocks.ops.cuda_sources import cuda_dir

    path = cuda_dir() / name
    return dict(enumerate(path.read_text().splitlines(), start=1)) if path.is_file() else {}


@functools.cache
def _sink_lines(name: str) -> frozenset[int]:
    """Lines of ``cuda/<name>`` on the attention-sink path: those that name a sink (the
    null test, the load, the call) and the body of ``kvb::sink_inv``."""
    out: set[int] = set()
    inside = False
    for number, text in sorted(_header_lines(name).items()):
        inside = inside or "float sink_inv(" in text
        if inside or "sink" in text:
            out.add(number)
        if inside and text.startswith("}"):
            inside = False
    return frozenset(out)


def sink_path(listing: sass.Listing, loop: sass.Loop) -> tuple[int, int]:
    """``(instructions, of which in loop)``: the static SASS instructions whose source line
    (``-lineinfo``) is on the attention-sink path (:func:`_sink_lines`; the inlined math
    library's own lines, e.g. ``exp2f``'s, are not counted)."""
    total = inside = 0
    for ins in listing.instructions:
        if ins.file is None or ins.line is None:
            continue
        if ins.line in _sink_lines(Path(ins.file).name):
            total += 1
            inside += loop.contains(ins.index)
    return total, inside


def _rule(kind: str, rules_source: str = _RULES_SOURCE):
    table = RULES[rules_source]

    def lookup(shape: Shape, source: dict[int, str]):
        def rule(ins: sass.Instruction, k: int) -> float | None:
            # A rule's key is a line of the kernel's source, or (header, line) for a line of
            # one of our headers inlined into it.
            name = Path(ins.file).name if ins.file is not None else rules_source
            lines = source if name == rules_source else _header_lines(name)
            text = lines.get(ins.line or -1, "")
            for key, rules in table.items():
                file, needle = key if isinstance(key, tuple) else (rules_source, key)
                if file == name and needle in text and kind in rules:
                    return float(rules[kind](shape, k))  # type: ignore[operator]
            return None

        return rule

    return lookup


MAIN_LOOP_OPS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # Warps stream their own tiles with cp.async: the loop waits on the copies (DEPBAR),
    # not on a CTA barrier; the table-slice loop around it has the BAR and the LDG.
    _DECODE_SOURCE: (frozenset({"DEPBAR"}), frozenset({"LDGSTS"})),
}
"""(wait opcodes, load opcodes) that mark a kernel's main loop, by source file; default
``BAR`` and ``LDG``."""


def _main_loop(listing: sass.Listing, rules_source: str = _RULES_SOURCE) -> sass.Loop:
    ins = listing.instructions
    waits, loads = MAIN_LOOP_OPS.get(rules_source, (frozenset({"BAR"}), frozenset({"LDG"})))
    for loop in listing.loops():  # innermost first
        body = ins[loop.head : loop.tail + 1]
        if any(i.base in waits for i in body) and any(i.base in loads for i in body):
            return loop
    raise ValueError(f"{listing.name}: no loop with a barrier and a global load")


@dataclass
class TileCount:
    """Warp-instructions and bytes of one main-loop iteration (one K/V tile) of a CTA."""

    by_class: dict[str, float]
    moved: dict[str, float]
    notes: list[str]
    warp0_instructions: int = 0
    """Instructions warp 0 (the busiest: every guard admits it first) issues per tile."""
    path_cycles: int = 0
    """Warp 0's in-order, dependency-bound time per tile (:func:`sass.critical_path`)."""
    counts: list[float] = field(default_factory=list)
    """Warp-executions of each instruction of the listing per tile (all warps)."""
    trace: list[int] = field(default_factory=list)
    """Warp 0's instructions of one tile, in order."""

    @property
    def total(self) -> float:
        """All warp-instructions."""
        return sum(self.by_class.values())


def count_tile(
    listing: sass.Listing,
    shape: Shape,
    source: dict[int, str],
    rules_source: str = _RULES_SOURCE,
) -> TileCount:
    """Count the main loop of ``listing`` for ``shape``; ``source`` maps the listing's line
    numbers to the text the branch rules match (the kernel's ``.cu`` file, whose name
    ``rules_source`` selects the rules in :data:`RULES`)."""
    return count_loop_tile(
        listing,
        _main_loop(listing, rules_source),
        _rule("fallthrough", rules_source)(shape, source),
        _rule("trips", rules_source)(shape, source),
        shape.warps,
    )


_NoRule = Callable[[sass.Instruction, int], float | None]


def count_loop_tile(
    listing: sass.Listing, loop: sass.Loop, fall: _NoRule, trip: _NoRule, warps: int = WARPS
) -> TileCount:
    """Count one iteration of ``loop`` (``warps`` warps entering) with the branch rules
    ``fall`` and ``trip`` (see :func:`sass.count_loop`), and trace warp 0 through it."""
    counts, notes = sass.count_loop(listing, loop, float(warps), fallthrough=fall, trips=trip)
    by_class = dict.fromkeys(sass.CLASSES, 0.0)
    moved = {"global_load": 0.0, "global_store": 0.0, "shared_load": 0.0, "shared_store": 0.0}
    for ins, n in zip(listing.instructions, counts, strict=True):
        if not n:
            continue
        cls = sass.classify(ins)
        by_class[cls] += n
        if ins.predicate == "@!PT":
            continue  # never executes (ptxas' filler around LDGSTS): an issue slot, no bytes
        if cls in moved:
            moved[cls] += n * 32 * sass.width_bytes(ins)
        if ins.base == "LDGSTS":
            moved["async_copy"] = moved.get("async_copy", 0.0) + n * 32 * sass.width_bytes(ins)
    inner = {lp.tail: lp for lp in listing.loops()}

    def falls_through(ins: sass.Instruction, k: int) -> bool:
        f = fall(ins, k)
        return f is None or f > 0

    def trips0(ins: sass.Instruction, k: int) -> int:
        n = trip(ins, k)
        if n is None:
            n = sass.infer_trip_count(listing, inner[ins.index]) or 1
        return max(1, math.ceil(n))

    trace = sass.warp_trace(listing, loop, falls_through=falls_through, trips=trips0)
    return TileCount(
        by_class, moved, notes, len(trace), sass.critical_path(listing, trace), counts, trace
    )


def loop_ceilings(
    listing: sass.Listing,
    loop: sass.Loop,
    gpu: Gpu,
    *,
    ctas: int,
    work: float,
    peak: float,
    decode: bool = False,
) -> tuple[TileCount, ceilings.Ceilings]:
    """The counts and ceilings of any loop (every branch falls through, trip counts
    inferred): for kernels outside the attention family, e.g. the model's own tests."""
    tile = count_loop_tile(listing, loop, lambda i, k: None, lambda i, k: None)
    return tile, ceilings.compute(
        listing, tile.counts, tile.by_class, tile.trace, rates=gpu.rates, ctas=ctas,
        work=work, peak=peak, decode=decode,
    )  # fmt: skip


def model(inst: Instantiation, compiled: Compiled) -> ModelRow:
    """Count the main loop of ``inst``'s kernel in ``compiled`` and apply the model."""
    import torch

    from kvblocks.ops.cuda_sources import decode_smem_bytes, read_source
    from kvblocks.ops.launch_plan import split_k_smem_bytes
    from kvblocks.ops.prefill_launch import prefill_smem_bytes

    shape = Shape.of(inst)
    lowered = compiled.lowered[inst.kernel_name]
    listing = sass.parse_listing(compiled.sass_text)[lowered]
    source = dict(enumerate(read_source(inst.source).splitlines(), start=1))
    tile = count_tile(listing, shape, source, inst.source)
    sinks, sinks_in_loop = sink_path(listing, _main_loop(listing, inst.source))
    by_class, moved, notes = tile.by_class, tile.moved, tile.notes
    total = sum(by_class.values())
    res = compiled.resources[inst.kernel_name]
    gpu = GPUS[inst.arch]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[inst.dtype]
    if inst.kind == "prefill":
        smem = prefill_smem_bytes(inst.head) + int(res["static_smem_bytes"])
    elif inst.kind == "decode_tc":
        smem = decode_smem_bytes(dtype, inst.head, inst.block_size, decode_group_t(inst.group))
    else:
        smem = split_k_smem_bytes(dtype, inst.head, inst.template_rows) + int(
            res["static_smem_bytes"]
        )
    occ = occupancy(int(res["registers"]), smem, gpu, 32 * shape.warps)
    kv_bytes = 2 * shape.tile * inst.head * shape.esize
    cycles = total / ISSUE_PER_CYCLE
    # Bytes a resident CTA keeps in flight: the old kernel prefetches one tile; each warp of
    # decode_attention_kernel always has its next key or value tile (half its K/V) in flight.
    flight = kv_bytes // 2 if inst.kind == "decode_tc" else kv_bytes
    decode = inst.kind in ("decode", "decode_tc")
    if decode:
        metric, peak, work, unit = "HBM", gpu.hbm_bytes_per_cycle_sm, kv_bytes, "B"
    else:
        metric, peak, unit = "tensor", gpu.tensor_flops_per_cycle_sm, "FLOP"
        work = 4 * shape.rows * shape.tile * inst.head
    ceil = ceilings.compute(
        listing, tile.counts, by_class, tile.trace, rates=gpu.rates, ctas=occ.ctas, work=work,
        peak=peak, decode=decode, flight_bytes=flight, warps=shape.warps,
    )  # fmt: skip
    formula = (
        f"{work} {unit}/tile x {occ.ctas} CTAs; {ceil.describe()}; simulated "
        f"{ceil.estimate_cycles:.0f} cyc per {occ.ctas} tiles = {100 * ceil.estimate:.1f}% "
        f"of {peak:.2f} {unit}/cyc/SM"
    )
    return ModelRow(
        inst=inst,
        rows=shape.rows,
        tile_tokens=shape.tile,
        kv_bytes=kv_bytes,
        warp_instructions=total,
        by_class=by_class,
        global_load_bytes=moved["global_load"],
        global_store_bytes=moved["global_store"],
        shared_load_bytes=moved["shared_load"],
        shared_store_bytes=moved["shared_store"],
        registers=int(res["registers"]),
        spill_bytes=int(res["spill_stores"]) + int(res["spill_loads"]),
        smem_bytes=smem,
        ctas_per_sm=occ.ctas,
        occupancy_limiter=occ.limiter,
        gpu=gpu.name,
        metric=metric,
        issue_rate=work / cycles,
        peak_rate=peak,
        warp0_instructions=tile.warp0_instructions,
        path_cycles=tile.path_cycles,
        ceilings=ceil.values,
        binding=ceil.binding,
        fraction=ceil.estimate,
        shared_bytes=ceil.smem_bytes,
        hmma=ceil.hmma,
        formula=formula,
        notes=notes,
        async_copy_bytes=moved.get("async_copy", 0.0),
        sink_instructions=sinks,
        sink_in_loop=sinks_in_loop,
    )


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


@functools.cache
def _compiled(names: tuple[str, ...], arch: str, ftz: bool, source: str) -> Compiled:
    return compile_and_disassemble(names, arch, ftz, source)


def run_model(insts: list[Instantiation], ftz: bool = False) -> list[ModelRow]:
    """Model every instantiation, compiling one program per architecture and source."""
    rows = []
    for arch, source in sorted({(i.arch, i.source) for i in insts}):
        mine = [i for i in insts if (i.arch, i.source) == (arch, source)]
        compiled = _compiled(tuple(sorted({i.kernel_name for i in mine})), arch, ftz, source)
        rows += [model(i, compiled) for i in mine]
    order = {id(i): n for n, i in enumerate(insts)}
    return sorted(rows, key=lambda r: order.get(id(r.inst), 0))


_SHORT = {
    "global_load": "LDG", "shared_load": "LDS", "shared_store": "STS", "fma": "FMA",
    "fp_alu": "FALU", "mufu": "MUFU", "tensor": "MMA", "convert": "CVT",
    "int_addr": "INT", "barrier": "BAR", "control": "CTRL",
}  # fmt: skip


def render_table(rows: list[ModelRow]) -> str:
    """A markdown table, one row per instantiation: counts, every ceiling, the estimate."""
    head = (
        "| kernel | rows | tile | warp-instr/tile | "
        + " | ".join(_SHORT.values())
        + " | LDG B | shared B | HMMA | regs | CTAs/SM | "
        + " | ".join(ceilings.CEILINGS)
        + " | binding | estimate | sink instr (in loop) |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        cls = " | ".join(f"{r.by_class[c]:.0f}" for c in _SHORT)
        ceil = " | ".join(
            f"{100 * r.ceilings[c]:.1f}%" if c in r.ceilings else "-" for c in ceilings.CEILINGS
        )
        lines.append(
            f"| {r.inst.label} | {r.rows} | {r.tile_tokens} | {r.warp_instructions:.0f} | {cls} | "
            f"{r.global_load_bytes:.0f} | {r.shared_bytes:.0f} | {r.hmma:.0f} | {r.registers} | "
            f"{r.ctas_per_sm} ({r.occupancy_limiter}) | {ceil} | {r.binding} | "
            f"{100 * r.fraction:.1f}% of {r.gpu} {r.metric} | "
            f"{r.sink_instructions} ({r.sink_in_loop}) |"
        )
    return "\n".join(lines)


MEASURED: dict[tuple[str, str, int, int, str], tuple[float, str]] = {
    ("decode_tc", "fp16", 128, 8, "sm_90"): (0.866, "256 x 32k"),
    ("prefill", "fp16", 128, 8, "sm_90"): (0.186, "1 x 32k causal"),
}
"""Fractions measured on an H100 80GB HBM3 (``benches/ops/bench_gpu.py`` at 194fe24, the
kernels of that commit): decode of 256 sequences x 32k keys (2,900 GB/s of 3,350; a device
copy of the same bytes reaches 90.3%), causal prefill of one 32k prompt (184 TFLOP/s of
989). Keyed like the summary rows (kind, dtype, head, GQA, arch)."""


_ANCHORS = {
    "decode": "FlashInfer 80-90%, vLLM v2 ~85% HBM",
    "decode_tc": "FlashInfer 80-90%, vLLM v2 ~85% HBM",
    "prefill": "FA-2 ~35% (H100), 50-73% (A100) tensor",
}


def render_summary(rows: list[ModelRow]) -> str:
    """A compact markdown table: one line per shape and GPU, block sizes merged where their
    figures agree: every ceiling, the binding one, the estimate and, where one exists, the
    measured figure."""
    by_shape: dict[tuple[str, str, int, int, str], dict[int, ModelRow]] = {}
    for r in rows:
        i = r.inst
        kind = f"{i.kind} sinks" if i.sinks else i.kind
        by_shape.setdefault((kind, i.dtype, i.head, i.group, i.arch), {})[i.block_size] = r
    lines = [
        "| kernel | GPU | warp-instr/tile | "
        + " | ".join(ceilings.CEILINGS)
        + " | binding | estimate | measured | anchor |",
        "|" + " --- |" * (len(ceilings.CEILINGS) + 7),
    ]
    for (kind, dtype, head, group, arch), per_block in by_shape.items():
        figs = {(round(r.warp_instructions), round(r.fraction, 3)) for r in per_block.values()}
        if len(figs) == 1:
            merged = [("/".join(map(str, sorted(per_block))), next(iter(per_block.values())))]
        else:
            merged = [(str(b), r) for b, r in sorted(per_block.items())]
        for bs, r in merged:
            label = f"{kind} {dtype} head {head} GQA {group}"
            if kind in ("decode", "decode_tc"):
                label += f" block {bs}"
            ceil = " | ".join(
                f"{100 * r.ceilings[c]:.0f}%" if c in r.ceilings else "-" for c in ceilings.CEILINGS
            )
            got = MEASURED.get((kind, dtype, head, group, arch))
            measured = f"{100 * got[0]:.1f}% ({got[1]})" if got else "-"
            lines.append(
                f"| {label} | {r.gpu} | {r.warp_instructions:.0f} | {ceil} | {r.binding} | "
                f"**{100 * r.fraction:.1f}%** {r.metric} | {measured} | "
                f"{_ANCHORS[kind.removesuffix(' sinks')]} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table (or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--arch", action="append", choices=sorted(GPUS), help="repeatable")
    parser.add_argument("--ftz", action="store_true", help="add -ftz=true (CuPy's default)")
    parser.add_argument("--summary", action="store_true", help="compact table (cuda/README.md)")
    args = parser.parse_args(argv)
    archs = args.arch or ["sm_90", "sm_80"]
    rows = run_model(default_instantiations(archs), args.ftz)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    elif args.summary:
        print(render_summary(rows))
    else:
        for gpu in (GPUS[a] for a in archs):
            print(
                f"- {gpu.name} ({gpu.arch}): HBM {gpu.hbm_tb_s} TB/s / {gpu.sms} SMs / "
                f"{gpu.clock_ghz} GHz = {gpu.hbm_bytes_per_cycle_sm:.2f} B/cycle/SM; dense "
                f"tensor {gpu.tensor_tflops} TFLOPS = {gpu.tensor_flops_per_cycle_sm:.0f} "
                f"FLOP/cycle/SM (mma.sync {100 * gpu.mma_sync_fraction:.0f}% of it); HBM latency "
                f"assumed {gpu.latency_cycles} cycles; L2 assumed {gpu.l2_tb_s} TB/s, "
                f"{gpu.l2_latency_cycles} cycles"
            )
        print()
        print(render_table(rows))
        notes = sorted({n for r in rows for n in r.notes})
        for n in notes:
            print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
