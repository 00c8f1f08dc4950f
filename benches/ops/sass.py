"""Parse nvdisasm's SASS listing, classify instructions and count them over a main loop.

Input is the text of ``nvdisasm -c -g`` (``-g``: source line of each instruction, which
needs a cubin compiled with ``-lineinfo``; ``-lineinfo`` leaves the code unchanged). The
counting walks the instructions of one loop in address order and propagates an execution
*flow* (warp-executions per iteration of that loop) through branches:

* a forward conditional branch passes a fraction ``f`` of the flow on (fall-through) and
  sends ``1 - f`` to its target; ``f`` comes from a rule keyed by the branch's source line,
  else 1 (guards in these kernels skip work only at the edges: last tile, masked rows);
* an unconditional forward branch sends all of the flow to its target;
* an inner loop's header multiplies the flow by the loop's trip count (from a rule keyed by
  the back-edge's source line, else inferred from a constant induction variable:
  ``MOV R, imm`` before the loop, ``IADD3 R, R, imm`` in it, ``ISETP R, imm`` before the
  back-edge); the flow leaving through the back-edge is the flow divided by the trip count.

Predicated instructions are counted whether or not their predicate holds: they still take
an issue slot. The classifier only reads opcodes and widths, so it is tested on a recorded
listing (``tests/ops/fixtures``) where nvdisasm is not installed.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "CLASSES",
    "Instruction",
    "Listing",
    "Loop",
    "classify",
    "count_loop",
    "infer_trip_count",
    "parse_listing",
    "width_bytes",
]

CLASSES = (
    "global_load",
    "global_store",
    "shared_load",
    "shared_store",
    "const_load",
    "fma",
    "fp_alu",
    "mufu",
    "tensor",
    "convert",
    "int_addr",
    "shuffle",
    "barrier",
    "control",
    "other",
)
"""Instruction classes, in table order."""

_TENSOR = {"HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA", "UTCHMMA"}
_FMA = {"FFMA", "HFMA2", "DFMA", "FFMA2"}
_FP_ALU = {
    "FADD", "FMUL", "FMNMX", "FSET", "FSETP", "FSEL", "FCHK", "FRND", "FSWZADD",
    "HADD2", "HMUL2", "HMNMX2", "HSET2", "HSETP2", "DADD", "DMUL", "DSETP", "FADD2", "FMUL2",
}  # fmt: skip
_CONVERT = {"F2F", "F2I", "I2F", "I2FP", "F2FP", "I2I", "F2IP"}
_CONTROL = {
    "BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "BPT",
    "NOP", "YIELD", "WARPSYNC", "KILL", "ELECT", "ACQBULK", "ENDCOLLECTIVE",
}  # fmt: skip
_BARRIER = {"BAR", "MEMBAR", "DEPBAR", "ERRBAR", "CCTL", "ARRIVES", "SYNCS", "FENCE"}
_GLOBAL_LOAD = {"LDG", "LD", "LDGSTS", "UBLKCP", "UTMALDG"}
_GLOBAL_STORE = {"STG", "ST", "RED", "ATOM", "ATOMG", "UTMASTG"}
_SHARED_LOAD = {"LDS", "LDSM", "LDL"}
_SHARED_STORE = {"STS", "STL", "ATOMS", "STSM"}
_CONST = {"LDC", "ULDC"}
_INT = {
    "IMAD", "IADD3", "IADD", "IMUL", "LEA", "SHF", "SHL", "SHR", "LOP3", "LOP", "ISETP",
    "IABS", "IMNMX", "VIMNMX", "VIADD", "VIADDMNMX", "SEL", "MOV", "POPC", "FLO", "BREV",
    "BMSK", "SGXT", "PRMT", "PLOP3", "P2R", "R2P", "S2R", "CS2R", "R2UR", "IDP", "IDP4A",
    "LEPC", "S2UR", "VIMNMX3", "VABSDIFF", "VABSDIFF4", "BFE", "BFI", "ISCADD", "XMAD", "I2IP",
}  # fmt: skip
_SHUFFLE = {"SHFL", "VOTE", "VOTEU", "MATCH", "REDUX"}


@dataclass
class Instruction:
    """One SASS instruction of a listing."""

    index: int
    address: int
    predicate: str
    opcode: str
    operands: str
    line: int | None = None
    file: str | None = None
    target: str | None = None

    @property
    def base(self) -> str:
        """The opcode without modifiers (``LDG`` of ``LDG.E.128.CONSTANT``)."""
        return self.opcode.split(".", 1)[0]


@dataclass
class Loop:
    """A natural loop in layout order: header at ``head``, back-edge branch at ``tail``."""

    head: int
    tail: int

    def contains(self, index: int) -> bool:
        """Whether instruction ``index`` lies in the loop's address range."""
        return self.head <= index <= self.tail


