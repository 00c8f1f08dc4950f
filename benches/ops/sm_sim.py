"""A cycle-level sketch of one SM running the main loop of a kernel, from its SASS.

The static ceilings of :mod:`kernel_model` each look at one resource as if every other were
free. This runs the loop the way an SM does, so that the resources meet: every resident
warp (CTAs per SM x warps per CTA) replays the instruction trace of one main-loop iteration
(:func:`sass.warp_trace`, warp 0's path; the kernels modeled here give every warp the same
work) several times over, and each of the 4 sub-partitions (SMSPs) issues at most one
instruction per cycle, from a warp whose

* source registers are ready (a scoreboard with the latencies of :data:`LATENCY`; HMMA ~30
  cycles, shared loads ~30 plus their queue, global loads 200 for an L2 hit on a block table
  or the stream latency for 16-byte K/V loads),
* execution pipe on that SMSP is free again (:func:`pipe_of`: the tensor pipe at the
  ``mma.sync`` rate, FP32 at 16 or 32 lanes, integer/ALU at 16, MUFU at 4, conversions),
* CTA barrier (``BAR.SYNC`` of the whole CTA) has been reached by all its warps, and
* ``cp.async`` groups (``LDGSTS`` ... ``LDGDEPBAR``) a ``DEPBAR.LE SB0, n`` waits for
  have landed;

while the SM's shared memory moves ``smem_bytes_per_cycle`` (128) bytes per cycle for every
LDS/LDSM/STS/SHFL and the smem side of LDGSTS, and global memory ``global_bytes_per_cycle``
(HBM's or L2's share per SM) for LDG/LDGSTS/STG. Warps of CTA ``c`` are placed on SMSP
``warp % 4`` and a sub-partition picks among its ready warps round robin.

It remains a model: warps never diverge, caches always hit where the latency says so, bank
conflicts, the MIO queue depth, register-bank conflicts and dual-issue details are not
modeled, and every warp runs warp 0's path (the busiest: an over-estimate of the work for
kernels whose guards admit fewer warps). ``unlimited=True`` drops every pipe and bandwidth
limit, leaving dependencies, barriers and the one-instruction-per-cycle issue: the latency
ceiling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import sass

__all__ = ["Machine", "Op", "SimResult", "decode_trace", "pipe_of", "simulate"]


@dataclass(frozen=True)
class Machine:
    """Per-SM rates and latencies (cycles) of one GPU for the simulation."""

    ctas: int
    warps_per_cta: int = 4
    smsps: int = 4
    fp32_ii: float = 1.0
    """Cycles an SMSP's FP32 pipe needs per warp-instruction (32 / FP32 lanes)."""
    tensor_ii: float = 4.0
    """Cycles per ``HMMA.16816`` per SMSP at the rate ``mma.sync`` reaches."""
    alu_ii: float = 2.0
    """Integer/logic/compare pipe (16 lanes per SMSP)."""
    imad_ii: float = 2.0
    mufu_ii: float = 8.0
    xu_ii: float = 8.0
    smem_bytes_per_cycle: float = 128.0
    global_bytes_per_cycle: float = 14.0
    stream_latency: int = 800
    """16-byte global loads and cp.async (K/V): HBM for decode, L2 for prefill."""
    table_latency: int = 200
    smem_latency: int = 30
    hmma_latency: int = 30
    barrier_latency: int = 20
    unlimited: bool = False


LATENCY = {"fma": 4, "alu": 4, "imad": 4, "mufu": 18, "xu": 8, "shuffle": 25, "const": 8}
"""Dependent-issue latencies by pipe (HMMA, shared and global loads come from
:class:`Machine`)."""

_FMA = {"FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2", "HFMA2", "HMUL2", "HADD2", "FSWZADD"}
_IMAD = {"IMAD", "IMUL", "IDP", "IDP4A", "XMAD"}
_XU = {"I2F", "F2I", "F2F", "POPC", "FLO", "BREV", "FRND"}
# Generic LD/ST: in these kernels they reach shared memory (CUDA's bf16 WMMA fragment
# loads have no .shared form), so they are modeled as shared-memory accesses.
_SMEM = {"LDS", "LDSM", "STS", "ATOMS", "STSM", "LD", "ST"}
_GLOBAL_LOAD = {"LDG"}
_GLOBAL_STORE = {"STG", "RED", "ATOM", "ATOMG"}
_NO_PIPE = {"BAR", "DEPBAR", "LDGDEPBAR", "BRA", "BSSY", "BSYNC", "EXIT", "NOP", "WARPSYNC",
            "CALL", "RET", "YIELD", "MEMBAR", "ERRBAR", "CCTL", "JMP", "BRX"}  # fmt: skip


