"""The stored record: what it holds and every way a bad one is rejected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvblocks.errors import InvalidArgumentError, KVBlocksError
from kvblocks.tiers import CorruptBlockError, KVLayout, decode_block, encode_block
from kvblocks.tiers.codec import MAGIC, record_nbytes
from tiers.helpers import block_hash, digest_of, random_payload


def test_round_trip_is_bit_exact(layout: KVLayout) -> None:
    payload = random_payload(layout, 1)
    record = encode_block(layout, block_hash(1), payload)
    assert len(record) == record_nbytes(layout, block_hash(1))
    assert record.startswith(MAGIC)
    out = decode_block(layout, block_hash(1), record)
    assert bytes(out) == payload.numpy().tobytes()


def test_payload_may_be_bytes_or_typed_tiles(layout: KVLayout) -> None:
    tiles = torch.randn(2 * layout.num_layers, *layout.tile_shape).to(layout.dtype)
    from_tiles = encode_block(layout, block_hash(2), tiles)
    from_bytes = encode_block(layout, block_hash(2), tiles.view(torch.uint8).numpy().tobytes())
    assert from_tiles == from_bytes


def test_fingerprint_names_model_and_every_layout_field(layout: KVLayout) -> None:
    w = layout.weights_digest
    others = [
        KVLayout(3, 2, 16, 64, torch.float16, "test-model", w),
        KVLayout(2, 4, 16, 64, torch.float16, "test-model", w),
        KVLayout(2, 2, 32, 64, torch.float16, "test-model", w),
        KVLayout(2, 2, 16, 128, torch.float16, "test-model", w),
        KVLayout(2, 2, 16, 64, torch.bfloat16, "test-model", w),
        KVLayout(2, 2, 16, 64, torch.float16, "other-model", w),
        KVLayout(2, 2, 16, 64, torch.float16, "test-model", digest_of("other weights")),
        KVLayout(2, 2, 16, 64, torch.float16, "test-model"),
        KVLayout(2, 2, 16, 64, torch.float16, "test-model", trust_model_id=True),
    ]
    prints = {layout.fingerprint} | {o.fingerprint for o in others}
    assert len(prints) == 1 + len(others)
    assert KVLayout(2, 2, 16, 64, torch.float16, "test-model", w).fingerprint == layout.fingerprint


def _flip(record: bytes, index: int) -> bytes:
    data = bytearray(record)
    data[index] ^= 0x01
    return bytes(data)


@pytest.mark.parametrize(
    "damage",
    ["empty", "short header", "truncated payload", "extra byte", "payload bit", "hash bit",
     "length field", "magic", "version", "checksum field"],
)  # fmt: skip
def test_damaged_records_are_rejected(layout: KVLayout, damage: str) -> None:
    record = encode_block(layout, block_hash(3), random_payload(layout, 3))
    damaged = {
        "empty": b"",
        "short header": record[:20],
        "truncated payload": record[:-1],
        "extra byte": record + b"\0",
        "payload bit": _flip(record, len(record) - 100),
        "hash bit": _flip(record, 40),
        "length field": record[:24] + struct.pack("<Q", 1) + record[32:],
        "magic": b"XXXX" + record[4:],
        "version": record[:4] + struct.pack("<H", 99) + record[6:],
        "checksum field": _flip(record, 33),
    }[damage]
    with pytest.raises(CorruptBlockError):
        decode_block(layout, block_hash(3), damaged)
    assert issubclass(CorruptBlockError, KVBlocksError)


def test_wrong_fingerprint_and_wrong_block_are_rejected(layout: KVLayout) -> None:
    payload = random_payload(layout, 4)
    other_model = KVLayout(2, 2, 16, 64, torch.float16, model_id="another-model")
    foreign = encode_block(other_model, block_hash(4), payload)
    with pytest.raises(CorruptBlockError, match="another model"):
        decode_block(layout, block_hash(4), foreign)
    misplaced = encode_block(layout, block_hash(5), payload)
    with pytest.raises(CorruptBlockError, match="another block"):
        decode_block(layout, block_hash(4), misplaced)


def test_bad_arguments_raise(layout: KVLayout) -> None:
    with pytest.raises(InvalidArgumentError):
        encode_block(layout, block_hash(1), b"\0" * (layout.payload_nbytes - 1))
    with pytest.raises(TypeError):
        encode_block(layout, "not bytes", b"\0" * layout.payload_nbytes)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        encode_block(layout, b"", b"\0" * layout.payload_nbytes)
    with pytest.raises(TypeError):
        encode_block(layout, block_hash(1), [0] * layout.payload_nbytes)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        KVLayout(0, 2, 16, 64, torch.float16)


def test_arguments_of_the_wrong_kind_are_refused(layout: KVLayout) -> None:
    # Each was an AttributeError, TypeError or NumPy's ValueError from inside.
    payload = b"\0" * layout.payload_nbytes
    record = encode_block(layout, block_hash(1), payload)
    calls = [
        lambda: encode_block("layout", block_hash(1), payload),  # type: ignore[arg-type]
        lambda: encode_block(layout, block_hash(1), payload, "key"),  # type: ignore[arg-type]
        lambda: decode_block(None, block_hash(1), record),  # type: ignore[arg-type]
        lambda: decode_block(layout, np.zeros(2), record),  # type: ignore[arg-type]
        lambda: decode_block(layout, block_hash(1), "record"),  # type: ignore[arg-type]
        lambda: decode_block(layout, block_hash(1), record, b"key"),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()