@dataclass
class Listing:
    """The instructions of one function, its labels (name -> instruction index) and loops."""

    name: str
    instructions: list[Instruction]
    labels: dict[str, int] = field(default_factory=dict)

    def target_index(self, ins: Instruction) -> int | None:
        """Index of the instruction a branch jumps to (None for calls, returns, exits, and
        ``BRA.DIV``: the jump to a warp-synchronous operation's divergent slow path, not
        taken by a converged warp)."""
        if ins.target is None or ins.base not in ("BRA", "JMP") or ".DIV" in ins.opcode:
            return None
        return self.labels.get(ins.target)

    def loops(self) -> list[Loop]:
        """Every backward branch's loop, innermost (smallest) first."""
        found = []
        for ins in self.instructions:
            t = self.target_index(ins)
            if t is not None and t <= ins.index:
                found.append(Loop(t, ins.index))
        return sorted(found, key=lambda lp: (lp.tail - lp.head, lp.head))


_FUNC = re.compile(r"^\s*\.text\.(\S+):\s*$")
_LABEL = re.compile(r"^\s*(\.L_x_\d+|\$[^:\s]+):\s*$")
_LINE = re.compile(r'//## File "([^"]*)", line (\d+)')
_INSN = re.compile(
    r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_]+(?:\.[A-Za-z0-9_]+)*)\s*([^;]*);"
)
_TARGET = re.compile(r"`\(([^)]+)\)")


def parse_listing(text: str) -> dict[str, Listing]:
    """Parse ``nvdisasm -c [-g]`` output into one :class:`Listing` per function."""
    listings: dict[str, Listing] = {}
    current: Listing | None = None
    pending_labels: list[str] = []
    line: int | None = None
    file: str | None = None
    for raw in text.splitlines():
        if m := _FUNC.match(raw):
            current = Listing(m.group(1), [])
            listings[current.name] = current
            pending_labels, line, file = [], None, None
            continue
        if current is None:
            continue
        if m := _LINE.search(raw):
            file, line = m.group(1), int(m.group(2))
            continue
        if m := _LABEL.match(raw):
            pending_labels.append(m.group(1))
            continue
        if m := _INSN.match(raw):
            operands = m.group(4).strip()
            t = _TARGET.search(operands)
            ins = Instruction(
                index=len(current.instructions),
                address=int(m.group(1), 16),
                predicate=(m.group(2) or "").strip(),
                opcode=m.group(3),
                operands=operands,
                line=line,
                file=file,
                target=t.group(1) if t else None,
            )
            for label in pending_labels:
                current.labels[label] = ins.index
            pending_labels = []
            current.instructions.append(ins)
    return listings


def width_bytes(ins: Instruction) -> int:
    """Bytes one thread moves with a load/store (4 unless a width modifier says otherwise)."""
    mods = ins.opcode.split(".")[1:]
    for mod, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if mod in mods:
            return size
    if ins.base == "LDSM":  # ldmatrix: one 8x8 b16 matrix per .M88.N (x1/x2/x4)
        return 4 * (4 if "4" in mods else 2 if "2" in mods else 1)
    return 4


