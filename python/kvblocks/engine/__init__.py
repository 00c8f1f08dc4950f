"""The paged-attention inference engine for Llama-family, Gemma 2/3, gpt-oss, Llama 4 and
Bamba decoders.

:class:`LLM` is the entry point::

    from kvblocks.engine import LLM, SamplingParams

    llm = LLM()  # the built-in tiny model; or LLM("/path/to/hf/checkpoint")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))

Modules: :mod:`~kvblocks.engine.config` (HF config), :mod:`~kvblocks.engine.models`
(the decoders, one module per family), :mod:`~kvblocks.engine.loader` (safetensors
checkpoints), :mod:`~kvblocks.engine.tiny` (built-in random model),
:mod:`~kvblocks.engine.dense` (cache-free reference), :mod:`~kvblocks.engine.sampler`,
:mod:`~kvblocks.engine.runner` (one step on the paged cache), :mod:`~kvblocks.engine.llm` (the
facade) over :mod:`~kvblocks.engine.input_processor` (with :mod:`~kvblocks.engine.prompts`),
:mod:`~kvblocks.engine.engine_core` (the step loop) and
:mod:`~kvblocks.engine.output_processor`, :mod:`~kvblocks.engine.build` (what an ``LLM`` is
built from), :mod:`~kvblocks.engine.tokenizer`,
:mod:`~kvblocks.engine.weights_identity` (:func:`weights_digest`: what names the weights in a
shared tier).
:class:`~kvblocks.sampling_params.SamplingParams` is re-exported here so that vLLM-style code
imports both names together. Needs torch and safetensors (``pip install 'kvblocks[engine]'``);
without them the import raises one ImportError saying so.
"""

from kvblocks._extras import raise_missing_extra

try:
    import safetensors  # noqa: F401
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:
    raise_missing_extra(_exc, "kvblocks.engine", "engine", ["safetensors", "torch"])

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.llm import LLM
from kvblocks.engine.models import CausalLM, LlamaForCausalLM
from kvblocks.engine.outputs import Completion, GenerationOutput
from kvblocks.engine.prompts import TextPrompt, TokensPrompt
from kvblocks.engine.weights_identity import weights_digest
from kvblocks.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CausalLM",
    "Completion",
    "GenerationOutput",
    "LlamaForCausalLM",
    "ModelConfig",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "weights_digest",
]