def pipe_of(ins: sass.Instruction) -> str | None:
    """The execution pipe an instruction occupies on its SMSP (None: issue only, or a
    shared/global memory instruction, limited by the SM-wide bandwidths instead)."""
    base = ins.base
    if base in ("HMMA", "IMMA", "DMMA", "BMMA"):
        return "tensor"
    if base in _FMA:
        return "fma"
    if base in _IMAD:
        return "imad"
    if base == "MUFU":
        return "mufu"
    if base in _XU:
        return "xu"
    if base in _NO_PIPE or base in _SMEM or base in _GLOBAL_LOAD or base in _GLOBAL_STORE:
        return None
    if base in ("LDGSTS", "SHFL", "LDC", "S2R", "CS2R", "S2UR") or base.startswith("U"):
        return None  # their own units (MIO, constant cache, uniform datapath)
    return "alu"


@dataclass
class Op:
    """One decoded instruction of the trace."""

    dests: tuple[int, ...]
    srcs: tuple[int, ...]
    pipe: str | None
    latency: int
    hmma_scale: float = 1.0
    smem_bytes: int = 0
    global_bytes: int = 0
    kind: str = "plain"  # plain | bar | depbar | ldgsts | commit | exit
    depbar_n: int = 0
    stream: bool = False


_DEPBAR = re.compile(r"SB0,\s*(0x[0-9a-f]+|\d+)")


def _count_suffix(ins: sass.Instruction) -> int:
    mods = ins.opcode.split(".")[1:]
    return 4 if "4" in mods else 2 if "2" in mods else 1


def _dests_sources(ins: sass.Instruction) -> tuple[list[str], list[str]]:
    """sass._dests_and_sources, with the register groups it does not know: HMMA's 4/2-
    register fragments, LDSM's 1/2/4 destinations, SHFL's destination after its predicate,
    and LDGSTS (no register destination)."""
    base = ins.base
    ops = [o.strip() for o in ins.operands.split(",")] if ins.operands else []
    pred = [ins.predicate.lstrip("@!")] if ins.predicate else []
    if base == "HMMA" and len(ops) >= 4:
        k16 = "16816" in ins.opcode
        acc = 4 if ".F32" in ins.opcode else 2
        a_regs, b_regs = (4, 2) if k16 else (2, 1)
        # sass._registers expands a group of consecutive registers from its first.
        dests = sass._registers(ops[0].split(".")[0], acc)
        srcs = (sass._registers(ops[1].split(".")[0], a_regs)
                + sass._registers(ops[2].split(".")[0], b_regs)
                + sass._registers(ops[3].split(".")[0], acc))  # fmt: skip
        return dests, srcs + pred
    if base == "LDSM" and ops:
        dests = sass._registers(ops[0], _count_suffix(ins))
        return dests, [r for o in ops[1:] for r in sass._registers(o)] + pred
    if base == "SHFL" and len(ops) >= 2:
        return sass._registers(ops[1]), [r for o in ops[2:] for r in sass._registers(o)] + pred
    if base == "LDGSTS":
        return [], [r for o in ops for r in sass._registers(o)] + pred
    return sass._dests_and_sources(ins)


def _is_cta_barrier(ins: sass.Instruction, threads: int) -> bool:
    """BAR.SYNC of the whole CTA (barrier 0, or a thread count of the whole CTA); a named
    barrier of one warp's 32 threads (``bar.sync id, 32``) orders nothing across warps."""
    if ins.base != "BAR" or (".SYNC" not in ins.opcode and ".RED" not in ins.opcode):
        return False
    ops = [o.strip() for o in ins.operands.split(",")] if ins.operands else []
    if len(ops) >= 2:
        try:
            count = int(ops[1], 0)
        except ValueError:
            return True
        return count > 32 or count >= threads
    return True


