"""Text <-> token ids: an HF ``tokenizer.json`` through ``tokenizers``, or raw bytes.

Token-id prompts never need a tokenizer. A checkpoint directory with a
``tokenizer.json`` gets :class:`HFTokenizer`; the built-in tiny model, whose vocabulary
is exactly 256 entries, gets :class:`ByteTokenizer` (UTF-8 bytes as token ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvblocks.errors import InvalidArgumentError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens such as BOS added as the tokenizer defines)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; invalid sequences decode to U+FFFD."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Decode ids below 256 as UTF-8 bytes (others are not bytes and are dropped)."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers is an engine extra
            raise InvalidArgumentError(
                "text prompts need the 'tokenizers' package (pip install kvblocks[engine])"
            ) from exc
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise InvalidArgumentError(f"cannot load tokenizer {path}: {exc}") from None

    @property
    def vocab_size(self) -> int:
        """Entries in the vocabulary, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's post-processing (e.g. BOS)."""
        return list(self._tok.encode(text).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped."""
        return str(self._tok.decode([int(t) for t in token_ids], skip_special_tokens=True))


def load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """The tokenizer for a model: ``tokenizer.json`` in ``path``, bytes for the tiny model.

    ``path=None`` means the built-in tiny model; a directory without ``tokenizer.json``
    has no tokenizer (``None``), and then only token-id prompts work.
    """
    if path is None:
        return ByteTokenizer()
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    return HFTokenizer(file)
