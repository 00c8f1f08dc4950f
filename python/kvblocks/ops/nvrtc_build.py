"""Compile the kernel sources with NVRTC (no GPU needed) and read ptxas' resource report.

Used by the compile tests and ``benches/ops/ptxas_report.py``. Needs the
``cuda-bindings`` package and an NVRTC library (e.g. the ``nvidia-cuda-nvrtc`` wheel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvblocks.errors import KVBlocksError
from kvblocks.ops.cuda_sources import nvrtc_options, read_source

__all__ = [
    "CompileResult",
    "KernelResources",
    "NvrtcCompileError",
    "Program",
    "compile_program",
    "compile_source",
    "compile_source_program",
    "nvrtc_version",
    "parse_ptxas_report",
    "supported_archs",
]


class NvrtcCompileError(KVBlocksError, RuntimeError):
    """NVRTC rejected a source; the message holds the compile log."""


@dataclass
class KernelResources:
    """ptxas' report for one kernel instantiation."""

    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    static_smem_bytes: int = 0


@dataclass
class CompileResult:
    """A compiled program: log, cubin size and per-kernel resources (by name expression)."""

    log: str
    cubin_bytes: int
    kernels: dict[str, KernelResources] = field(default_factory=dict)


def _check(result: tuple[Any, ...], what: str, log: str = "") -> tuple[Any, ...]:
    from cuda.bindings import nvrtc

    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcCompileError(f"{what} failed: {err}\n{log}{_missing_header_hint(log)}")
    return result[1:]


def _missing_header_hint(log: str) -> str:
    """What to install when NVRTC could not find a header the kernels include."""
    if 'cannot open source file "crt/mma.h"' in log:
        return (
            "\n<mma.h> needs crt/mma.h, which CUDA 13 ships in the nvidia-cuda-crt wheel "
            "(CUDA 12: nvidia-cuda-nvcc-cu12): pip install 'kvblocks[cuda13]' (or [cuda12])"
        )
    if "cannot open source file" in log and "cuda_" in log:
        return (
            "\nthe CUDA headers come from the nvidia-cuda-runtime wheel: "
            "pip install 'kvblocks[cuda13]' (or [cuda12])"
        )
    return ""


@dataclass
class Program:
    """A compiled program: the binary (a cubin for ``sm_XX``, PTX for ``compute_XX``),
    NVRTC's log, the lowered (mangled) name of each name expression, and with
    ``keep_ptx`` the PTX a cubin was assembled from."""

    binary: bytes
    log: str
    lowered: dict[str, str]
    ptx: bytes | None = None


def nvrtc_version() -> tuple[int, int]:
    """``(major, minor)`` of the NVRTC library ``cuda.bindings`` loads."""
    from cuda.bindings import nvrtc

    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def supported_archs() -> list[int]:
    """Compute capabilities (``90`` for sm_90) this NVRTC can emit cubins for."""
    from cuda.bindings import nvrtc

    (archs,) = _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return [int(a) for a in archs]


def compile_program(
    source: str,
    name_expressions: list[str],
    options: list[str],
    *,
    code: str | None = None,
    keep_ptx: bool = False,
) -> Program:
    """Compile ``source`` (a file in ``cuda/``, or ``code`` under that name) with ``options``.

    An ``-arch=sm_XX`` option yields a cubin, ``-arch=compute_XX`` PTX; ``keep_ptx`` keeps
    the PTX of a cubin too (NVRTC generates it on the way). Raises
    :class:`NvrtcCompileError` with the log on any error.
    """
    from cuda.bindings import nvrtc

    text = read_source(source) if code is None else code
    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(text.encode(), source.encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), f"add {expr}")
        opts = [o.encode() for o in options]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        # NVRTC writes into these buffers: they must be fresh mutable memory. ``b" " * 1``
        # is CPython's shared one-byte singleton, so an empty log (just its NUL) turned every
        # b" " in the process into b"\x00".
        buf = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        log = bytes(buf).rstrip(b"\x00 ").decode(errors="replace")
        _check(compiled, f"compiling {source}", log)
        ptx = any(o.startswith("-arch=compute_") for o in options)
        if ptx:
            (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "PTX size")
            binary = bytearray(size)
            _check(nvrtc.nvrtcGetPTX(prog, binary), "PTX")
        else:
            (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
            binary = bytearray(size)
            _check(nvrtc.nvrtcGetCUBIN(prog, binary), "cubin")
        kept = None
        if keep_ptx and not ptx:
            (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "PTX size")
            kept_buf = bytearray(size)
            _check(nvrtc.nvrtcGetPTX(prog, kept_buf), "PTX")
            kept = bytes(kept_buf).rstrip(b"\x00")
        lowered = {}
        for expr in name_expressions:
            (name,) = _check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), f"lower {expr}")
            lowered[expr] = name.decode() if isinstance(name, bytes) else name
        return Program(bytes(binary), log, lowered, kept)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_source(source: str, arch: str, name_expressions: list[str]) -> CompileResult:
    """Compile ``source`` (a file in ``cuda/``) to a cubin for ``arch`` (``sm_80``...).

    Every name expression is instantiated; raises :class:`NvrtcCompileError` with the
    log on any error.
    """
    return compile_source_program(source, arch, name_expressions)[0]


def compile_source_program(
    source: str, arch: str, name_expressions: list[str], *, keep_ptx: bool = False
) -> tuple[CompileResult, Program]:
    """:func:`compile_source`'s result and the program it read it from (the cubin, the
    lowered names and, with ``keep_ptx``, the PTX NVRTC generated for the cubin)."""
    program = compile_program(
        source, name_expressions, [*nvrtc_options(arch), "--ptxas-options=-v"], keep_ptx=keep_ptx
    )
    report = parse_ptxas_report(program.log, program.lowered)
    return CompileResult(program.log, len(program.binary), report), program


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(log: str, lowered: dict[str, str]) -> dict[str, KernelResources]:
    """Each kernel's resources in a ``ptxas -v`` report (NVRTC's log, or ptxas' own
    output), keyed by name expression (``lowered``: each one's mangled name, as
    :attr:`Program.lowered`; a kernel none lowers to keeps its mangled name)."""
    by_mangled = {mangled: expr for expr, mangled in lowered.items()}
    kernels: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            mangled = m.group(1)
            current = KernelResources(by_mangled.get(mangled, mangled))
            kernels[current.name] = current
        elif current is not None and (m := _PROPS.search(line)):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
            if s := _SMEM.search(line):
                current.static_smem_bytes = int(s.group(1))
    return kernels