def decode_trace(listing: sass.Listing, trace: list[int], machine: Machine) -> tuple[list[Op], int]:
    """The trace's instructions as :class:`Op` (registers numbered from 0) and the number
    of registers seen."""
    regs: dict[str, int] = {}

    def ids(names: list[str]) -> tuple[int, ...]:
        return tuple(regs.setdefault(n, len(regs)) for n in names if n not in ("RZ", "PT"))

    threads = 32 * machine.warps_per_cta
    out = []
    for i in trace:
        ins = listing.instructions[i]
        dests, srcs = _dests_sources(ins)
        base = ins.base
        pipe = pipe_of(ins)
        op = Op(ids(dests), ids(srcs), pipe, LATENCY.get(pipe or "", 4))
        cls = sass.classify(ins)
        # A never-true predicate (``@!PT LDS RZ, [RZ]``, ptxas' filler around LDGSTS) takes
        # an issue slot and moves nothing.
        width = 0 if ins.predicate == "@!PT" else 32 * sass.width_bytes(ins)
        if base == "HMMA":
            op.latency = machine.hmma_latency
            op.hmma_scale = 1.0 if "16816" in ins.opcode else 0.5
        elif base in _SMEM or base == "SHFL":
            op.smem_bytes = 128 if base == "SHFL" else width
            op.latency = LATENCY["shuffle"] if base == "SHFL" else machine.smem_latency
        elif base in _GLOBAL_LOAD:
            op.global_bytes = width
            op.stream = sass.width_bytes(ins) == 16
            op.latency = machine.stream_latency if op.stream else machine.table_latency
        elif base in _GLOBAL_STORE:
            op.global_bytes = width
        elif base == "LDGSTS":
            op.kind, op.global_bytes, op.smem_bytes, op.stream = "ldgsts", width, width, True
        elif base == "LDGDEPBAR":
            op.kind = "commit"
        elif base == "DEPBAR" and (m := _DEPBAR.search(ins.operands)):
            op.kind, op.depbar_n = "depbar", int(m.group(1), 0)
        elif _is_cta_barrier(ins, threads):
            op.kind = "bar"
        elif base == "EXIT" and not ins.predicate:
            op.kind = "exit"
        elif cls == "const_load":
            op.latency = LATENCY["const"]
        elif base in ("S2R", "CS2R", "S2UR"):
            op.latency = 20
        elif pipe == "xu" or base in ("F2FP",):
            op.latency = LATENCY["xu"] if pipe == "xu" else 4
        out.append(op)
    return out, len(regs)


@dataclass
class _Warp:
    smsp: int
    cta: int
    ready: list[float]
    pos: int = 0
    iteration: int = 0
    ends: list[float] = field(default_factory=list)
    release: float = 0.0  # barrier release (inf while waiting for the other warps)
    groups: list[float] = field(default_factory=list)  # committed cp.async groups' landing
    open_group: float = 0.0
    done: bool = False


@dataclass
class SimResult:
    """Steady-state cycles per main-loop iteration (all resident CTAs, one iteration each)
    and the instructions issued per SMSP per iteration."""

    cycles_per_iteration: float
    issued_per_smsp: float
    iterations: int


