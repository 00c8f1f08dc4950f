"""The ops' kernel choice is layered: one driver module picks every kernel, and only what it
can launch is compiled (issue 17 part 4).

That no ops module imports one that imports it back is checked package-wide, by
``tests/test_import_layering.py``.
"""

from __future__ import annotations


def test_precompile_covers_exactly_the_split_k_kernels_the_driver_launches():
    # fp16/bf16 prefill always takes the tensor-core kernel: the split-K kernel's prefill
    # instantiation is compiled (precompile, NVRTC tests) for fp32 only; every kernel the
    # driver launches is in the list.
    import numpy as np
    import torch

    from kvblocks.ops import kernel_driver
    from kvblocks.ops.cuda_sources import (
        DECODE_SOURCE,
        PREFILL_ROWS,
        PREFILL_SOURCE,
        SPLIT_K_SOURCE,
        kernel_names,
        split_k_kernel_name,
    )

    compiled = set(kernel_names(SPLIT_K_SOURCE))
    everything = compiled | set(kernel_names(PREFILL_SOURCE)) | set(kernel_names(DECODE_SOURCE))
    for dtype in (torch.float16, torch.bfloat16):
        assert split_k_kernel_name(dtype, 128, PREFILL_ROWS) not in compiled
    assert split_k_kernel_name(torch.float32, 128, PREFILL_ROWS) in compiled

    launched: list[str] = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        query = torch.zeros((5, 4, 128), dtype=dtype)
        cache = torch.zeros((4, 2, 16, 128), dtype=dtype)
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        seq_lens = torch.tensor([20, 3], dtype=torch.int32)
        qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
        kw = {"scale": None, "sliding_window": None, "soft_cap": None}
        kernel_driver.run_prefill(
            lambda item: launched.append(item.name), query, cache, cache, tables, qsl,
            seq_lens, max_query_len=3, target_ctas=4096, **kw,
        )  # fmt: skip
        for host in (np.array([20, 3], dtype=np.int32), None):
            kernel_driver.run_paged_attention(
                lambda item: launched.append(item.name), query[:2], cache, cache, tables,
                seq_lens, max_seq_len=20, seq_lens_host=host, split_k_ctas=4096,
                smem_limit=None, **kw,
            )  # fmt: skip
    kernel_driver._DECODERS.clear()  # the decoders hold this test's launchers
    assert set(launched) <= everything, set(launched) - everything
    assert any(n.startswith("split_k_attention_kernel<__half") for n in launched)
    assert any(n.startswith("decode_attention_kernel<__half") for n in launched)
    assert any(n.startswith("prefill_attention_kernel<__nv_bfloat16") for n in launched)
