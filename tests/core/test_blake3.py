"""``kvblocks._core.Blake3``: the core's BLAKE3, checked against the official test vectors
(BLAKE3-team/BLAKE3 ``test_vectors.json``: input byte i is i % 251, the 32-byte key and the
context string below), for every input form it takes."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks._core import Blake3, blake3_derive_key
from kvblocks.errors import InvalidArgumentError

KEY = b"whats the Elvish word for friend"
CONTEXT = "BLAKE3 2019-12-27 16:29:52 test vectors context"
# Input length 0 of the official vectors: hash, keyed_hash, derive_key.
EMPTY_HASH = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
EMPTY_KEYED = "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26"
EMPTY_DERIVED = "2cc39783c223154fea8dfb7c1b1660f2ac2dcbd1c1de8277b0b0dd39b7e50d7d"
ABC_HASH = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"


def test_the_official_vectors() -> None:
    assert Blake3().digest().hex() == EMPTY_HASH
    assert Blake3(KEY).digest().hex() == EMPTY_KEYED
    assert blake3_derive_key(CONTEXT, b"").hex() == EMPTY_DERIVED
    h = Blake3()
    h.update(b"abc")
    assert h.digest().hex() == ABC_HASH


def test_bytes_arrays_and_pieces_hash_alike() -> None:
    data = (np.arange(300_000) % 251).astype(np.uint8)
    whole = Blake3()
    whole.update(data.tobytes())
    pieces = Blake3()
    for start in range(0, data.size, 7_777):
        pieces.update(data[start : start + 7_777])
    assert whole.digest() == pieces.digest()
    # The output is extendable: a longer digest starts with the standard one.
    assert whole.digest(64)[:32] == whole.digest()
    # A copy continues independently; the original may keep growing.
    fork = whole.copy()
    fork.update(b"x")
    assert fork.digest() != whole.digest()


def test_bad_input_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        Blake3(b"short")
    h = Blake3()
    with pytest.raises(InvalidArgumentError, match="uint8"):
        h.update(np.zeros(4, np.int32))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="uint8"):
        h.update("text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        h.update(np.zeros(8, np.uint8)[::2])
    for length in (0, 1025):
        with pytest.raises(InvalidArgumentError, match="length"):
            h.digest(length)
    assert h.digest().hex() == EMPTY_HASH  # nothing above changed it
