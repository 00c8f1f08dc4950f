"""The on-disk kernel cache and ``kvblocks.ops.precompile``, with real NVRTC and no GPU.

A second process must load the cubins the first one compiled without compiling again:
it runs with NVRTC made unimportable, so any compile attempt fails it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import kvblocks.ops as ops
from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import cuda_sources, kernel_cache

pytest.importorskip("cuda.bindings.nvrtc")

# Every attention instantiation for fp16, head 128: the CUDA-core kernels, the tensor-core
# prefill and the tensor-core decode (each block size and GROUP) with its merge.
FP16_128 = [
    name
    for source in (
        cuda_sources.SPLIT_K_SOURCE, cuda_sources.PREFILL_SOURCE, cuda_sources.DECODE_SOURCE
    )
    for name in cuda_sources.kernel_names(source)
    if "<__half, 128" in name
]  # fmt: skip


def run_python(code: str, cache: str) -> str:
    env = dict(os.environ, **{kernel_cache.CACHE_ENV: cache})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# Compiles every fp16 head-128 kernel for sm_90 (~12 s); the fast tier keeps the cache's other
# tests, which compile one kernel each.
@pytest.mark.slow
def test_a_second_process_loads_the_cached_cubins_without_compiling(tmp_path):
    first = run_python(
        "import torch, kvblocks.ops as ops\n"
        "print(ops.precompile(['sm_90'], dtypes=[torch.float16], head_sizes=[128]))\n",
        str(tmp_path),
    )
    assert first.split() == [str(len(FP16_128) + 2)]  # + the 2 cache kernels
    metas = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert sorted(m["name"] for m in metas) == sorted(
        [*FP16_128, "reshape_and_cache_kernel", "copy_blocks_kernel"]
    )
    for meta in metas:
        assert (tmp_path / meta["file"]).read_bytes()[:4] == b"\x7fELF"  # a cubin
    second = run_python(
        "from cuda.bindings import nvrtc\n"
        "def refuse(*args):\n"
        "    raise AssertionError('NVRTC compiled in the second process')\n"
        "nvrtc.nvrtcCompileProgram = refuse\n"
        "import torch, kvblocks.ops as ops\n"
        "from kvblocks.ops import kernel_cache\n"
        "print(ops.precompile(['sm_90'], dtypes=[torch.float16], head_sizes=[128]))\n"
        "k = kernel_cache.get_kernel('merge_splits_kernel<__half, 128>', 'sm_90')\n"
        "print(k.lowered_name, k.path.read_bytes()[:4] == b'\\x7fELF', kernel_cache.stats())\n",
        str(tmp_path),
    )
    count, lowered, is_cubin, *rest = second.split(maxsplit=3)
    assert count == "0" and lowered.startswith("_Z19merge_splits_kernel") and is_cubin == "True"
    assert "'compiled': 0" in rest[0] and f"'loaded': {len(FP16_128) + 3}" in rest[0]


@pytest.fixture
def private_sources(tmp_path, monkeypatch):
    """A copy of cuda/ the test may edit, and an empty cache."""
    src = tmp_path / "cuda"
    shutil.copytree(cuda_sources.cuda_dir(), src, ignore=shutil.ignore_patterns("emu"))
    monkeypatch.setattr(cuda_sources, "cuda_dir", lambda: src)
    monkeypatch.setattr(kernel_cache, "cuda_dir", lambda: src)
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "cache"))
    return src


def test_the_key_covers_sources_headers_and_arch(private_sources):
    def compiled_after(arch):
        before = kernel_cache.stats()["compiled"]
        entry = kernel_cache.get_kernel("copy_blocks_kernel", arch)
        assert entry.path.is_file() and entry.lowered_name == "copy_blocks_kernel"
        return kernel_cache.stats()["compiled"] - before

    assert compiled_after("sm_80") == 1
    assert compiled_after("sm_80") == 0  # a hit
    assert compiled_after("sm_90") == 1  # another architecture, another entry
    # An edit to an included header (not the .cu itself) must miss.
    header = private_sources / "kv_common.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert compiled_after("sm_80") == 1
    assert compiled_after("sm_80") == 0
    # PTX for architectures NVRTC cannot emit a cubin for (the driver JIT-compiles it).
    entry = kernel_cache.get_kernel("copy_blocks_kernel", "compute_80")
    assert entry.path.suffix == ".ptx" and b".entry copy_blocks_kernel" in entry.path.read_bytes()


def test_a_damaged_entry_is_compiled_again(private_sources):
    entry = kernel_cache.get_kernel("reshape_and_cache_kernel", "sm_90")
    meta = entry.path.with_suffix(".json")
    meta.write_text("{not json")
    before = kernel_cache.stats()["compiled"]
    again = kernel_cache.get_kernel("reshape_and_cache_kernel", "sm_90")
    assert kernel_cache.stats()["compiled"] == before + 1
    assert json.loads(meta.read_text())["name"] == "reshape_and_cache_kernel"
    assert again.path.read_bytes()[:4] == b"\x7fELF"


def test_arch_choice_for_a_device():
    supported = [75, 80, 86, 89, 90, 100, 120]
    assert kernel_cache.arch_for_capability(9, 0, supported) == "sm_90"
    assert kernel_cache.arch_for_capability(12, 1, supported) == "compute_120"
    with pytest.raises(InvalidArgumentError):
        kernel_cache.arch_for_capability(6, 1, supported)


def test_precompile_rejects_bad_arguments():
    for bad in (["sm90"], ["sm_90; rm -rf /"], [90]):
        with pytest.raises(InvalidArgumentError, match="arch"):
            ops.precompile(bad)
    with pytest.raises(InvalidArgumentError, match="head size"):
        ops.precompile(["sm_90"], head_sizes=[100])
    with pytest.raises(InvalidArgumentError, match="dtype"):
        ops.precompile(["sm_90"], dtypes=[torch.int8])
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="CUDA device"):
            ops.precompile()
