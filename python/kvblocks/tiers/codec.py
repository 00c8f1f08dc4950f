"""The self-checking record a tier stores for one block: header + payload.

Header (little-endian), then the block hash, then the payload::

    magic      4 bytes  b"KVBT"
    version    u16      FORMAT_VERSION
    hash_len   u16      length of the block hash that follows the fixed header
    fingerprint 16 bytes KVLayout.fingerprint
    length     u64      payload bytes
    checksum   u32      CRC-32 of the fixed header (checksum field zeroed), the hash and the payload
    block hash hash_len bytes

:func:`decode_block` checks every field against what the reader expects (its layout's
fingerprint and payload size, the hash it asked for) and the checksum over everything, so a
short, torn, bit-flipped, misplaced or foreign value is rejected and never loaded.
"""

from __future__ import annotations

import struct
import zlib

import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers.errors import CorruptBlockError
from kvblocks.tiers.layout import KVLayout

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Payload",
    "as_payload_tensor",
    "as_payload_view",
    "check_block_hash",
    "check_payload",
    "decode_block",
    "encode_block",
    "record_nbytes",
]

MAGIC = b"KVBT"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHH16sQI")
_CHECKSUM_OFFSET = _FIXED.size - 4

#: What a tier accepts as a block's payload: raw bytes, or a tensor holding exactly the
#: payload's bytes (a uint8 ``[payload_nbytes]`` tensor, or the ``2 * num_layers`` tiles).
Payload = bytes | bytearray | memoryview | torch.Tensor


def check_block_hash(block_hash: object) -> bytes:
    """``block_hash`` as bytes; a TypeError/ValueError for anything else."""
    if isinstance(block_hash, bytearray | memoryview):
        block_hash = bytes(block_hash)
    if not isinstance(block_hash, bytes):
        raise TypeError(f"a block hash must be bytes, got {type(block_hash).__name__}")
    if not 0 < len(block_hash) <= 0xFFFF:
        raise InvalidArgumentError(f"a block hash must be 1..65535 bytes, got {len(block_hash)}")
    return block_hash


def as_payload_tensor(layout: KVLayout, kv: torch.Tensor) -> torch.Tensor:
    """``kv``'s bytes as a flat uint8 tensor on its own device (a view when contiguous).

    Raises InvalidArgumentError when ``kv`` does not hold exactly ``layout.payload_nbytes``.
    """
    flat = kv.detach().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    if flat.numel() != layout.payload_nbytes:
        raise InvalidArgumentError(
            f"a payload for this layout is {layout.payload_nbytes} bytes, got {flat.numel()}"
        )
    return flat


def as_payload_view(layout: KVLayout, kv: Payload) -> memoryview:
    """A flat byte view of ``kv`` (copied to the CPU if it is a device tensor).

    Raises InvalidArgumentError when ``kv`` does not hold exactly ``layout.payload_nbytes``.
    """
    if isinstance(kv, torch.Tensor):
        return memoryview(as_payload_tensor(layout, kv).cpu().numpy().data).cast("B")
    elif isinstance(kv, bytes | bytearray | memoryview):
        view = memoryview(kv).cast("B")
    else:
        raise TypeError(f"a payload must be bytes or a torch.Tensor, got {type(kv).__name__}")
    if view.nbytes != layout.payload_nbytes:
        raise InvalidArgumentError(
            f"a payload for this layout is {layout.payload_nbytes} bytes, got {view.nbytes}"
        )
    return view


def check_payload(layout: KVLayout, kv: Payload) -> None:
    """Raise as :func:`as_payload_view` would, without copying a device tensor's bytes."""
    if isinstance(kv, torch.Tensor):
        as_payload_tensor(layout, kv)
    else:
        as_payload_view(layout, kv)


def record_nbytes(layout: KVLayout, block_hash: bytes) -> int:
    """Bytes of the stored record of one block."""
    return _FIXED.size + len(block_hash) + layout.payload_nbytes


def _checksum(fixed: bytes, block_hash: bytes, payload: memoryview | bytes) -> int:
    zeroed = fixed[:_CHECKSUM_OFFSET] + b"\0\0\0\0"
    return zlib.crc32(payload, zlib.crc32(block_hash, zlib.crc32(zeroed)))


def encode_block(layout: KVLayout, block_hash: bytes, kv: Payload) -> bytes:
    """The record (header, hash, payload) of one block, as one bytes object."""
    block_hash = check_block_hash(block_hash)
    payload = as_payload_view(layout, kv)
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(block_hash), layout.fingerprint, payload.nbytes, 0
    )
    crc = _checksum(fixed, block_hash, payload)
    return b"".join((fixed[:_CHECKSUM_OFFSET], struct.pack("<I", crc), block_hash, payload))


def decode_block(
    layout: KVLayout, block_hash: bytes, record: bytes | bytearray | memoryview
) -> memoryview:
    """The payload of ``record`` after checking it is ``block_hash``'s block for ``layout``.

    Raises CorruptBlockError naming the first check that failed.
    """
    view = memoryview(record).cast("B")
    if view.nbytes < _FIXED.size:
        raise CorruptBlockError(f"record is {view.nbytes} bytes, shorter than its header")
    fixed = bytes(view[: _FIXED.size])
    magic, version, hash_len, fingerprint, length, crc = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if fingerprint != layout.fingerprint:
        raise CorruptBlockError("record was made for another model or cache layout")
    if length != layout.payload_nbytes:
        raise CorruptBlockError(f"payload length {length}, expected {layout.payload_nbytes}")
    if view.nbytes != _FIXED.size + hash_len + length:
        raise CorruptBlockError(
            f"record is {view.nbytes} bytes, header says {_FIXED.size + hash_len + length}"
        )
    stored_hash = bytes(view[_FIXED.size : _FIXED.size + hash_len])
    if stored_hash != block_hash:
        raise CorruptBlockError("record holds another block hash")
    payload = view[_FIXED.size + hash_len :]
    if _checksum(fixed, stored_hash, payload) != crc:
        raise CorruptBlockError("checksum mismatch")
    return payload
