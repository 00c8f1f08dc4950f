"""Every kernel instantiation the front-ends launch compiles with NVRTC for sm_80/sm_90.

No GPU needed: NVRTC (``cuda-bindings`` + the nvidia-cuda-nvrtc wheel) compiles to a
cubin, and ptxas' verbose report gives registers and spills.
"""

from __future__ import annotations

import pytest

from kvblocks.ops.cuda_sources import ATTENTION_SOURCE, CACHE_OPS_SOURCE, kernel_names

nvrtc_build = pytest.importorskip("kvblocks.ops.nvrtc_build")
pytest.importorskip("cuda.bindings.nvrtc")

ARCHS = ["sm_80", "sm_90"]


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request):
    arch = request.param
    return arch, {
        source: nvrtc_build.compile_source(source, arch, kernel_names(source))
        for source in (CACHE_OPS_SOURCE, ATTENTION_SOURCE)
    }


def test_all_instantiations_compile(compiled):
    arch, results = compiled
    for source, result in results.items():
        assert result.cubin_bytes > 0
        assert set(result.kernels) == set(kernel_names(source)), f"{source} {arch}"
        for kernel in result.kernels.values():
            assert kernel.registers > 0, kernel


def test_no_spills_at_head_size_128(compiled):
    arch, results = compiled
    at_128 = [k for k in results[ATTENTION_SOURCE].kernels.values() if ", 128" in k.name]
    assert len(at_128) == 3 * 3  # 3 dtypes x (decode, prefill, merge)
    for kernel in at_128 + list(results[CACHE_OPS_SOURCE].kernels.values()):
        assert kernel.spill_stores == 0 and kernel.spill_loads == 0, f"{arch} {kernel}"


def test_no_kernel_spills(compiled):
    arch, results = compiled
    spilled = [
        k for r in results.values() for k in r.kernels.values() if k.spill_stores or k.spill_loads
    ]
    assert not spilled, f"{arch}: {spilled}"


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
