"""The host tier on the engine's CUDA kernel path, run by the CPU emulator (no GPU needed).

Blocks loaded from the host tier are read by the real paged-attention kernels (through
the emulated CuPy of :mod:`tests.engine.test_emulated_cuda`): an evicted prompt that comes
back by loads must give the dense reference's tokens.
"""

from __future__ import annotations

import pytest

from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.sampling_params import SamplingParams

from .test_emulated_cuda import emulated_kernels, kernel_cache_dir  # noqa: F401 (fixtures)
from .test_llm import _prompt


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_loaded_prefix_on_emulated_kernels_equals_dense(
    emulated_kernels: list[str],  # noqa: F811
    tiny_llama: LlamaForCausalLM,
    policy: str,
) -> None:
    target = _prompt(33, 1)  # four 8-token blocks can come back from the tier
    others = [_prompt(33, 10 + i) for i in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    expected = dense_greedy_generate(tiny_llama, [target], params.max_tokens)[0]
    llm = LLM(
        tiny_llama,
        num_blocks=12,
        block_size=8,
        num_cpu_blocks=0,
        device="cpu",
        host_cache_blocks=16,
        host_offload=policy,  # type: ignore[arg-type]
    )
    runs = [llm.generate([p], params)[0].outputs[0].token_ids for p in [target, *others, target]]
    assert runs[0] == runs[-1] == expected
    assert llm.stats()["cache"]["host_loads"] == 4
    assert any(name.startswith("split_k_attention") for name in emulated_kernels)
