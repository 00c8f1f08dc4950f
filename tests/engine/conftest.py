"""Fixtures of the engine tests: tiny models of each family."""

from __future__ import annotations

import pytest
import torch

from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.tiny import build_tiny_model, tiny_config

# The tiny model's ops are microseconds long; on a loaded 2-core machine intra-op threads
# cost far more than they save (measured: 2 ms vs 0.1 ms per small matmul).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    """The built-in tiny Llama (float32, CPU)."""
    return build_tiny_model(tiny_config("llama"))


@pytest.fixture(scope="session")
def tiny_mistral() -> LlamaForCausalLM:
    """Tiny Mistral with a 24-token sliding window."""
    return build_tiny_model(tiny_config("mistral"))


@pytest.fixture(scope="session")
def tiny_qwen2() -> LlamaForCausalLM:
    """Tiny Qwen2 (q/k/v biases)."""
    return build_tiny_model(tiny_config("qwen2"))
