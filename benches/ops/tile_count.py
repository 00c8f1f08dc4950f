"""Counting one main-loop iteration (one K/V tile) of a kernel's SASS for the static
kernel model (:mod:`kernel_model`): the branch rules of each kernel (runtime parameters
enter through them, keyed by the source line of each branch), the main loop's markers,
the attention-sink path, and the per-tile counts and ceilings of a loop."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ceilings
import sass
from kernel_instantiations import (
    _DECODE_SOURCE,
    _PREFILL_SOURCE,
    _RULES_SOURCE,
    THREADS,
    WARPS,
    Gpu,
    Shape,
)


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
