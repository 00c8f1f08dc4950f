"""SASS of the attention kernels for the static kernel model (:mod:`kernel_model`): find
nvdisasm, compile a program with NVRTC exactly as the CUDA backend does (plus
``-lineinfo`` and ptxas' resource report), disassemble it, and keep the result on disk
next to the kernel cache."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


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
    resources = {
        name: dataclasses.asdict(res)
        for name, res in nvrtc_build.parse_ptxas_report(program.log, program.lowered).items()
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
