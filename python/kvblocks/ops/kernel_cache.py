"""A disk cache of compiled kernels: one cubin (or PTX) per instantiation and target.

CuPy never reads its disk cache for modules built with ``name_expressions``, so every
process would recompile every template instantiation (about 0.25 s each). Kernels are
therefore compiled here with NVRTC (``cuda-bindings``) and stored as files keyed by
everything that determines the binary: the text of every source in ``cuda/``, the name
expression, the NVRTC options and version, the target architecture and the CUDA headers
the options include. The CUDA backend loads them with ``cupy.RawModule(path=...)``.

The directory is ``$KVBLOCKS_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/kvblocks/kernels``,
else ``~/.cache/kvblocks/kernels``. Entries are written to a temporary name and renamed,
so concurrent processes never see half a file; an unreadable or unwritable directory
falls back to a private temporary one (compiling still works, nothing is shared).
:func:`precompile` fills the cache ahead of time, with or without a GPU.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops.checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_SIZES
from kvblocks.ops.cuda_sources import (
    CACHE_OPS_SOURCE,
    CTYPE_NAMES,
    DECODE_SOURCE,
    PREFILL_SOURCE,
    SPLIT_K_SOURCE,
    cuda_dir,
    kernel_names,
    nvrtc_options,
)

__all__ = [
    "CACHE_ENV",
    "CachedKernel",
    "arch_for_capability",
    "cache_dir",
    "get_kernel",
    "precompile",
    "source_of",
    "stats",
]

CACHE_ENV = "KVBLOCKS_KERNEL_CACHE"
"""Environment variable naming the cache directory."""
_FORMAT = 1  # bump when the entry layout or the key's meaning changes
_ARCH = re.compile(r"^(sm|compute)_\d{2,3}[af]?$")
_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")
_stats = {"compiled": 0, "loaded": 0}
logger = logging.getLogger("kvblocks.ops")

_fallback_dir: Path | None = None


@dataclass(frozen=True)
class CachedKernel:
    """A compiled instantiation on disk: load ``path``, then get ``lowered_name`` from it."""

    name: str
    lowered_name: str
    arch: str
    path: Path


def stats() -> dict[str, int]:
    """Counts of kernels this process ``compiled`` with NVRTC and ``loaded`` from disk."""
    return dict(_stats)


def cache_dir() -> Path:
    """The cache directory (created on first write)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvblocks" / "kernels"


def source_of(name: str) -> str:
    """The ``.cu`` file that defines kernel ``name`` (a name expression)."""
    if name.startswith("prefill_attention_kernel<"):
        return PREFILL_SOURCE
    if name.startswith(("decode_attention_kernel<", "merge_partials_kernel<")):
        return DECODE_SOURCE
    return CACHE_OPS_SOURCE if name in kernel_names(CACHE_OPS_SOURCE) else SPLIT_K_SOURCE


def arch_for_capability(major: int, minor: int, supported: Iterable[int]) -> str:
    """``sm_XY`` when NVRTC can build a cubin for compute capability X.Y, else PTX for the
    newest architecture it supports below it (the driver JIT-compiles that)."""
    cc = 10 * major + minor
    supported = sorted(supported)
    if cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a < cc]
    if not older:
        raise InvalidArgumentError(
            f"NVRTC supports compute capabilities {supported}, none at or below {major}.{minor}"
        )
    return f"compute_{older[-1]}"


