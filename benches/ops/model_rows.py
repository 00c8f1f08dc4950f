"""The static kernel model's figures (:mod:`kernel_model`): occupancy, and one
:class:`ModelRow` per instantiation (counts, bytes, resources, every ceiling and the
simulated estimate), modeled from its compiled SASS."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import ceilings
import sass
from kernel_instantiations import (
    GPUS,
    ISSUE_PER_CYCLE,
    THREADS,
    Gpu,
    Instantiation,
    Shape,
    decode_group_t,
)
from kernel_sass import Compiled, compile_and_disassemble
from tile_count import _main_loop, count_tile, sink_path


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
