"""Every ceiling of a kernel's main loop, each on its own, the binding one, and an estimate.

Input: the per-tile counts of :func:`tile_count.count_tile` (warp-instructions by class,
bytes moved, warp 0's trace), the resident CTAs, the work of one tile (bytes of K/V against
HBM for decode, FLOP against the dense tensor peak for prefill) and the GPU. Every ceiling
is a fraction of the peak, computed per SM and per cycle so that the clock cancels out:

    issue    work / (warp-instructions / 4)        4 schedulers, 1 warp-instruction each
    mma      work / (HMMA x cycles each / 4)        mma.sync's rate: on H100 ~62% of the
                                                     wgmma peak the fraction is taken against
    smem     work / (shared bytes / 128)            LDS/LDSM/STS/SHFL + cp.async's writes
    int      work / (integer instructions x 2 / 4)  address arithmetic at 16 lanes per SMSP
    latency  the SM simulation with every pipe and bandwidth unlimited: dependencies
             (HMMA ~30 cycles, shared loads ~30, ...), CTA barriers against the warps an SM
             holds, one instruction per cycle per SMSP
    flight   CTAs x bytes in flight / HBM latency   decode: Little's law

``binding`` names the smallest. ``estimate`` is the SM simulation (:mod:`sm_sim`) with all
of them at once, where the resources meet (an LDSM queue behind the tensor pipe, a barrier
that waits for the slowest warp): below the smallest ceiling, and the model's figure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import sass
import sm_sim

__all__ = ["CEILINGS", "Ceilings", "Rates", "compute"]

CEILINGS = ("issue", "mma", "smem", "int", "latency", "flight")
"""Column order of the ceilings (``flight`` only for decode)."""


@dataclass(frozen=True)
class Rates:
    """The per-SM rates and latencies of a GPU the ceilings use."""

    tensor_flops_per_cycle: float
    """Dense fp16/bf16 FLOP per SM per cycle (the peak prefill is measured against)."""
    mma_sync_fraction: float
    """Share of that peak ``mma.sync`` reaches (H100: its peak needs wgmma)."""
    fp32_lanes_per_smsp: int
    hbm_bytes_per_cycle: float
    hbm_latency: int
    l2_bytes_per_cycle: float
    l2_latency: int
    smem_bytes_per_cycle: float = 128.0
    hmma_latency: int = 30

    @property
    def tensor_ii(self) -> float:
        """Cycles an SMSP's tensor pipe takes per HMMA.16816 (4096 FLOP) at mma.sync's rate."""
        return 4096 / (self.tensor_flops_per_cycle * self.mma_sync_fraction / 4)


@dataclass(frozen=True)
class Ceilings:
    """The ceilings (fractions of the peak, capped at 1), the binding one, the estimate."""

    values: dict[str, float]
    binding: str
    estimate: float
    estimate_cycles: float
    """Simulated cycles per main-loop iteration of all resident CTAs together."""
    smem_bytes: float
    hmma: float

    def describe(self) -> str:
        """``name fraction`` for every ceiling, the binding one starred."""
        return ", ".join(
            f"{'*' if k == self.binding else ''}{k} {100 * v:.1f}%" for k, v in self.values.items()
        )


def _hmma_cycles(listing: sass.Listing, counts: list[float], rates: Rates) -> tuple[float, float]:
    """(HMMA.16816-equivalents per tile, tensor-pipe cycles per SMSP per tile)."""
    n = 0.0
    for ins, c in zip(listing.instructions, counts, strict=True):
        if c and ins.base == "HMMA":
            n += c * (1.0 if "16816" in ins.opcode else 0.5)
    return n, n * rates.tensor_ii / 4


def _smem_bytes(listing: sass.Listing, counts: list[float]) -> float:
    """Bytes through shared memory per tile: loads, stores, ldmatrix, shuffles (one warp
    per cycle: 128 bytes' worth), the shared-memory side of cp.async, and generic LD/ST
    (in these kernels only bf16 WMMA fragments, which have no .shared form, use them)."""
    total = 0.0
    for ins, c in zip(listing.instructions, counts, strict=True):
        if not c or ins.predicate == "@!PT":  # never executes: ptxas' LDGSTS filler
            continue
        if ins.base in ("LDS", "LDSM", "STS", "ATOMS", "STSM", "LDGSTS", "LD", "ST"):
            total += c * 32 * sass.width_bytes(ins)
        elif ins.base == "SHFL":
            total += c * 128
    return total


def machine(
    rates: Rates, ctas: int, decode: bool, unlimited: bool = False, warps: int = 4
) -> sm_sim.Machine:
    """The simulated SM (``ctas`` resident CTAs of ``warps`` warps): K/V streams come from
    HBM (decode) or L2 (prefill)."""
    return sm_sim.Machine(
        ctas=ctas,
        warps_per_cta=warps,
        fp32_ii=32 / rates.fp32_lanes_per_smsp,
        tensor_ii=rates.tensor_ii,
        smem_bytes_per_cycle=rates.smem_bytes_per_cycle,
        global_bytes_per_cycle=rates.hbm_bytes_per_cycle if decode else rates.l2_bytes_per_cycle,
        stream_latency=rates.hbm_latency if decode else rates.l2_latency,
        hmma_latency=rates.hmma_latency,
        unlimited=unlimited,
    )


def _sim_cache() -> Path | None:
    try:
        from kvblocks.ops import kernel_cache

        return kernel_cache.cache_dir() / "model" / "sim"
    except Exception:  # no cache is fine: simulate again
        return None


def steady_cycles(listing: sass.Listing, trace: list[int], m: sm_sim.Machine) -> float:
    """:func:`sm_sim.steady_state`, kept on disk next to the model's compile cache, keyed
    by the traced instructions, the machine and this module's and the simulator's sources
    (a second run of the model or its tests simulates nothing again)."""
    here = Path(__file__).resolve().parent
    material = {
        "trace": [(listing.instructions[i].opcode, listing.instructions[i].operands,
                   listing.instructions[i].predicate) for i in trace],
        "machine": dataclasses.asdict(m),
        "code": [hashlib.sha256((here / f).read_bytes()).hexdigest()
                 for f in ("sm_sim.py", "sass.py")],
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(material).encode()).hexdigest()[:32]
    root = _sim_cache()
    path = root / f"{key}.json" if root else None
    if path is not None:
        try:
            return float(json.loads(path.read_text())["cycles"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    cycles = sm_sim.steady_state(listing, trace, m, phases=1 if m.unlimited else 3)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"cycles": cycles}))
            tmp.replace(path)
        except OSError:
            pass
    return cycles


def compute(
    listing: sass.Listing,
    counts: list[float],
    by_class: dict[str, float],
    trace: list[int],
    *,
    rates: Rates,
    ctas: int,
    work: float,
    peak: float,
    decode: bool,
    flight_bytes: float = 0.0,
    warps: int = 4,
) -> Ceilings:
    """The ceilings of one main loop: ``counts`` are warp-executions per instruction per
    tile (all warps), ``trace`` warp 0's instructions of one tile, ``work`` per tile per
    CTA (of ``warps`` warps) in the unit of ``peak`` (per SM per cycle)."""
    total = sum(by_class.values())
    hmma, tensor_cycles = _hmma_cycles(listing, counts, rates)
    smem = _smem_bytes(listing, counts)
    values: dict[str, float] = {}

    def frac(cycles: float) -> float:
        return 1.0 if cycles <= 0 else min(1.0, work / cycles / peak)

    values["issue"] = frac(total / 4)
    values["mma"] = frac(tensor_cycles)
    values["smem"] = frac(smem / rates.smem_bytes_per_cycle)
    values["int"] = frac(by_class.get("int_addr", 0.0) * 2 / 4)
    lat = steady_cycles(listing, trace, machine(rates, ctas, decode, True, warps))
    values["latency"] = min(1.0, ctas * work / lat / peak)
    if decode:
        values["flight"] = min(1.0, ctas * flight_bytes / (peak * rates.hbm_latency))
    binding = min(values, key=lambda k: values[k])
    if values[binding] >= 1.0:
        binding = "peak"  # no ceiling below the peak itself (HBM or tensor)
    cycles = steady_cycles(listing, trace, machine(rates, ctas, decode, False, warps))
    estimate = min(1.0, ctas * work / cycles / peak)
    if not math.isfinite(estimate):
        raise ValueError("simulation gave no time per iteration")
    return Ceilings(values, binding, estimate, cycles, smem, hmma)
