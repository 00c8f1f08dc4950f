"""Tokenizers: bytes for the tiny model, tokenizer.json through the tokenizers library."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvblocks.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kvblocks.errors import InvalidArgumentError


def write_word_tokenizer(path: Path, words: list[str]) -> Path:
    """A whitespace word-level tokenizer.json with ``<unk>`` = 0 (test helper)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    file = path / "tokenizer.json"
    tok.save(str(file))
    return file


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode())
    assert tok.decode(ids) == "héllo"
    assert tok.decode([0xFF, 65]) == "\ufffdA"


def test_hf_tokenizer_from_directory(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path, ["the", "cat", "sat"])
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("the cat sat") == [1, 2, 3]
    assert tok.decode([3, 2]) == "sat cat"
    assert tok.vocab_size == 4


def test_no_tokenizer_json_means_no_tokenizer(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_corrupt_tokenizer_json_raises(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path)
