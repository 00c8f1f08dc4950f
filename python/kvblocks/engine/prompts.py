"""The prompts ``LLM.generate``/``stream`` take, and their parsing into one record each.

A prompt is text (needs a tokenizer), token ids (a list or a 1-D integer array), or, as in
vLLM, a dict: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, either with the
optional tenancy keys

- ``"cache_salt"``: a prefix-cache namespace (``str``, or UTF-8 ``bytes``): blocks are
  shared only between prompts of one salt, in the engine's cache and through a shared tier,
  so two tenants of one engine never read each other's KV (``""`` is no salt);
- ``"lora_id"``: the LoRA adapter the prompt runs under (an int >= 0), also a prefix-cache
  namespace (and carried by KV events). kvblocks' own model runs its base weights only: the
  id keeps an adapter's blocks apart, it does not apply the adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import check_iterable

__all__ = ["Prompt", "PromptSpec", "TextPrompt", "TokensPrompt", "as_prompt_list", "parse_prompt"]


class _Tenancy(TypedDict, total=False):
    cache_salt: str | bytes | None
    lora_id: int | None


class TextPrompt(_Tenancy):
    """A text prompt with tenancy keys (vLLM's ``TextPrompt``)."""

    prompt: str


class TokensPrompt(_Tenancy):
    """A token-id prompt with tenancy keys (vLLM's ``TokensPrompt``)."""

    prompt_token_ids: Sequence[int] | np.ndarray


Prompt = str | Sequence[int] | np.ndarray | TextPrompt | TokensPrompt
"""A text prompt (needs a tokenizer), a prompt of token ids, or either as a dict with a
``cache_salt`` and a ``lora_id``."""

_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "lora_id"})


@dataclass(frozen=True)
class PromptSpec:
    """One parsed prompt: ``text`` or ``token_ids`` (the other None), and its namespace."""

    text: str | None
    token_ids: Any
    cache_salt: str | bytes | None = None
    lora_id: int | None = None


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 0:
            raise InvalidArgumentError(
                "prompts must be a prompt or a list of them, got a 0-d array"
            )
        return [prompts] if prompts.ndim == 1 else list(prompts)
    items: list[Any] = list(check_iterable(prompts, "prompts", "prompts"))
    # A bool is no token id (True would be token 1): such a list is left to the prompt
    # checks, which refuse it.
    if items and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
        return [[int(t) for t in items]]
    return items


def parse_prompt(prompt: Prompt) -> PromptSpec:
    """``prompt``'s text or token ids and tenancy keys; InvalidArgumentError for a dict with
    unknown keys, both or neither of ``prompt``/``prompt_token_ids``, or a bad salt or id."""
    if not isinstance(prompt, Mapping):
        if isinstance(prompt, str):
            return PromptSpec(prompt, None)
        return PromptSpec(None, prompt)
    unknown = set(prompt) - _KEYS
    if unknown:
        raise InvalidArgumentError(
            f"unknown prompt keys {sorted(map(str, unknown))}; a prompt dict takes "
            "'prompt' or 'prompt_token_ids', and 'cache_salt', 'lora_id'"
        )
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidArgumentError(
            "a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'"
        )
    text = prompt.get("prompt")
    if "prompt" in prompt and not isinstance(text, str):
        raise InvalidArgumentError(f"'prompt' must be a str, got {type(text).__name__}")
    return PromptSpec(
        text if isinstance(text, str) else None,
        prompt.get("prompt_token_ids"),
        _check_salt(prompt.get("cache_salt")),
        _check_lora_id(prompt.get("lora_id")),
    )


def _check_salt(salt: object) -> str | bytes | None:
    if salt is None or isinstance(salt, str):
        return salt
    if isinstance(salt, bytes):
        try:
            salt.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgumentError("a bytes cache_salt must be UTF-8") from None
        return salt
    raise InvalidArgumentError(f"cache_salt must be a str, bytes or None, got {salt!r}")


def _check_lora_id(lora_id: object) -> int | None:
    if lora_id is None:
        return None
    if isinstance(lora_id, (bool, np.bool_)) or not isinstance(lora_id, (int, np.integer)):
        raise InvalidArgumentError(f"lora_id must be a non-negative int or None, got {lora_id!r}")
    if lora_id < 0:
        raise InvalidArgumentError(f"lora_id must be a non-negative int or None, got {lora_id!r}")
    return int(lora_id)