def classify(ins: Instruction) -> str:
    """The class (one of :data:`CLASSES`) of an instruction."""
    base = ins.base
    if base in _TENSOR:
        return "tensor"
    if base in _GLOBAL_LOAD:
        return "global_load"
    if base in _GLOBAL_STORE:
        return "global_store"
    if base in _SHARED_LOAD:
        return "shared_load"
    if base in _SHARED_STORE:
        return "shared_store"
    if base in _CONST:
        return "const_load"
    # HADD2.F32 is how fp16 -> fp32 unpacking compiles (one half per instruction).
    if base == "HADD2" and ".F32" in ins.opcode:
        return "convert"
    if ins.opcode == "HFMA2.MMA" and ins.operands.endswith("-RZ, RZ, 0, 0"):
        return "int_addr"  # the compiler's idiom for "MOV R, 0" on the FMA pipe
    if base in _FMA:
        return "fma"
    if base in _FP_ALU:
        return "fp_alu"
    if base == "MUFU":
        return "mufu"
    if base in _CONVERT:
        return "convert"
    if base in _SHUFFLE:
        return "shuffle"
    if base in _BARRIER:
        return "barrier"
    if base in _CONTROL:
        return "control"
    if base in _INT or (base.startswith("U") and base not in _CONST):
        return "int_addr"
    return "other"


_IMM = r"(-?0x[0-9a-f]+|-?\d+)"
_ISETP = re.compile(rf"^(U?P\d), U?PT, (R\d+), {_IMM}, U?PT$")
_STEP = re.compile(rf"^(R\d+), (R\d+), {_IMM}(?:, RZ)?$")
_STEP_SWAPPED = re.compile(rf"^(R\d+), {_IMM}, (R\d+)(?:, RZ)?$")
_INIT_MOV = re.compile(rf"^(R\d+), (RZ|{_IMM})$")
_INIT_IMAD = re.compile(rf"^(R\d+), RZ, RZ, (RZ|{_IMM})$")
_CMP = {
    "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
}  # fmt: skip


def _imm(text: str) -> int:
    return 0 if text == "RZ" else int(text, 0)


def infer_trip_count(listing: Listing, loop: Loop) -> int | None:
    """Trip count of a loop with a constant induction variable, else None."""
    ins = listing.instructions
    branch = ins[loop.tail]
    pred = branch.predicate.lstrip("@")
    negated = pred.startswith("!")
    pred = pred.lstrip("!")
    if not pred:
        return None
    setter = None
    for i in range(loop.tail - 1, loop.head - 1, -1):
        if ins[i].base == "ISETP" and (m := _ISETP.match(ins[i].operands)) and m[1] == pred:
            setter = (i, m)
            break
    if setter is None:
        return None
    set_at, m = setter
    reg, bound = m[2], _imm(m[3])
    cmp = next((c for c in _CMP if f".{c}." in f"{ins[set_at].opcode}."), None)
    if cmp is None:
        return None
    step = step_at = None
    for i in range(loop.head, loop.tail):
        if ins[i].base not in ("IADD3", "VIADD", "IADD"):
            continue
        if (s := _STEP.match(ins[i].operands)) and s[1] == reg and s[2] == reg:
            step, step_at = _imm(s[3]), i
        elif (s := _STEP_SWAPPED.match(ins[i].operands)) and s[1] == reg and s[3] == reg:
            step, step_at = _imm(s[2]), i
    if not step or step_at is None:
        return None
    init = None
    for i in range(loop.head - 1, max(-1, loop.head - 64), -1):
        ops = ins[i].operands
        if ins[i].predicate:
            continue
        pattern = {"MOV": _INIT_MOV, "IMAD.MOV.U32": _INIT_IMAD}.get(ins[i].opcode)
        if pattern is not None and (s := pattern.match(ops)) and s[1] == reg:
            init = _imm(s[2])
        elif ins[i].opcode == "HFMA2.MMA" and ops == f"{reg}, -RZ, RZ, 0, 0":
            init = 0
        elif ops.split(",")[0].strip() == reg:
            return None  # set by something this inference does not follow
        if init is not None:
            break
    if init is None:
        return None
    value, trips = init, 0
    while trips < 1 << 16:
        trips += 1
        value += step
        # The compare sees the incremented value when the increment comes first.
        seen = value if step_at < set_at else value - step
        if _CMP[cmp](seen, bound) == negated:
            return trips
    return None


