"""Text <-> token ids: an HF ``tokenizer.json`` through ``tokenizers``, or raw bytes.

Token-id prompts never need a tokenizer. A checkpoint directory with a
``tokenizer.json`` gets :class:`HFTokenizer`; the built-in tiny model, whose vocabulary
is exactly 256 entries, gets :class:`ByteTokenizer` (UTF-8 bytes as token ids).

Streaming needs text as tokens arrive: :class:`IncrementalDetokenizer` turns one
sequence's tokens into text pieces, through the tokenizer's own ``decode_stream()`` (the
``tokenizers`` ``DecodeStream``; an incremental UTF-8 decoder for bytes) or, for any other
tokenizer, by decoding a short window of recent tokens and emitting what grew.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from kvblocks.errors import InvalidArgumentError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
]


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

    def decode_stream(self) -> Callable[[int], str]:
        """A function that takes the next token and returns the text it completes."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda token: decoder.decode(bytes([token])) if 0 <= token < 256 else ""


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

    def decode_stream(self) -> Callable[[int], str] | None:
        """``tokenizers``' ``DecodeStream`` as a function of the next token (``None`` if
        the installed ``tokenizers`` has none)."""
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # pragma: no cover - tokenizers < 0.21
            return None
        stream = DecodeStream(skip_special_tokens=True)
        tok = self._tok
        return lambda token: stream.step(tok, int(token)) or ""


class IncrementalDetokenizer:
    """Text of one sequence, piece by piece as its tokens arrive.

    Uses the tokenizer's ``decode_stream()`` when it has one. Otherwise it decodes the
    tokens from a recent offset and emits the text beyond what was emitted, holding back
    a trailing U+FFFD (an incomplete multi-byte character) until a later token completes
    it; :meth:`flush` emits what is held back at the end.
    """

    _WINDOW = 6  # tokens of context decoded before the new ones (for merges, spaces)

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        make = getattr(tokenizer, "decode_stream", None)
        self._stream: Callable[[int], str] | None = make() if callable(make) else None
        self._tokens: list[int] = []
        self._prefix = 0  # tokens before it are not re-decoded
        self._read = 0  # text of tokens[prefix:read] has been emitted

    def step(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text they complete (possibly empty)."""
        if self._stream is not None:
            return "".join(self._stream(int(t)) for t in token_ids)
        self._tokens.extend(int(t) for t in token_ids)
        decode = self.tokenizer.decode
        emitted = decode(self._tokens[self._prefix : self._read])
        full = decode(self._tokens[self._prefix :])
        if len(full) <= len(emitted) or full.endswith("\ufffd"):
            return ""
        new = full[len(emitted) :]
        self._read = len(self._tokens)
        self._prefix = max(0, self._read - self._WINDOW)
        return new

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end)."""
        if self._stream is not None or self._read == len(self._tokens):
            return ""
        decode = self.tokenizer.decode
        emitted = decode(self._tokens[self._prefix : self._read])
        full = decode(self._tokens[self._prefix :])
        self._read = len(self._tokens)
        return full[len(emitted) :] if full.startswith(emitted) else ""


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
