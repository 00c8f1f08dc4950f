"""Every kernel instantiation the front-ends launch compiles with NVRTC for sm_80/sm_90.

No GPU needed: NVRTC (``cuda-bindings`` + the nvidia-cuda-nvrtc wheel) compiles to a
cubin, and ptxas' verbose report gives registers and spills. NVRTC compiles every program
for sm_80; its PTX is assembled for sm_90 by the standalone ptxas of NVRTC's release
(``nvrtc_results.compile_archs``: one NVVM run instead of two, ~20% of the matrix's CPU),
and NVRTC's own sm_90 compile of a sample is checked to give the same cubins.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from pathlib import Path

import pytest
from nvrtc_results import (
    compile_archs,
    compile_source,
    matching_ptxas,
    prefill_head_128_names,
    results_dir,
)

from kvblocks.ops.cuda_sources import (
    CACHE_OPS_SOURCE,
    DECODE_SOURCE,
    PREFILL_SOURCE,
    SPLIT_K_SOURCE,
    kernel_names,
)

# The full instantiation matrix (~2 min of NVRTC): `make test` runs it; the fast tier samples
# NVRTC through tests/ops/test_prefill_kernel_nvrtc.py and the kernel-model tests.
pytestmark = pytest.mark.slow

nvrtc_build = pytest.importorskip("kvblocks.ops.nvrtc_build")
pytest.importorskip("cuda.bindings.nvrtc")

ARCHS = ["sm_80", "sm_90"]


SOURCES = (CACHE_OPS_SOURCE, SPLIT_K_SOURCE, DECODE_SOURCE, PREFILL_SOURCE)
# Name expressions per program: the ~210 decode instantiations take about a minute per
# architecture in one program, so they are compiled in pieces on every core.
CHUNK = 48


def _compile(job: tuple[Path | None, str, list[str]]):
    directory, source, names = job
    return source, compile_archs(directory, source, ARCHS, names)


@pytest.fixture(scope="module")
def all_compiled(request):
    """{arch: {source: CompileResult}} for every instantiation, the programs compiled in
    parallel processes (NVRTC holds no state between programs), each once per run
    (nvrtc_results.py: test_prefill_kernel_nvrtc.py compiles the same prefill program):
    NVRTC compiles each for sm_80, and the ptxas of NVRTC's release assembles its PTX for
    sm_90 (nvrtc_results.compile_archs; checked against NVRTC below)."""
    directory = results_dir(request.config)
    jobs = [
        (directory, source, names[i : i + CHUNK])
        for source in SOURCES
        for names in [kernel_names(source)]
        for i in range(0, len(names), CHUNK)
    ]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        pieces = list(pool.map(_compile, jobs))
    out: dict[str, dict[str, nvrtc_build.CompileResult]] = {a: {} for a in ARCHS}
    for source, by_arch in pieces:
        for arch, result in by_arch.items():
            merged = out[arch].get(source)
            if merged is None:
                out[arch][source] = result
            else:
                merged.kernels.update(result.kernels)
                merged.cubin_bytes += result.cubin_bytes
                merged.log += result.log
    return out


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request, all_compiled):
    return request.param, all_compiled[request.param]


def test_all_instantiations_compile(compiled):
    arch, results = compiled
    for source, result in results.items():
        assert result.cubin_bytes > 0
        assert set(result.kernels) == set(kernel_names(source)), f"{source} {arch}"
        for kernel in result.kernels.values():
            assert kernel.registers > 0, kernel


def test_no_spills_at_head_size_128(compiled):
    arch, results = compiled
    at_128 = [k for k in results[SPLIT_K_SOURCE].kernels.values() if ", 128" in k.name]
    # 3 dtypes x (decode, merge), and fp32's prefill: fp16/bf16 prefill runs PREFILL_SOURCE.
    assert len(at_128) == 3 * 2 + 1
    for kernel in at_128 + list(results[CACHE_OPS_SOURCE].kernels.values()):
        assert kernel.spill_stores == 0 and kernel.spill_loads == 0, f"{arch} {kernel}"


def test_no_kernel_spills(compiled):
    arch, results = compiled
    spilled = [
        k for r in results.values() for k in r.kernels.values() if k.spill_stores or k.spill_loads
    ]
    assert not spilled, f"{arch}: {spilled}"


def test_sm_90_assembled_from_the_sm_80_ptx_is_what_nvrtc_compiles(request, all_compiled):
    """The matrix's sm_90 cubins come from the standalone ptxas of NVRTC's release, fed the
    PTX NVRTC made for sm_80. NVRTC itself compiles a sample for sm_90 (the cache-ops
    program, and the head-128 prefill kernels the fast tier compiles): the same cubin size
    and, kernel by kernel, the same registers, spills, stack and shared memory."""
    if matching_ptxas() is None:
        pytest.skip("no standalone ptxas of NVRTC's release: the matrix ran NVRTC for sm_90")
    directory = results_dir(request.config)
    assembled = all_compiled["sm_90"]
    names = kernel_names(CACHE_OPS_SOURCE)
    by_nvrtc = compile_source(directory, CACHE_OPS_SOURCE, "sm_90", names)
    assert by_nvrtc.cubin_bytes == assembled[CACHE_OPS_SOURCE].cubin_bytes
    assert by_nvrtc.kernels == assembled[CACHE_OPS_SOURCE].kernels
    head_128 = prefill_head_128_names()
    by_nvrtc = compile_source(directory, PREFILL_SOURCE, "sm_90", head_128)
    assert len(by_nvrtc.kernels) == 4
    for name in head_128:
        assert by_nvrtc.kernels[name] == assembled[PREFILL_SOURCE].kernels[name], name
    # ptxas was told sm_90: its report is not sm_80's (which a wrong .target would give).
    assert "for 'sm_90'" in assembled[PREFILL_SOURCE].log
    assert "for 'sm_90'" not in all_compiled["sm_80"][PREFILL_SOURCE].log


def test_compile_errors_fail_with_the_log(tmp_path, monkeypatch):
    from kvblocks.ops import cuda_sources

    (tmp_path / "broken.cu").write_text("__global__ void k() { undeclared(); }\n")
    monkeypatch.setattr(cuda_sources, "cuda_dir", lambda: tmp_path)
    monkeypatch.setattr(nvrtc_build, "read_source", lambda name: (tmp_path / name).read_text())
    with pytest.raises(nvrtc_build.NvrtcCompileError, match="undeclared"):
        nvrtc_build.compile_source("broken.cu", "sm_90", [])


def test_packaged_source_links_cover_every_cuda_file():
    from pathlib import Path

    from kvblocks.ops import cuda_sources

    repo_cuda = Path(__file__).resolve().parents[2] / "cuda"
    links = Path(cuda_sources.__file__).resolve().parent / "_cuda"
    sources = sorted(p.name for p in [*repo_cuda.glob("*.cu"), *repo_cuda.glob("*.cuh")])
    assert sorted(p.name for p in links.iterdir()) == sources
    for name in sources:
        assert (links / name).read_bytes() == (repo_cuda / name).read_bytes(), name
    assert cuda_sources.cuda_dir() == repo_cuda


def test_compiling_leaves_the_interpreters_shared_bytes_alone():
    """NVRTC writes its log and binary into the buffers it is given. A warning-free compile
    has a one-byte log (its NUL), and ``b" " * 1`` is CPython's shared one-byte singleton:
    writing into it turned every ``b" "`` of the process into ``b"\\x00"`` (seen as a
    detokenizer emitting NULs after the emulated-kernel tests). Checked in a child so a
    regression cannot poison this process."""
    import subprocess
    import sys

    code = (
        "from kvblocks.ops import nvrtc_build\n"
        "p = nvrtc_build.compile_program('tiny.cu', [], ['-arch=sm_90'],\n"
        "                                code='__global__ void k(int* x) { *x = 1; }')\n"
        "assert p.log == '', repr(p.log)\n"
        "assert bytes([32])[0] == 32, 'the one-byte bytes singleton was overwritten'\n"
        "assert isinstance(p.binary, bytes) and p.binary[:4] == b'\\x7fELF'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_decode_kernel_registers_never_limit_occupancy(compiled):
    """The tensor-core decode kernel: every (dtype, head, block, GROUP) instantiation,
    spill-free (test_no_kernel_spills); at the modeled shapes (head 64/128/256, GROUP <= 8)
    its registers never cost a CTA per SM below what its shared memory allows."""
    import math

    import torch

    from kvblocks.ops.cuda_sources import decode_smem_bytes

    arch, results = compiled
    smem_per_sm = {"sm_80": 164 * 1024, "sm_90": 228 * 1024}[arch]
    kernels = results[DECODE_SOURCE].kernels
    decode = [k for k in kernels.values() if k.name.startswith("decode_attention_kernel")]
    # 6 head sizes, 3 blocks, 5 (4 at 256) GROUPs; at 256 also the one-buffer (STAGES 1)
    # variant for GPUs whose per-CTA opt-in is below the two-buffer one's shared memory.
    assert len(decode) == 2 * (5 * 3 * 5 + 3 * 4) + 2 * 3 * 4
    for kernel in decode:
        ctype, head, block, group_t, *rest = kernel.name[kernel.name.index("<") + 1 : -1].split(
            ", "
        )
        stages = int(rest[0]) if rest else 2
        assert stages == 2 or int(head) == 256, kernel.name
        dtype = {"__half": torch.float16, "__nv_bfloat16": torch.bfloat16}[ctype]
        smem = decode_smem_bytes(dtype, int(head), int(block), int(group_t), stages)
        by_smem = smem_per_sm // (smem + 1024)
        by_regs = 65536 // (128 * math.ceil(kernel.registers / 8) * 8)
        assert by_smem >= 1, f"{arch} {kernel}: {smem} B of shared memory"
        if int(head) in (64, 128, 256) and int(group_t) <= 8:  # the modeled shapes
            assert by_regs >= by_smem, f"{arch} {kernel}: {by_regs} < {by_smem} CTAs/SM"
        assert kernel.stack_bytes == 0, f"{arch} {kernel}"