BranchRule = Callable[[int], float]
"""Maps the occurrence number (0, 1, ...) of a branch at a source line to a fraction."""


def count_loop(
    listing: Listing,
    loop: Loop,
    entry_flow: float,
    *,
    fallthrough: Callable[[Instruction, int], float | None],
    trips: Callable[[Instruction, int], float | None],
) -> tuple[list[float], list[str]]:
    """Warp-executions of each instruction per iteration of ``loop`` (see module doc).

    ``fallthrough(branch, k)`` / ``trips(back_edge, k)`` give the rule for the ``k``-th
    forward branch / back-edge at that instruction's source line (None: the default).
    Returns the per-instruction counts (index -> count, zeros outside the loop) and notes
    on loops whose trip count fell back to 1.
    """
    ins = listing.instructions
    counts = [0.0] * len(ins)
    notes: list[str] = []
    inner = {
        lp.head: lp
        for lp in sorted(listing.loops(), key=lambda lp: lp.head)
        if lp != loop and loop.contains(lp.head)
    }
    inner_trip: dict[int, float] = {}
    seen: dict[tuple[str, int | None, bool], int] = defaultdict(int)
    for head, lp in inner.items():
        back = ins[lp.tail]
        key = (back.file or "", back.line, False)
        k = seen[key]
        seen[key] += 1
        trip = trips(back, k)
        if trip is None:
            trip = infer_trip_count(listing, lp)
        if trip is None:
            notes.append(f"loop at {ins[head].address:#x} (line {back.line}): trip count 1")
            trip = 1
        inner_trip[head] = float(trip)
    pending: dict[int, float] = defaultdict(float)
    flow = entry_flow
    for i in range(loop.head, loop.tail + 1):
        flow += pending.pop(i, 0.0)
        if i in inner_trip:
            flow *= inner_trip[i]
        counts[i] = flow
        cur = ins[i]
        target = listing.target_index(cur)
        if cur.base == "EXIT" and not cur.predicate:
            flow = 0.0
        if target is None or i == loop.tail:
            continue
        if target > i:
            if not cur.predicate or cur.predicate == "@PT":
                pending[target] += flow
                flow = 0.0
                continue
            key = (cur.file or "", cur.line, True)
            k = seen[key]
            seen[key] += 1
            f = fallthrough(cur, k)
            f = 1.0 if f is None else min(1.0, max(0.0, f))
            pending[target] += flow * (1.0 - f)
            flow *= f
        elif target in inner_trip:  # back-edge of an inner loop: one exit per entry
            flow = flow / inner_trip[target] if cur.predicate else 0.0
    return counts, notes


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling of ``a / b``."""
    return -(-a // b)


def active_warps(threads: int, warps: int) -> int:
    """Warps of a CTA with at least one of the first ``threads`` threads (at most ``warps``)."""
    return max(0, min(warps, math.ceil(threads / 32)))


def _occurrences(listing: Listing, loop: Loop) -> dict[int, int]:
    """Occurrence number of each conditional branch in ``loop`` among the branches of the
    same kind (forward / back-edge) at the same source line, in address order."""
    seen: dict[tuple[str, int | None, bool], int] = defaultdict(int)
    out = {}
    for ins in listing.instructions[loop.head : loop.tail + 1]:
        t = listing.target_index(ins)
        if t is None or not ins.predicate:
            continue
        key = (ins.file or "", ins.line, t > ins.index)
        out[ins.index] = seen[key]
        seen[key] += 1
    return out


def warp_trace(
    listing: Listing,
    loop: Loop,
    *,
    falls_through: Callable[[Instruction, int], bool],
    trips: Callable[[Instruction, int], int],
    limit: int = 1 << 20,
) -> list[int]:
    """Instruction indices one warp issues in one iteration of ``loop``, in order.

    ``falls_through(branch, k)`` says whether the warp runs the code a forward branch
    guards; ``trips(back_edge, k)`` how many times it runs an inner loop's body.
    """
    ins = listing.instructions
    occ = _occurrences(listing, loop)
    done: dict[int, int] = defaultdict(int)
    trace: list[int] = []
    i = loop.head
    while loop.head <= i <= loop.tail and len(trace) < limit:
        cur = ins[i]
        trace.append(i)
        target = listing.target_index(cur)
        if i == loop.tail or (cur.base == "EXIT" and not cur.predicate):
            break
        if target is None or not loop.contains(target):
            i += 1
        elif not cur.predicate:
            i = target
        elif target > i:
            i = i + 1 if falls_through(cur, occ[i]) else target
        else:
            done[i] += 1
            if done[i] < trips(cur, occ[i]):
                i = target
            else:
                done[i] = 0
                i += 1
    return trace


LATENCY = {
    "tensor": 30,
    "global_load": 200,
    "shared_load": 30,
    "const_load": 8,
    "mufu": 18,
    "convert": 4,
    "shuffle": 25,
}
"""Cycles until a result can be used, by class (4 for the rest: integer, FP32 and FP16
pipes); a rough reading of published Ampere/Hopper microbenchmarks (HMMA.16816 ~30 on
both). ``global_load`` is an L2 hit (the block table); conversions through the XU pipe
(I2F, F2I, F2F) take 8."""

_REG = re.compile(r"\b(U?R)(\d+)(\.64)?\b")
_PRED = re.compile(r"^!?(U?P)(\d)$")
_NO_DEST = {"STS", "STG", "ST", "STL", "RED", "ATOMS", "BAR", "BRA", "BSSY", "BSYNC", "EXIT",
            "CALL", "RET", "WARPSYNC", "NOP", "MEMBAR", "DEPBAR", "YIELD"}  # fmt: skip


def _registers(operand: str, wide: int = 1) -> list[str]:
    out = []
    for m in _REG.finditer(operand):
        n = int(m[2])
        count = max(wide, 2 if m[3] else 1)
        out += [f"{m[1]}{n + k}" for k in range(count)]
    return out


def _dests_and_sources(ins: Instruction) -> tuple[list[str], list[str]]:
    ops = [o.strip() for o in ins.operands.split(",")] if ins.operands else []
    sources = []
    if ins.predicate:
        sources.append(ins.predicate.lstrip("@!"))
    if ins.base in _NO_DEST or not ops:
        return [], sources + [r for o in ops for r in _registers(o)]
    mods = ins.opcode.split(".")
    wide = 4 if "128" in mods else 2 if ("64" in mods or "WIDE" in mods) else 1
    dests, rest = [], ops
    if m := _PRED.match(ops[0]):
        dests.append(f"{m[1]}{m[2]}")
    else:
        dests += _registers(ops[0], wide)
    rest = ops[1:]
    if rest and (m := _PRED.match(rest[0])) and not rest[0].startswith("!"):
        dests.append(f"{m[1]}{m[2]}")
        rest = rest[1:]
    for o in rest:
        if m := _PRED.match(o):
            sources.append(f"{m[1]}{m[2]}")
        else:
            sources += _registers(o)
    return dests, sources


def latency_of(ins: Instruction) -> int:
    """Cycles until ``ins``'s result is usable (see :data:`LATENCY`)."""
    if ins.base in ("I2F", "F2I", "F2F", "I2FP", "F2IP"):
        return 8
    if ins.base in ("S2R", "S2UR", "CS2R"):
        return 20
    return LATENCY.get(classify(ins), 4)


def critical_path(listing: Listing, trace: list[int]) -> int:
    """Cycles one warp needs for ``trace`` when it issues in order, one instruction per
    cycle at most, each waiting for its source registers and predicates (a scoreboard with
    :func:`latency_of`); registers are ready at the start (loads of the previous tile)."""
    ready: dict[str, int] = {}
    t = -1
    for i in trace:
        ins = listing.instructions[i]
        dests, sources = _dests_and_sources(ins)
        t = max([t + 1, *(ready.get(s, 0) for s in sources)])
        lat = latency_of(ins)
        for d in dests:
            ready[d] = t + lat
    return t + 1
