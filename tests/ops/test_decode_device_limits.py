"""Decode launches on every GPU it compiles for: the kernel variant is chosen on the host
from the device's per-CTA shared-memory limit (``sharedMemPerBlockOptin``), checked with
the limits of compute capability 8.0 / 8.6 / 8.9 / 9.0 and, end to end, through the CUDA
backend on a stand-in device whose kernels run on the emulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from emu_runtime import DEVICES, clear_backend_caches
from ops_cases import make_case, ref_decode, tolerance
from test_ops_cuda_backend import install_fake_device, kernel_cache_dir  # noqa: F401 (fixture)

from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import cuda_backend
from kvblocks.ops.checks import SUPPORTED_HEAD_SIZES
from kvblocks.ops.cuda_sources import (
    DECODE_BLOCK_SIZES,
    DECODE_GROUPS,
    decode_smem_bytes,
    decode_stages_instantiated,
)
from kvblocks.ops.decode_attention import (
    DecodeAttention,
    decode_kernel_group,
    decode_kernel_stages,
    decode_kernel_supported,
)


def _decoder(head_size, group, block_size, dtype, smem_limit):
    return DecodeAttention(
        num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=block_size,
        dtype=dtype, device="cpu", max_seqs=4, smem_limit=smem_limit, launcher=lambda item: None,
    )  # fmt: skip


@pytest.mark.parametrize("capability", sorted(DEVICES))
def test_every_shape_plans_a_variant_that_fits(capability):
    limit = DEVICES[capability].smem_optin
    for head_size in SUPPORTED_HEAD_SIZES:
        assert decode_kernel_supported(torch.float16, head_size, 16, limit)
        for group in (1, 3, 8, 16):
            group_t = decode_kernel_group(head_size, group)
            two = decode_smem_bytes(torch.float16, head_size, 16, group_t, 2)
            for block_size in DECODE_BLOCK_SIZES:
                dec = _decoder(head_size, group, block_size, torch.bfloat16, limit)
                assert dec.smem_bytes <= limit, (head_size, group, dec.kernel)
                # Two K/V buffers per warp wherever they fit; one only where they do not.
                assert dec.stages == (2 if two <= limit else 1), (head_size, group)
                assert (dec.kernel.count(",") == 4) == (dec.stages == 1), dec.kernel


def test_head_256_takes_one_buffer_below_sm80s_limit():
    stages = {c: decode_kernel_stages(256, 8, d.smem_optin) for c, d in DEVICES.items()}
    assert stages == {"8.0": 2, "8.6": 1, "8.9": 1, "9.0": 2}
    assert decode_smem_bytes(torch.float16, 256, 16, 8, 2) == 147_840  # the figure
    assert decode_smem_bytes(torch.float16, 256, 16, 8, 1) <= DEVICES["8.6"].smem_optin
    # Head 128 and below fit two buffers everywhere (no one-buffer build of them).
    for head_size in SUPPORTED_HEAD_SIZES[:-1]:
        for group_t in DECODE_GROUPS:
            assert decode_stages_instantiated(head_size, group_t) in ((2,), ())


def test_a_limit_no_variant_fits_is_refused_by_name():
    assert not decode_kernel_supported(torch.float16, 256, 16, 64 * 1024)
    assert decode_kernel_supported(torch.float16, 64, 16, 64 * 1024)
    with pytest.raises(InvalidArgumentError, match="shared memory per CTA"):
        _decoder(256, 8, 16, torch.float16, 64 * 1024)
    with pytest.raises(InvalidArgumentError, match="smem_limit"):
        _decoder(128, 8, 16, torch.float16, 0)


@pytest.mark.parametrize("capability", ["8.6", "9.0"])
def test_head_256_decode_runs_through_the_backend(monkeypatch, kernel_cache_dir, capability):  # noqa: F811
    """The backend reads the device's opt-in limit and launches a variant that fits; the
    stand-in device refuses an opt-in past its limit, as cudaFuncSetAttribute does."""
    device = DEVICES[capability]
    fake = install_fake_device(monkeypatch, kernel_cache_dir, device)
    try:
        lens = [300, 40]
        case = make_case(11, lens, [1, 1], num_kv_heads=1, group=8, head_size=256,
                         block_size=16, dtype=torch.bfloat16)  # fmt: skip
        got = cuda_backend.paged_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            scale=None, sliding_window=None, soft_cap=None, max_seq_len=None,
            seq_lens_host=np.array(lens, dtype=np.int32),
        )  # fmt: skip
        torch.testing.assert_close(got, ref_decode(case), **tolerance(torch.bfloat16))
        kernel = fake.launches[0]
        assert kernel.startswith("decode_attention_kernel<__nv_bfloat16, 256, 16, 8")
        assert (kernel.count(",") == 4) == (device.smem_optin < 147_840), kernel
        assert fake.modules[0]["arch"] == f"sm_{device.capability[0]}{device.capability[1]}"
    finally:
        clear_backend_caches()
