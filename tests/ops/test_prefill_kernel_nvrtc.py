"""The tensor-core prefill kernel compiles with NVRTC for sm_80 and sm_90, every
instantiation (with and without attention sinks), without spills (no GPU needed: ptxas'
report gives registers and spills). The fixture of test_ops_nvrtc.py covers the other
sources; this one the prefill source: every instantiation in `make test` (the program the
matrix compiles too, so once per run, its sm_90 cubin assembled from the sm_80 PTX by
NVRTC's release of ptxas), the head-128 ones (fp16 and bf16, with and without sinks) in
the fast tier, NVRTC for either architecture, which the whole program would cost ~20 CPU-s."""

from __future__ import annotations

import pytest
from nvrtc_results import compile_archs, compile_source, prefill_head_128_names, results_dir

from kvblocks.ops.checks import SUPPORTED_HEAD_SIZES
from kvblocks.ops.cuda_sources import MIN_SMEM_OPTIN, PREFILL_SOURCE, kernel_names
from kvblocks.ops.prefill_launch import prefill_smem_bytes

pytest.importorskip("cuda.bindings.nvrtc")


ARCHS = ["sm_80", "sm_90"]


def _every_name() -> list[str]:
    return kernel_names(PREFILL_SOURCE)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("sm_80", _every_name), marks=pytest.mark.slow, id="sm_80"),
        pytest.param(("sm_90", _every_name), marks=pytest.mark.slow, id="sm_90"),
        pytest.param(("sm_80", prefill_head_128_names), id="sm_80-head128"),
        pytest.param(("sm_90", prefill_head_128_names), id="sm_90-head128"),
    ],
)
def compiled(request):
    arch, which = request.param
    names = which()
    directory = results_dir(request.config)
    if which is _every_name:
        # test_ops_nvrtc.py's matrix compiles the whole program the same way: once per run.
        return arch, names, compile_archs(directory, PREFILL_SOURCE, ARCHS, names)[arch]
    # The fast tier's sample: NVRTC for either architecture.
    return arch, names, compile_source(directory, PREFILL_SOURCE, arch, names)


def test_every_instantiation_compiles_without_spills(compiled):
    arch, names, result = compiled
    assert result.cubin_bytes > 0
    assert set(result.kernels) == set(names)
    # fp16, bf16; with and without sinks
    assert len(result.kernels) == 2 * 2 * (len(SUPPORTED_HEAD_SIZES) if len(names) > 4 else 1)
    for kernel in result.kernels.values():
        assert kernel.spill_stores == 0 and kernel.spill_loads == 0, f"{arch} {kernel}"
        assert kernel.stack_bytes == 0, f"{arch} {kernel}"


def test_two_ctas_fit_an_sm(compiled):
    # __launch_bounds__(128, 2): at most 255 registers, so two CTAs' registers fit 64K; two
    # CTAs' shared memory (plus the 1 KiB reserved per CTA) fit an A100's 164 KiB, and one
    # CTA's the 99 KiB a CTA may opt into on sm_86/sm_89.
    arch, _, result = compiled
    for kernel in result.kernels.values():
        assert 2 * 128 * kernel.registers <= 65536, f"{arch} {kernel}"
        head = int(kernel.name.split(", ")[1].rstrip(">"))
        smem = kernel.static_smem_bytes + prefill_smem_bytes(head)
        assert smem <= MIN_SMEM_OPTIN, kernel.name
        assert 2 * (smem + 1024) <= 164 * 1024, kernel.name
