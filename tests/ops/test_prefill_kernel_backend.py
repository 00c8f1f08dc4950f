"""fp16/bf16 prefill through the CUDA backend reaches the tensor-core kernel: the stand-in
CuPy of test_ops_cuda_backend.py loads the cubin NVRTC compiled into the kernel cache and
runs each launch on the emulator."""

from __future__ import annotations

import pytest
import torch
from ops_cases import make_case, ref_prefill, tolerance
from test_ops_cuda_backend import fake_cupy, kernel_cache_dir  # noqa: F401 (fixtures)

from kvblocks.ops import cuda_backend

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_runs_the_tensor_core_kernel(fake_cupy, dtype):  # noqa: F811
    case = make_case(4, [70, 12], [70, 4], num_kv_heads=2, group=2, head_size=64, dtype=dtype)
    got = cuda_backend.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=20, soft_cap=None,
        max_query_len=70,
    )  # fmt: skip
    want = ref_prefill(case, sliding_window=20)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    ctype = "__half" if dtype == torch.float16 else "__nv_bfloat16"
    assert fake_cupy.launches == [f"prefill_attention_kernel<{ctype}, 64>"]
    assert fake_cupy.modules[0]["arch"] == "sm_90"


def test_sinks_reach_the_kernels_through_the_backend(fake_cupy):  # noqa: F811
    """The backend hands a layer's sinks to the prefill kernel's SINKS instantiation (its
    own cubin in the kernel cache)."""
    case = make_case(5, [70, 12], [70, 4], num_kv_heads=2, group=2, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    sinks = torch.tensor([3.0, -1e4, 0.5, 40.0])
    got = cuda_backend.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=None, soft_cap=None,
        max_query_len=70, sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(got, ref_prefill(case, sinks=sinks), **tolerance(torch.float16))
    assert fake_cupy.launches == ["prefill_attention_kernel<__half, 64, true>"]
    assert fake_cupy.modules[0]["name"] == fake_cupy.launches[0]
