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
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from pathlib import Path

from kvblocks.ops import nvrtc_build
from kvblocks.ops.cuda_sources import cuda_dir, nvrtc_options

#: Bumped when the stored form changes.
_FORMAT = 1


def _key(source: str, arch: str, names: list[str]) -> str:
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
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def _to_json(result: nvrtc_build.CompileResult) -> str:
    return json.dumps(dataclasses.asdict(result))


def _from_json(text: str) -> nvrtc_build.CompileResult:
    doc = json.loads(text)
    kernels = {n: nvrtc_build.KernelResources(**k) for n, k in doc["kernels"].items()}
    return nvrtc_build.CompileResult(doc["log"], doc["cubin_bytes"], kernels)


def compile_source(
    directory: Path | None, source: str, arch: str, names: list[str]
) -> nvrtc_build.CompileResult:
    """``nvrtc_build.compile_source(source, arch, names)``, kept in ``directory`` (``None``:
    compile, keep nothing). A compile error is raised, never stored."""
    if directory is None:
        return nvrtc_build.compile_source(source, arch, names)
    path = directory / f"{_key(source, arch, names)}.json"
    directory.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent or damaged: compile it
        result = nvrtc_build.compile_source(source, arch, names)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(_to_json(result))
        tmp.replace(path)
    return result


def results_dir(config: object) -> Path | None:
    """The directory of a pytest ``config``'s run (``None`` under ``-p no:cacheprovider``)."""
    cache = getattr(config, "cache", None)
    return None if cache is None else Path(cache.mkdir("kvblocks-nvrtc"))
