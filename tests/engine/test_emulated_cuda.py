"""The whole engine on the CUDA kernels, executed by the CPU emulator (no GPU needed).

A stand-in CuPy (as in tests/ops/test_ops_cuda_backend.py) runs every kernel launch of
:mod:`kvblocks.ops.cuda_backend` with the g++-built CUDA emulation of ``cuda/*.cu``, and
the ops' CPU dispatch is pointed at that backend. So the engine's real kernel calls
(argument types, host-side maxima, launch planning, block tables with null padding and
released window blocks, copy-on-write copies) are checked end to end against the dense
reference.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.ops import cuda_backend, kernel_cache, reference
from kvblocks.ops.launch_plan import KernelLaunch
from kvblocks.sampling_params import SamplingParams

from .test_llm import _dense_beam_search, _prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
emu_runtime = pytest.importorskip("emu_runtime", reason="the ops helper's CUDA emulator")


def _fake_cupy(launches: list[str]) -> types.ModuleType:
    cupy = types.ModuleType("cupy")

    class ExternalStream(contextlib.AbstractContextManager):
        def __init__(self, ptr: int, device_id: int = -1) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            return None

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=None, path=None) -> None:
            # The backend loads cubins from its kernel cache by path; the sidecar metadata
            # names the instantiation, which the emulator launches.
            assert path is not None and code is None, "compiled outside the kernel cache"
            self.meta = json.loads(Path(path).with_suffix(".json").read_text())

        def get_function(self, name: str):
            assert name == self.meta["lowered"], (name, self.meta)
            expr = self.meta["name"]

            def kernel(grid, block, args, shared_mem=0):
                launches.append(expr)
                emu_runtime.emu_launch(KernelLaunch(expr, grid, block, shared_mem, tuple(args)))

            return kernel

    cupy.RawModule = RawModule  # type: ignore[attr-defined]
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        ExternalStream=ExternalStream,
        Device=lambda index: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 13000),
    )
    return cupy


@pytest.fixture(scope="module")
def kernel_cache_dir(tmp_path_factory) -> Path:
    """One kernel cache for the module: each instantiation is compiled (NVRTC) once."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def emulated_kernels(monkeypatch, kernel_cache_dir: Path) -> list[str]:
    """Route the CPU ops through the CUDA backend on the emulator; yields the launch log."""
    launches: list[str] = []
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(kernel_cache_dir))
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(launches))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=1)
    )
    # A one-SM "device" for the launch planner, as in the ops backend test.
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: types.SimpleNamespace(multi_processor_count=1),
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))

    def decode(q, kc, vc, bt, sl, *, scale=None, sliding_window=None, soft_cap=None):
        return cuda_backend.paged_attention(
            q, kc, vc, bt, sl, scale=scale, sliding_window=sliding_window,
            soft_cap=soft_cap, max_seq_len=int(sl.max()),
        )  # fmt: skip

    def prefill(q, kc, vc, bt, qsl, sl, *, scale=None, sliding_window=None, soft_cap=None):
        return cuda_backend.paged_prefill_attention(
            q, kc, vc, bt, qsl, sl, scale=scale, sliding_window=sliding_window,
            soft_cap=soft_cap, max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        )  # fmt: skip

    monkeypatch.setattr(reference, "paged_attention", decode)
    monkeypatch.setattr(reference, "paged_prefill_attention", prefill)
    monkeypatch.setattr(reference, "reshape_and_cache", cuda_backend.reshape_and_cache)
    monkeypatch.setattr(reference, "copy_blocks", cuda_backend.copy_blocks)
    cuda_backend._function.cache_clear()
    cuda_backend._arch.cache_clear()
    cuda_backend._target_ctas.cache_clear()
    yield launches
    cuda_backend._function.cache_clear()
    cuda_backend._target_ctas.cache_clear()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_on_emulated_kernels_equals_dense(emulated_kernels: list[str], family: str):
    model = build_tiny_model(
        tiny_config(family, sliding_window=16 if family == "mistral" else None)
    )
    prompts = [_prompt(5, 1), _prompt(37, 2)]
    expected = dense_greedy_generate(model, prompts, 10)
    llm = LLM(model, num_blocks=32, block_size=8, max_num_batched_tokens=16, device="cpu")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert [o.token_ids for o in outputs] == expected
    assert "reshape_and_cache_kernel" in emulated_kernels
    assert any(name.startswith("paged_attention_kernel") for name in emulated_kernels)


def test_beams_with_copies_on_emulated_kernels(
    emulated_kernels: list[str], tiny_llama: LlamaForCausalLM
) -> None:
    prompt = _prompt(13, 3)
    llm = LLM(tiny_llama, num_blocks=32, block_size=8, device="cpu")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, beam_width=2, n=2))[0]
    expected = _dense_beam_search(tiny_llama, prompt, 2, 6)
    assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in expected]
    assert "copy_blocks_kernel" in emulated_kernels
