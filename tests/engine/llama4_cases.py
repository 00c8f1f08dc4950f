"""What the Llama 4 tests share: the chunk and block sizes of transformers' checkpoint
(``hf_families.LLAMA4``), the layer types, the tiny model's Llama 4 options with some
changed, and the blocks a group holds (docs/hybrid-groups.md)."""

from __future__ import annotations

from typing import Any

from kvblocks.engine.llama4_config import Llama4Options
from kvblocks.engine.tiny import tiny_config

CHUNK, BLOCK = 32, 16
FULL, CHUNKED = "full_attention", "chunked_attention"


def _options(**change: Any) -> Llama4Options:
    base = tiny_config("llama4_text").llama4
    assert base is not None
    return Llama4Options(**{**base.__dict__, **change})


def _held(total: int, chunk: int | None, block: int) -> int:
    """docs/hybrid-groups.md: blocks a group holds for ``total`` computed tokens."""
    blocks = -(-total // block)
    if chunk is None:
        return blocks
    return blocks - (total // chunk * chunk) // block
