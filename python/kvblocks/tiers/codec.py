"""The self-checking record a tier stores for one block: header + payload (+ MAC).

Header (little-endian), then the block hash, then the payload, then the MAC if any::

    magic      4 bytes  b"KVBT"
    version    u16      FORMAT_VERSION
    hash_len   u16      length of the block hash that follows the fixed header
    mac_len    u16      length of the MAC after the payload: 0, or MAC_SIZE with a key
    fingerprint 16 bytes KVLayout.fingerprint
    length     u64      payload bytes
    checksum   u32      CRC-32 of the fixed header (checksum field zeroed), the hash and the payload
    block hash hash_len bytes
    payload    length bytes
    MAC        mac_len bytes: keyed BLAKE3 of everything before it (:mod:`kvblocks.tiers.mac`)

:func:`decode_block` checks every field against what the reader expects (its layout's
fingerprint and payload size, the hash it asked for) and the checksum over everything, so a
short, torn, bit-flipped, misplaced or foreign value is rejected and never loaded. The CRC
catches damage, not a writer; a reader with a key also rejects every record without a valid
MAC (:class:`~kvblocks.tiers.errors.UnauthenticatedBlockError`), so that only holders of the
key can write what it loads.
"""

from __future__ import annotations

import struct
import zlib

import torch

from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.tiers.errors import CorruptBlockError, UnauthenticatedBlockError
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.mac import MAC_SIZE, RecordKey

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
    "payload_offset",
    "record_nbytes",
]

MAGIC = b"KVBT"
#: 2: a MAC length field and an optional MAC after the payload.
FORMAT_VERSION = 2
_FIXED = struct.Struct("<4sHHH16sQI")
_CHECKSUM_OFFSET = _FIXED.size - 4

#: What a tier accepts as a block's payload: raw bytes, or a tensor holding exactly the
#: payload's bytes (a uint8 ``[payload_nbytes]`` tensor, or the ``2 * num_layers`` tiles).
Payload = bytes | bytearray | memoryview | torch.Tensor


def check_block_hash(block_hash: object) -> bytes:
    """``block_hash`` as bytes; a TypeError/ValueError for anything else."""
    if isinstance(block_hash, bytearray | memoryview):
        block_hash = bytes(block_hash)
    if not isinstance(block_hash, bytes):
        raise InvalidTypeError(f"a block hash must be bytes, got {type(block_hash).__name__}")
    if not 0 < len(block_hash) <= 0xFFFF:
        raise InvalidArgumentError(f"a block hash must be 1..65535 bytes, got {len(block_hash)}")
    return block_hash


def as_payload_tensor(layout: KVLayout, kv: torch.Tensor) -> torch.Tensor:
    """``kv``'s bytes as a flat uint8 tensor on its own device (a view when contiguous).

    Raises InvalidArgumentError when ``kv`` does not hold exactly ``layout.payload_nbytes``.
    """
    if kv.device.type == "meta":
        # Checked here, before a tier takes a slot: copying it would fail half-way.
        raise InvalidArgumentError("a payload must hold data, got a meta tensor")
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
        raise InvalidTypeError(
            f"a payload must be bytes or a torch.Tensor, got {type(kv).__name__}"
        )
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


def record_nbytes(layout: KVLayout, block_hash: bytes, key: RecordKey | None = None) -> int:
    """Bytes of the stored record of one block (written with ``key``, if any)."""
    return payload_offset(block_hash) + layout.payload_nbytes + (MAC_SIZE if key else 0)


def payload_offset(block_hash: bytes) -> int:
    """Where the payload starts in a record of ``block_hash``."""
    return _FIXED.size + len(block_hash)


def _checksum(fixed: bytes, block_hash: bytes, payload: memoryview | bytes) -> int:
    zeroed = fixed[:_CHECKSUM_OFFSET] + b"\0\0\0\0"
    return zlib.crc32(payload, zlib.crc32(block_hash, zlib.crc32(zeroed)))


def _check_layout_and_key(layout: object, key: object) -> None:
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if key is not None and not isinstance(key, RecordKey):
        raise InvalidTypeError(f"key must be a RecordKey or None, got {type(key).__name__}")


def encode_block(
    layout: KVLayout, block_hash: bytes, kv: Payload, key: RecordKey | None = None
) -> bytes:
    """The record (header, hash, payload, and a MAC when ``key`` is given) of one block,
    as one bytes object."""
    _check_layout_and_key(layout, key)
    block_hash = check_block_hash(block_hash)
    payload = as_payload_view(layout, kv)
    mac_len = MAC_SIZE if key is not None else 0
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(block_hash), mac_len, layout.fingerprint, payload.nbytes, 0
    )
    crc = _checksum(fixed, block_hash, payload)
    fixed = fixed[:_CHECKSUM_OFFSET] + struct.pack("<I", crc)
    parts: list[bytes | memoryview] = [fixed, block_hash, payload]
    if key is not None:
        parts.append(key.mac(fixed, block_hash, payload))
    return b"".join(parts)


def decode_block(
    layout: KVLayout,
    block_hash: bytes,
    record: bytes | bytearray | memoryview,
    key: RecordKey | None = None,
) -> memoryview:
    """The payload of ``record`` after checking it is ``block_hash``'s block for ``layout``
    (and, with ``key``, that a holder of the key wrote it).

    Raises CorruptBlockError naming the first check that failed; its subclass
    UnauthenticatedBlockError when ``key`` is given and the record carries no MAC or a
    wrong one (checked before anything else the record claims).
    """
    _check_layout_and_key(layout, key)
    block_hash = check_block_hash(block_hash)
    if not isinstance(record, bytes | bytearray | memoryview):
        raise InvalidTypeError(f"a record must be bytes, got {type(record).__name__}")
    view = memoryview(record).cast("B")
    if view.nbytes < _FIXED.size:
        raise CorruptBlockError(f"record is {view.nbytes} bytes, shorter than its header")
    fixed = bytes(view[: _FIXED.size])
    magic, version, hash_len, mac_len, fingerprint, length, crc = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    end = _FIXED.size + hash_len + length
    if view.nbytes != end + mac_len:
        raise CorruptBlockError(f"record is {view.nbytes} bytes, header says {end + mac_len}")
    stored_hash = bytes(view[_FIXED.size : _FIXED.size + hash_len])
    payload = view[_FIXED.size + hash_len : end]
    if key is not None:
        if mac_len != MAC_SIZE:
            raise UnauthenticatedBlockError("record carries no MAC; this tier has a key")
        if not key.verify(bytes(view[end:]), fixed, stored_hash, payload):
            raise UnauthenticatedBlockError("MAC mismatch: not written with this tier's key")
    if fingerprint != layout.fingerprint:
        raise CorruptBlockError("record was made for another model or cache layout")
    if length != layout.payload_nbytes:
        raise CorruptBlockError(f"payload length {length}, expected {layout.payload_nbytes}")
    if stored_hash != block_hash:
        raise CorruptBlockError("record holds another block hash")
    if _checksum(fixed, stored_hash, payload) != crc:
        raise CorruptBlockError("checksum mismatch")
    return payload
