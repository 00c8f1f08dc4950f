"""The key that authenticates tier records: a keyed BLAKE3 MAC over each whole record.

A record's CRC-32 catches corruption, not a writer: anyone who can write to a shared store
can put a record with a valid CRC (a payload of zeros, another model's KV) under any block
hash, and every instance reading that hash loads it. With a key, each record carries a
32-byte MAC (keyed BLAKE3 over its header, block hash and payload, under a key derived from
the secret), and a reader with the key rejects any record without a valid one: only key
holders can write what key holders load. The key never appears in a repr, a log line or an
error message.

The secret comes from the tier's ``mac_key`` argument, else from the environment variable
:data:`KEY_ENV` (``KVBLOCKS_TIER_KEY``); give every instance that shares the store the same
one (at least 32 random bytes, e.g. ``openssl rand -hex 32``).
"""

from __future__ import annotations

import hmac
import os
from typing import NoReturn

import numpy as np

from kvblocks._core import Blake3, blake3_derive_key
from kvblocks.errors import InvalidArgumentError

__all__ = ["KEY_ENV", "MAC_SIZE", "RecordKey", "resolve_key"]

#: Environment variable holding the secret of the tiers' record MAC.
KEY_ENV = "KVBLOCKS_TIER_KEY"
#: Bytes of a record MAC.
MAC_SIZE = 32
# Names this use of the secret: the same secret used elsewhere gives an unrelated key.
_CONTEXT = "kvblocks tier record MAC v1"


class RecordKey:
    """A secret that signs and checks tier records (its bytes are never shown).

    Args:
        secret: the shared secret, ``bytes`` or a ``str`` (UTF-8), not empty.
    """

    __slots__ = ("_key",)

    def __init__(self, secret: bytes | str) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, bytes):
            raise InvalidArgumentError(
                f"a tier MAC key must be bytes or str, got {type(secret).__name__}"
            )
        if not secret:
            raise InvalidArgumentError("a tier MAC key must not be empty")
        self._key = blake3_derive_key(_CONTEXT, secret)

    def mac(self, *parts: bytes | memoryview) -> bytes:
        """The MAC of the concatenation of ``parts``."""
        hasher = Blake3(self._key)
        for part in parts:
            # A memoryview (a record's payload) is hashed in place.
            hasher.update(part if isinstance(part, bytes) else np.frombuffer(part, np.uint8))
        return hasher.digest(MAC_SIZE)

    def verify(self, mac: bytes, *parts: bytes | memoryview) -> bool:
        """Whether ``mac`` is the MAC of ``parts`` (compared in constant time)."""
        return hmac.compare_digest(mac, self.mac(*parts))

    def __repr__(self) -> str:
        return "RecordKey(<secret>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a RecordKey is not pickled (it would carry the secret)")


def resolve_key(mac_key: RecordKey | bytes | str | None) -> RecordKey | None:
    """The key a tier uses: ``mac_key``, else the secret in :data:`KEY_ENV` when set and not
    empty, else None (records are written and read without a MAC)."""
    if isinstance(mac_key, RecordKey):
        return mac_key
    if mac_key is not None:
        return RecordKey(mac_key)
    secret = os.environ.get(KEY_ENV)
    return RecordKey(secret) if secret else None
