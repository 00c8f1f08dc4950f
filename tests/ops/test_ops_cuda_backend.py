"""The CuPy backend's plumbing, with a stand-in CuPy whose kernels run on the emulator.

No GPU here: the fake module records how kernels are loaded and launched (cubins from
the kernel cache, compiled for real by NVRTC; torch's stream) and executes each launch
with the CPU emulation on the CPU tensors' memory, so the backend is checked end to end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from emu_runtime import DEVICES, DeviceLimits, clear_backend_caches, emu_launch
from ops_cases import make_case, ref_decode, ref_prefill

from kvblocks.ops import cuda_backend, kernel_cache, kernel_driver
from kvblocks.ops.cuda_sources import decode_smem_bytes
from kvblocks.ops.launch_plan import KernelLaunch


class FakeCupy(types.ModuleType):
    """Just the CuPy surface the backend uses."""

    def __init__(self, device: DeviceLimits = DEVICES["9.0"]):
        super().__init__("cupy")
        self.modules = []
        self.launches = []
        self.streams = []
        self.current_stream = None
        fake = self

        class ExternalStream(contextlib.AbstractContextManager):
            def __init__(self, ptr, device_id=-1):
                self.ptr = ptr
                fake.streams.append((ptr, device_id))

            def __enter__(self):
                fake.current_stream = self.ptr
                return self

            def __exit__(self, *exc):
                fake.current_stream = None

        class RawModule:
            def __init__(self, code=None, options=(), name_expressions=None, path=None):
                # The backend loads cubins from the kernel cache by path; the sidecar
                # metadata names the instantiation, which the emulator launches.
                assert path is not None and code is None, "compiled outside the cache"
                self.binary = Path(path).read_bytes()
                self.meta = json.loads(Path(path).with_suffix(".json").read_text())
                fake.modules.append(self.meta)

            def get_function(self, name):
                assert name == self.meta["lowered"], (name, self.meta)
                return Function(self.meta["name"])

        class Function:
            """cupy.cuda.function.Function: launches on ``stream`` or the current one."""

            def __init__(self, expr):
                self.expr = expr
                self._max_dynamic = 48 * 1024

            @property
            def max_dynamic_shared_size_bytes(self):
                return self._max_dynamic

            @max_dynamic_shared_size_bytes.setter
            def max_dynamic_shared_size_bytes(self, value):
                # cudaFuncSetAttribute refuses more than the device's opt-in limit.
                if value > device.smem_optin:
                    raise RuntimeError(
                        f"cudaErrorInvalidValue: {value} B > {device.smem_optin} B opt-in"
                    )
                self._max_dynamic = value

            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                on = fake.current_stream if stream is None else stream.ptr
                assert on == 1234, "launched off torch's stream"
                assert shared_mem <= self.max_dynamic_shared_size_bytes, "no smem opt-in"
                fake.launches.append(self.expr)
                emu_launch(KernelLaunch(self.expr, grid, block, shared_mem, tuple(args)))

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(
            ExternalStream=ExternalStream,
            Device=lambda index: contextlib.nullcontext(),
            runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 13000),
        )


@pytest.fixture(scope="module")
def kernel_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


def install_fake_device(monkeypatch, cache_dir, device: DeviceLimits, sms: int | None = None):
    """Make the CUDA backend see ``device`` (its limits; ``sms`` overrides the SM count)
    with a stand-in CuPy whose launches run on the emulator."""
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(cache_dir))
    fake = FakeCupy(device)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=1234)
    )
    props = device.properties(sms)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: device.capability)
    clear_backend_caches()
    return fake


@pytest.fixture
def fake_cupy(monkeypatch, kernel_cache_dir):
    # One SM: small batches split their sequences.
    yield install_fake_device(monkeypatch, kernel_cache_dir, DEVICES["9.0"], sms=1)
    clear_backend_caches()


def test_decode_through_the_backend(fake_cupy):
    case = make_case(3, [700, 5], [1, 1], num_kv_heads=1, group=4, head_size=128,
                     dtype=torch.float16)  # fmt: skip
    got = cuda_backend.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        scale=None, sliding_window=None, soft_cap=None, max_seq_len=700,
    )  # fmt: skip
    want = ref_decode(case)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # 2 CTAs < 4 per SM on the fake 1-SM device: split-K, then the merge kernel.
    assert fake_cupy.launches == [
        "split_k_attention_kernel<__half, 128, 8>",
        "merge_splits_kernel<__half, 128>",
    ]
    # Each instantiation is a cubin for the device's architecture from the kernel cache.
    assert [m["name"] for m in fake_cupy.modules] == fake_cupy.launches
    assert all(m["arch"] == "sm_90" for m in fake_cupy.modules)
    assert all(
        (kernel_cache.cache_dir() / m["file"]).read_bytes()[:4] == b"\x7fELF"
        for m in fake_cupy.modules
    )
    assert fake_cupy.streams and all(ptr == 1234 for ptr, _ in fake_cupy.streams)


def test_planned_decode_through_the_backend(fake_cupy):
    """fp16 with host lengths: the tensor-core kernel through the length-aware planner,
    its plan cached across calls (layers) with the same lengths."""
    lens = [2000, 30, 0, 300]
    case = make_case(5, lens, [1] * 4, num_kv_heads=2, group=8, head_size=128,
                     dtype=torch.float16)  # fmt: skip
    host = np.array(lens, dtype=np.int32)
    want = ref_decode(case)
    for _ in range(2):
        got = cuda_backend.paged_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            scale=None, sliding_window=None, soft_cap=None, max_seq_len=None,
            seq_lens_host=host,
        )  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # 2 KV heads on the fake 1-SM device: the 2000-token sequence is split, then merged.
    assert fake_cupy.launches == 2 * [
        "decode_attention_kernel<__half, 128, 16, 8>",
        "merge_partials_kernel<__half, 128>",
    ]
    assert decode_smem_bytes(torch.float16, 128, 16, 8) > 48 * 1024, "the opt-in was needed"
    assert len(kernel_driver._DECODERS) == 1, "one cached plan object for both calls"
    # Without host lengths and without a max_seq_len hint, seq_lens is read back.
    got = cuda_backend.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        scale=None, sliding_window=None, soft_cap=None, max_seq_len=None,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert fake_cupy.launches[-2].startswith("decode_attention_kernel<")


def test_prefill_and_cache_ops_through_the_backend(fake_cupy):
    case = make_case(4, [30, 12], [30, 4], num_kv_heads=2, group=2, head_size=64)
    got = cuda_backend.paged_prefill_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, scale=None, sliding_window=8, soft_cap=None,
        max_query_len=30,
    )  # fmt: skip
    want = ref_prefill(case, sliding_window=8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([1, 2, 40], dtype=torch.int64)
    cuda_backend.reshape_and_cache(key, key * 2, case.key_cache, case.value_cache, slots)
    assert torch.equal(case.key_cache[2, :, 8], key[2])
    assert torch.equal(case.value_cache[0, :, 1], key[0] * 2)
    cuda_backend.copy_blocks([(case.key_cache, case.value_cache)], torch.tensor([[2, 3]]))
    assert torch.equal(case.key_cache[3], case.key_cache[2])
    assert fake_cupy.launches[-2:] == ["reshape_and_cache_kernel", "copy_blocks_kernel"]
    # extern "C" kernels keep their names.
    assert fake_cupy.modules[-1]["lowered"] == "copy_blocks_kernel"


def test_decode_target_ctas_follow_shared_memory(monkeypatch):
    """The planner fills the device with as many decode CTAs as fit an SM's shared memory."""
    h100 = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h100)
    cuda_backend.decode_target_ctas.cache_clear()
    try:
        assert (
            cuda_backend.decode_target_ctas(0, decode_smem_bytes(torch.float16, 128, 16, 8)) == 264
        )
        assert (
            cuda_backend.decode_target_ctas(0, decode_smem_bytes(torch.bfloat16, 256, 16, 8)) == 132
        )
        assert cuda_backend.decode_target_ctas(0, 1024) == 132 * 4  # capped like the old kernel
    finally:
        cuda_backend.decode_target_ctas.cache_clear()
