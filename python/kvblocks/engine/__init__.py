"""The paged-attention inference engine for Llama-family models (Llama, Mistral, Qwen2).

:class:`LLM` is the entry point::

    from kvblocks.engine import LLM
    from kvblocks.sampling_params import SamplingParams

    llm = LLM()  # the built-in tiny model; or LLM("/path/to/hf/checkpoint")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))

Modules: :mod:`~kvblocks.engine.config` (HF config), :mod:`~kvblocks.engine.model`
(the decoder), :mod:`~kvblocks.engine.loader` (safetensors checkpoints),
:mod:`~kvblocks.engine.tiny` (built-in random model), :mod:`~kvblocks.engine.dense`
(cache-free reference), :mod:`~kvblocks.engine.sampler`, :mod:`~kvblocks.engine.runner`
(one step on the paged cache), :mod:`~kvblocks.engine.llm`, :mod:`~kvblocks.engine.tokenizer`.
Needs torch (``pip install kvblocks[engine]``).
"""

from kvblocks.engine.config import ModelConfig
from kvblocks.engine.llm import LLM
from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.outputs import Completion, GenerationOutput

__all__ = ["LLM", "Completion", "GenerationOutput", "LlamaForCausalLM", "ModelConfig"]