def _digest_files(paths: Iterable[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(paths)}


@functools.cache
def _nvrtc_version() -> tuple[int, int]:
    from kvblocks.ops.nvrtc_build import nvrtc_version

    return nvrtc_version()


def _options(arch: str) -> list[str]:
    return nvrtc_options(arch, cuda_major=_nvrtc_version()[0])


def _key(name: str, arch: str, options: list[str]) -> str:
    """Hex digest of everything the compiled binary depends on."""
    src = cuda_dir()
    headers = [
        Path(o[2:]) / h for o in options if o.startswith("-I") for h in _HEADERS
        if (Path(o[2:]) / h).is_file()
    ]  # fmt: skip
    material = {
        "format": _FORMAT,
        "name": name,
        "source": source_of(name),
        "sources": _digest_files([*src.glob("*.cu"), *src.glob("*.cuh")]),
        "headers": _digest_files(headers),
        "options": options,
        "arch": arch,
        "nvrtc": list(_nvrtc_version()),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _check_arch(arch: object) -> str:
    if not isinstance(arch, str) or not _ARCH.match(arch):
        raise InvalidArgumentError(
            f"arch must look like 'sm_90' (cubin) or 'compute_90' (PTX), got {arch!r}"
        )
    return arch


def _load(directory: Path, key: str, name: str, arch: str) -> CachedKernel | None:
    meta_path = directory / f"{key[:40]}.json"
    try:
        meta = json.loads(meta_path.read_text())
        path = directory / meta["file"]
        if meta["key"] != key or meta["name"] != name or not path.is_file():
            return None
        return CachedKernel(name, str(meta["lowered"]), arch, path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: compile again and overwrite


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store(directory: Path, key: str, name: str, arch: str, binary: bytes, lowered: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    file = f"{key[:40]}.{'ptx' if arch.startswith('compute_') else 'cubin'}"
    _write_atomic(directory / file, binary)
    # The metadata goes last: an entry counts only once its binary is complete.
    meta = {"key": key, "name": name, "arch": arch, "lowered": lowered, "file": file}
    _write_atomic(directory / f"{key[:40]}.json", json.dumps(meta).encode())
    return directory / file


def _writable_dir() -> Path:
    global _fallback_dir
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    if _fallback_dir is None:
        _fallback_dir = Path(tempfile.mkdtemp(prefix="kvblocks-kernels-"))
        # This process's alone: removed when it exits (loaded modules keep their code).
        atexit.register(shutil.rmtree, _fallback_dir, ignore_errors=True)
        # An operational fault, not a mistake in the caller's code: logged, and the
        # kernels still compile (into a directory this process alone uses).
        logger.warning(
            "kernel cache %s is not writable; compiled kernels go to %s for this process "
            "only (set %s)",
            directory,
            _fallback_dir,
            CACHE_ENV,
        )
    return _fallback_dir


def get_kernel(name: str, arch: str) -> CachedKernel:
    """The compiled kernel ``name`` for ``arch``, from the cache or compiled into it."""
    from kvblocks.ops.nvrtc_build import compile_program

    arch = _check_arch(arch)
    options = _options(arch)
    key = _key(name, arch, options)
    for directory in (cache_dir(), _fallback_dir):
        if directory is not None and (hit := _load(directory, key, name, arch)) is not None:
            _stats["loaded"] += 1
            return hit
    templated = "<" in name
    program = compile_program(source_of(name), [name] if templated else [], options)
    _stats["compiled"] += 1
    lowered = program.lowered[name] if templated else name
    path = _store(_writable_dir(), key, name, arch, program.binary, lowered)
    return CachedKernel(name, lowered, arch, path)


def _device_archs() -> list[str]:
    if not torch.cuda.is_available():
        raise InvalidArgumentError(
            "precompile() without archs needs a CUDA device; pass archs=['sm_90', ...] to "
            "compile for other machines"
        )
    from kvblocks.ops.nvrtc_build import supported_archs

    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return sorted({arch_for_capability(*cap, supported_archs()) for cap in caps})


def _as_list(values: object, name: str) -> list[Any]:
    """``values`` as a list; a lone string (one arch, not a list of them) is refused."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(f"{name} must be a list, got {values!r}")
    return list(values)


def precompile(
    archs: Sequence[str] | None = None,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    head_sizes: Sequence[int] | None = None,
) -> int:
    """Compile every kernel instantiation the ops can launch into the disk cache.

    ``archs`` like ``["sm_80", "sm_90"]`` (no GPU needed), default: the architectures of
    the visible CUDA devices. ``dtypes`` / ``head_sizes`` restrict the attention
    instantiations (the cache-maintenance kernels are always included). Returns how
    many kernels were compiled; those already cached are skipped.
    """
    archs = None if archs is None else _as_list(archs, "archs")
    dtypes = SUPPORTED_DTYPES if dtypes is None else _as_list(dtypes, "dtypes")
    head_sizes = SUPPORTED_HEAD_SIZES if head_sizes is None else _as_list(head_sizes, "head_sizes")
    for dtype in dtypes:
        if not isinstance(dtype, torch.dtype) or dtype not in CTYPE_NAMES:
            raise InvalidArgumentError(f"no kernels for dtype {dtype!r}")
    for head in head_sizes:
        # 64.0 == 64, but it would name no instantiation: only ints select kernels.
        if isinstance(head, bool) or not isinstance(head, int) or head not in SUPPORTED_HEAD_SIZES:
            raise InvalidArgumentError(f"no kernels for head size {head!r}")
    targets = [_check_arch(a) for a in archs] if archs is not None else _device_archs()
    wanted = [f"<{CTYPE_NAMES[d]}, {h}" for d in dtypes for h in head_sizes]
    names = kernel_names(CACHE_OPS_SOURCE) + [
        n
        for source in (SPLIT_K_SOURCE, PREFILL_SOURCE, DECODE_SOURCE)
        for n in kernel_names(source)
        if any(w in n for w in wanted)
    ]
    before = _stats["compiled"]
    for arch in targets:
        for name in names:
            get_kernel(name, arch)
    return _stats["compiled"] - before
