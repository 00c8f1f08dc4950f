"""NVRTC compile results shared by the tests: one compile per program for a whole run.

Several tests compile the same program (``test_ops_nvrtc.py``'s matrix and
``test_prefill_kernel_nvrtc.py`` both compile the prefill source for sm_80 and sm_90), on
different pytest workers. :func:`compile_source` keeps each result in ``directory``
(pytest's cache dir, shared by the workers of a run and kept between runs), keyed by
everything the result depends on: the text of every ``cuda/`` source and header, the
options (include dirs and arch), the name expressions and the NVRTC version. A worker that
needs a program another worker is compiling waits for it (a lock per key) instead of
compiling it too. A fresh clone compiles every program once; a later run compiles only
what changed, like the emulator's harness build (``emu_runtime.py``).

:func:`compile_archs` compiles one program for several architectures at the cost of about
one and a half: NVRTC compiles it for the first (NVVM, then its built-in ptxas), and the
PTX NVRTC generated on the way is assembled for the others by the standalone ptxas of
NVRTC's own release (``cuda-toolkit[nvcc]`` beside ``[nvrtc]``, so the same version).
NVVM is about 55% of a compile, and its PTX for sm_80 and sm_90 differs only in the
``.target`` line (and the per-compile hash in internal names): checked on the prefill
program, the ptxas-assembled sm_90 cubin has NVRTC's size and every kernel NVRTC's
resources. ``test_ops_nvrtc.py`` checks that on a sample in every run. Without a ptxas of
NVRTC's release every architecture goes through NVRTC, as before.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvblocks.ops import nvrtc_build
from kvblocks.ops.cuda_sources import PREFILL_SOURCE, cuda_dir, kernel_names, nvrtc_options

#: Bumped when the stored form changes.
_FORMAT = 1


def _key(source: str, arch: str, names: list[str], route: str = "nvrtc") -> str:
    src = cuda_dir()
    material = {
        "format": _FORMAT,
        "sources": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted([*src.glob("*.cu"), *src.glob("*.cuh")])
        },
        "program": source,
        "options": nvrtc_options(arch),
        "names": names,
        "nvrtc": list(nvrtc_build.nvrtc_version()),
        "route": route,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def _to_json(result: nvrtc_build.CompileResult) -> str:
    return json.dumps(dataclasses.asdict(result))


def _from_json(text: str) -> nvrtc_build.CompileResult:
    doc = json.loads(text)
    kernels = {n: nvrtc_build.KernelResources(**k) for n, k in doc["kernels"].items()}
    return nvrtc_build.CompileResult(doc["log"], doc["cubin_bytes"], kernels)


def _kept(
    paths: dict[str, Path], compile: Callable[[], dict[str, nvrtc_build.CompileResult]]
) -> dict[str, nvrtc_build.CompileResult]:
    """The results stored at ``paths`` (arch -> file), or ``compile()``'s, stored there.
    Under the lock of the first path, the one :func:`compile_source` of that program and
    architecture takes: a worker that needs a program another is compiling waits for it."""
    first = next(iter(paths.values()))
    first.parent.mkdir(parents=True, exist_ok=True)
    with open(first.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return {arch: _from_json(path.read_text()) for arch, path in paths.items()}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # one is absent or damaged: compile them all
        results = compile()
        for arch, path in paths.items():
            _store(path, results[arch])
    return results


def compile_source(
    directory: Path | None, source: str, arch: str, names: list[str]
) -> nvrtc_build.CompileResult:
    """``nvrtc_build.compile_source(source, arch, names)``, kept in ``directory`` (``None``:
    compile, keep nothing). A compile error is raised, never stored."""
    if directory is None:
        return nvrtc_build.compile_source(source, arch, names)
    path = directory / f"{_key(source, arch, names)}.json"
    kept = _kept({arch: path}, lambda: {arch: nvrtc_build.compile_source(source, arch, names)})
    return kept[arch]


@functools.cache
def matching_ptxas() -> tuple[Path, str] | None:
    """``(path, version)`` of a standalone ptxas of the NVRTC wheel's own release
    (``13.2.86``), or ``None`` where there is none."""
    nvrtc = None
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
        try:
            nvrtc = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if nvrtc is None:
        return None
    try:
        import nvidia
    except ImportError:
        return None
    release = ".".join(nvrtc.split(".")[:3])
    major, minor = nvrtc_build.nvrtc_version()
    if not release.startswith(f"{major}.{minor}."):
        return None  # the NVRTC loaded is not the wheel's
    for root in map(Path, nvidia.__path__):
        for tool in (root / "cu13" / "bin" / "ptxas", root / "cuda_nvcc" / "bin" / "ptxas"):
            if not tool.is_file():
                continue
            try:
                out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
            except OSError:  # not executable here: NVRTC compiles every architecture
                continue
            found = re.search(r"\bV(\d+\.\d+\.\d+)", out)
            if found and found.group(1) == release:
                return tool, release
    return None


def assemble(ptx: bytes, arch: str, lowered: dict[str, str]) -> nvrtc_build.CompileResult:
    """The cubin ``matching_ptxas()`` assembles for ``arch`` from NVRTC's PTX of another
    architecture (its ``.target`` line set to ``arch``), with ptxas' resource report;
    ``lowered`` maps each name expression to its mangled name."""
    found = matching_ptxas()
    if found is None:
        raise RuntimeError("no standalone ptxas of NVRTC's release")
    text, targets = re.subn(rb"^\.target sm_\d+$", f".target {arch}".encode(), ptx, flags=re.M)
    if targets != 1:
        raise nvrtc_build.NvrtcCompileError(f"PTX with {targets} .target lines")
    with tempfile.TemporaryDirectory(prefix="kvb-ptxas-") as tmp:
        src, out = Path(tmp) / "program.ptx", Path(tmp) / "program.cubin"
        src.write_bytes(text)
        done = subprocess.run(
            [found[0], f"-arch={arch}", "-v", str(src), "-o", str(out)],
            capture_output=True,
            text=True,
        )
        log = done.stdout + done.stderr
        if done.returncode != 0:
            raise nvrtc_build.NvrtcCompileError(f"ptxas -arch={arch} failed:\n{log}")
        size = out.stat().st_size
    return nvrtc_build.CompileResult(log, size, nvrtc_build.parse_ptxas_report(log, lowered))


def _store(path: Path, result: nvrtc_build.CompileResult) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(_to_json(result))
    tmp.replace(path)


def compile_archs(
    directory: Path | None, source: str, archs: list[str], names: list[str]
) -> dict[str, nvrtc_build.CompileResult]:
    """``{arch: compile_source(directory, source, arch, names)}``, the first architecture
    compiled by NVRTC and the others assembled from its PTX by :func:`matching_ptxas`
    (by NVRTC too where there is none). Kept in ``directory`` like :func:`compile_source`;
    the first architecture's result is the one :func:`compile_source` keeps."""
    first, rest = archs[0], archs[1:]
    found = matching_ptxas()
    if found is None:
        return {arch: compile_source(directory, source, arch, names) for arch in archs}
    route = f"ptxas {found[1]} from {first}"
    if directory is None:
        return _compile_archs(source, first, rest, names)
    paths = {first: directory / f"{_key(source, first, names)}.json"}
    paths.update({a: directory / f"{_key(source, a, names, route)}.json" for a in rest})
    return _kept(paths, lambda: _compile_archs(source, first, rest, names))


def _compile_archs(
    source: str, first: str, rest: list[str], names: list[str]
) -> dict[str, nvrtc_build.CompileResult]:
    result, program = nvrtc_build.compile_source_program(source, first, names, keep_ptx=True)
    assert program.ptx is not None
    return {first: result, **{arch: assemble(program.ptx, arch, program.lowered) for arch in rest}}


def prefill_head_128_names() -> list[str]:
    """The head-128 prefill instantiations (fp16, bf16; with and without sinks): what the
    fast tier compiles for either architecture, and the sample NVRTC's own sm_90 compile
    checks the matrix's assembled one on (one program, so compiled once per run)."""
    return [name for name in kernel_names(PREFILL_SOURCE) if ", 128" in name]


def results_dir(config: object) -> Path | None:
    """The directory of a pytest ``config``'s run (``None`` under ``-p no:cacheprovider``)."""
    cache = getattr(config, "cache", None)
    return None if cache is None else Path(cache.mkdir("kvblocks-nvrtc"))
