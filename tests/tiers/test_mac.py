"""A keyed MAC on every tier record: a writer without the key cannot plant KV.

The forgery of issue 16: a value re-encoded with a valid CRC-32 (here an all-zero payload
under a real block's key) passes every check but the MAC. With a key, it is rejected,
counted (``rejected`` and ``unauthenticated``) and never loaded, on a real Valkey server and
on disk; without a key it is loaded, which is the documented trust boundary.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers import DiskTier, KVLayout, RecordKey, UnauthenticatedBlockError
from kvblocks.tiers.codec import decode_block, encode_block, record_nbytes
from kvblocks.tiers.errors import CorruptBlockError
from kvblocks.tiers.mac import KEY_ENV, MAC_SIZE, resolve_key
from tiers.helpers import block_hash, random_payload
from tiers.valkey_server import ServerProcess

SECRET = "correct horse battery staple, 32+ bytes of it"


def _forged(layout: KVLayout, i: int) -> bytes:
    """A record with a valid CRC and an all-zero payload, as anyone can write."""
    return encode_block(
        layout, block_hash(i), torch.zeros(layout.payload_nbytes, dtype=torch.uint8)
    )


def test_a_keyed_record_round_trips_and_a_forged_one_is_refused(layout: KVLayout) -> None:
    key = RecordKey(SECRET)
    payload = random_payload(layout, 0)
    record = encode_block(layout, block_hash(0), payload, key)
    assert len(record) == record_nbytes(layout, block_hash(0), key)
    assert len(record) == record_nbytes(layout, block_hash(0)) + MAC_SIZE
    got = decode_block(layout, block_hash(0), record, key)
    assert bytes(got) == payload.numpy().tobytes()
    # A reader without a key reads a signed record (it checks the CRC only).
    assert bytes(decode_block(layout, block_hash(0), record)) == bytes(got)
    forged = _forged(layout, 0)
    decode_block(layout, block_hash(0), forged)  # a valid record: only the key tells
    other_key = encode_block(layout, block_hash(0), payload, RecordKey(SECRET + "!"))
    flipped = bytearray(record)
    flipped[-MAC_SIZE - 1] ^= 1  # a payload byte; the MAC no longer matches
    stripped = bytearray(record[:-MAC_SIZE])
    for bad, why in [
        (forged, "no MAC"),
        (other_key, "MAC mismatch"),
        (bytes(flipped), "MAC mismatch"),
        (bytes(stripped), "header says"),  # the header still claims a MAC
    ]:
        with pytest.raises(CorruptBlockError, match=why):
            decode_block(layout, block_hash(0), bad, key)
    with pytest.raises(UnauthenticatedBlockError):
        decode_block(layout, block_hash(0), forged, key)


def test_the_key_is_never_shown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = RecordKey(SECRET)
    assert SECRET not in repr(key) and "correct" not in str(key)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(key)
    for bad in ("", b"", 7):
        with pytest.raises(InvalidArgumentError, match="key"):
            RecordKey(bad)  # type: ignore[arg-type]
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert resolve_key(None) is None
    monkeypatch.setenv(KEY_ENV, SECRET)
    from_env = resolve_key(None)
    assert from_env is not None and from_env.mac(b"x") == key.mac(b"x")
    assert resolve_key(b"other").mac(b"x") != key.mac(b"x")  # type: ignore[union-attr]


def test_valkey_rejects_and_counts_a_forged_record(
    valkey_server: ServerProcess, layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    from kvblocks.tiers import ValkeyTier

    writer = ValkeyTier(layout, port=valkey_server.port, mac_key=SECRET)
    reader = ValkeyTier(layout, port=valkey_server.port, mac_key=SECRET)
    keyless = ValkeyTier(layout, port=valkey_server.port)
    hashes = [block_hash(i) for i in range(3)]
    assert writer.put_many(hashes, [random_payload(layout, i) for i in range(3)]) == 3
    # The forger can write to the server but has no key.
    keyless.client.set(keyless.key_of(hashes[1]), _forged(layout, 1))
    keyless.put(block_hash(5), random_payload(layout, 5))  # an unsigned put, same thing
    with caplog.at_level(logging.DEBUG):
        got = reader.get_many([*hashes, block_hash(5)])
    assert got[1] is None and got[3] is None
    assert torch.equal(got[0], random_payload(layout, 0))  # type: ignore[arg-type]
    assert torch.equal(got[2], random_payload(layout, 2))  # type: ignore[arg-type]
    stats = reader.stats()
    assert (stats.hits, stats.rejected, stats.unauthenticated) == (2, 2, 2)
    assert SECRET not in caplog.text and "correct horse" not in caplog.text
    assert SECRET not in repr(reader) and SECRET not in repr(vars(reader))
    # The trust boundary: a reader without the key loads the forgery.
    zeros = keyless.get_many([hashes[1]])[0]
    assert zeros is not None and not zeros.any()


def test_the_disk_tier_rejects_counts_and_removes_a_forged_record(
    tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)  # the key from the environment
    signed = DiskTier(tmp_path, layout, 16)
    signed.put_many(
        [block_hash(i) for i in range(2)], [random_payload(layout, i) for i in range(2)]
    )
    path = signed.path_of(block_hash(1))
    path.write_bytes(_forged(layout, 1))
    signed.close()
    reader = DiskTier(tmp_path, layout, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = reader.get_many([block_hash(0), block_hash(1)])
    assert got[0] is not None and torch.equal(got[0], random_payload(layout, 0))
    assert got[1] is None and not path.exists()
    stats = reader.stats()
    assert (stats.rejected, stats.unauthenticated) == (1, 1)
    assert all(SECRET not in str(w.message) for w in caught)
    # Without the key the records still read (their MACs are not checked).
    monkeypatch.delenv(KEY_ENV)
    assert DiskTier(tmp_path, layout, 16).get_many([block_hash(0)])[0] is not None