def simulate(
    listing: sass.Listing,
    trace: list[int],
    machine: Machine,
    iterations: int = 8,
    stagger: float = 0.0,
) -> SimResult:
    """Run ``iterations`` passes of ``trace`` on every resident warp (CTA ``c`` starting
    ``c x stagger`` cycles late). The steady state is measured in the window where every CTA
    has finished its second pass (the first fill the pipeline: prefetched tiles, cp.async
    groups in flight) and none has finished its last (then the others would run alone): the
    iterations every CTA completes in it, interpolated, per cycle."""
    ops, nregs = decode_trace(listing, trace, machine)
    if not ops:
        raise ValueError("empty trace")
    m = machine
    inf = math.inf
    warps = [
        _Warp(smsp=w % m.smsps, cta=c, ready=[0.0] * nregs, release=c * stagger)
        for c in range(m.ctas)
        for w in range(m.warps_per_cta)
    ]
    by_smsp = [[w for w in warps if w.smsp == s] for s in range(m.smsps)]
    pipe_free = [dict.fromkeys(("tensor", "fma", "imad", "alu", "mufu", "xu"), 0.0)
                 for _ in range(m.smsps)]  # fmt: skip
    ii = {"tensor": m.tensor_ii, "fma": m.fp32_ii, "imad": m.imad_ii, "alu": m.alu_ii,
          "mufu": m.mufu_ii, "xu": m.xu_ii}  # fmt: skip
    arrived: dict[int, list[_Warp]] = {c: [] for c in range(m.ctas)}
    smem_free = 0.0
    global_free = 0.0
    rr = [0] * m.smsps
    issued = 0

    def earliest(w: _Warp) -> float:
        if w.done:
            return inf
        op = ops[w.pos]
        e = w.release
        for r in op.srcs:
            if w.ready[r] > e:
                e = w.ready[r]
        if op.pipe is not None and not m.unlimited:
            e = max(e, pipe_free[w.smsp][op.pipe])
        if op.kind == "depbar" and len(w.groups) > op.depbar_n:
            e = max(e, max(w.groups[: len(w.groups) - op.depbar_n]))
        return e

    t = 0.0
    while True:
        progressed = False
        for s in range(m.smsps):
            cands = by_smsp[s]
            n = len(cands)
            for k in range(n):
                w = cands[(rr[s] + k) % n]
                if earliest(w) > t:
                    continue
                rr[s] = (rr[s] + k + 1) % n
                op = ops[w.pos]
                issued += 1
                progressed = True
                if op.pipe is not None and not m.unlimited:
                    pipe_free[s][op.pipe] = t + ii[op.pipe] * (
                        op.hmma_scale if op.pipe == "tensor" else 1.0
                    )
                done_at = t + op.latency
                smem_rate, global_rate = m.smem_bytes_per_cycle, m.global_bytes_per_cycle
                if op.smem_bytes and op.kind != "ldgsts" and not m.unlimited:
                    smem_free = max(smem_free, t) + op.smem_bytes / smem_rate
                    done_at = smem_free + op.latency
                if op.global_bytes:
                    start = t
                    if not m.unlimited:
                        global_free = max(global_free, t) + op.global_bytes / global_rate
                        start = global_free
                    done_at = start + op.latency
                    if op.kind == "ldgsts":
                        # The copy's write into shared memory takes its bandwidth; charged
                        # at issue (in arrival order it would hold back every shared access
                        # issued before the data comes).
                        if not m.unlimited:
                            smem_free = max(smem_free, t) + op.smem_bytes / smem_rate
                        w.open_group = max(w.open_group, done_at)
                for r in op.dests:
                    w.ready[r] = done_at
                if op.kind == "commit":
                    w.groups.append(w.open_group)
                    w.open_group = 0.0
                elif op.kind == "depbar":
                    keep = op.depbar_n
                    w.groups = w.groups[len(w.groups) - keep :] if keep else []
                elif op.kind == "bar":
                    w.release = inf
                    group = arrived[w.cta]
                    group.append(w)
                    if len(group) == m.warps_per_cta:
                        for x in group:
                            x.release = t + m.barrier_latency
                        group.clear()
                w.pos += 1
                if w.pos == len(ops) or op.kind == "exit":
                    w.pos = 0
                    w.iteration += 1
                    w.ends.append(t)
                    if w.iteration == iterations:
                        w.done = True
                break
        if all(w.done for w in warps):
            break
        if progressed:
            t += 1
        else:
            nxt = min(earliest(w) for w in warps)
            if nxt == inf:
                raise RuntimeError("simulated warps deadlocked (a barrier no warp can pass)")
            t = max(t + 1, math.ceil(nxt))
    ends = [
        [max(w.ends[k] for w in warps if w.cta == c) for k in range(iterations)]
        for c in range(m.ctas)
    ]
    start = max(e[1] for e in ends)
    stop = min(e[-1] for e in ends)
    if stop <= start:
        raise RuntimeError("no window with every CTA in its steady state: raise iterations")

    def done_by(e: list[float], t: float) -> float:  # passes completed at time t
        for k in range(1, len(e)):
            if e[k] >= t:
                return k - 1 + (t - e[k - 1]) / max(e[k] - e[k - 1], 1e-9)
        return float(len(e) - 1)

    passes = sum(done_by(e, stop) - done_by(e, start) for e in ends)
    per_iter = m.ctas * (stop - start) / passes  # cycles per pass of every CTA
    return SimResult(per_iter, issued / m.smsps / iterations, iterations)


def steady_state(
    listing: sass.Listing, trace: list[int], machine: Machine, phases: int = 4
) -> float:
    """Cycles per iteration averaged over ``phases`` relative starting phases of the CTAs
    (CTA c starting c x k / (phases x CTAs) of an iteration late, k = 0 .. phases - 1):
    resident CTAs that start in step can lock into an unusually good or bad interleaving,
    which the average of the phases smooths out."""
    first = simulate(listing, trace, machine)
    if machine.ctas == 1 or phases <= 1:
        return first.cycles_per_iteration
    period = first.cycles_per_iteration
    runs = [first.cycles_per_iteration]
    for k in range(1, phases):
        stagger = period * k / (phases * machine.ctas)
        runs.append(simulate(listing, trace, machine, stagger=stagger).cycles_per_iteration)
    return sum(runs) / len(runs)
