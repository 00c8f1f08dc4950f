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

Where the parts live: the GPUs, instantiations and shapes in :mod:`kernel_instantiations`;
compiling, disassembling and the on-disk cache in :mod:`kernel_sass`; the branch rules and
the per-tile counts in :mod:`tile_count`; occupancy and the model's rows in
:mod:`model_rows`; this module re-exports them and renders the tables (the CLI).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ceilings
from kernel_instantiations import (
    GPUS,
    Gpu,
    Instantiation,
    Shape,
    default_instantiations,
)
from kernel_sass import Compiled, compile_and_disassemble, disassemble, find_nvdisasm
from model_rows import ModelRow, Occupancy, model, occupancy, run_model
from tile_count import PAGED_ATTENTION_RULES, TileCount, count_tile, loop_ceilings

__all__ = [
    "GPUS",
    "PAGED_ATTENTION_RULES",
    "Compiled",
    "Gpu",
    "Instantiation",
    "ModelRow",
    "Occupancy",
    "Shape",
    "TileCount",
    "compile_and_disassemble",
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
    "run_model",
]

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
    ("decode_tc", "fp16", 128, 8, "sm_90"): (0.864, "256 x 32k"),
    ("prefill", "fp16", 128, 8, "sm_90"): (0.297, "1 x 32k causal"),
}
"""Fractions measured on an H100 80GB HBM3 (``benches/ops/bench_gpu.py`` at 206a91a, whose
kernels the rows model: the prefill kernel without sinks and the tensor-core decode compile to
the same instructions since): decode of 256 sequences x 32k keys (86.6% at 194fe24; a device
copy of the same bytes reaches 90.3%), causal prefill of one 32k prompt (294 TFLOP/s of 989;
the WMMA kernel before it measured 18.6%). Keyed like the summary rows (kind, dtype, head,
GQA, arch)."""


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
