"""LoRA fields of ``BlockStored`` on the ZMQ wire: ``lora_id``, ``lora_name`` and vLLM's
``extra_keys`` (untagged, as vLLM 0.33's ``to_event_extra_keys`` publishes them), decoded
by a real subscriber with vLLM's structs. A router that knows the adapters' paths
recomputes vLLM's block hash from the event (vLLM hashes ``("lora", name, path)`` and
``("cache_salt", salt)``, and publishes the bare name and salt)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np
import vllm_array_structs as legacy
import vllm_structs as vllm
from zmq_helpers import Subscriber, publish_one

from kvblocks import KVCacheManager
from kvblocks.events import ZmqEventPublisher
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import ModelStepResult, Request, Scheduler

DECODE = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
ANY_PORT = "tcp://127.0.0.1:*"
BLOCK = 4
LORA = ("lora", "sql-adapter", "/adapters/sql")


def cbor(x: Any) -> bytes:
    """Canonical CBOR of what vLLM's block hash encodes (ints, text, bytes, None, tuples)."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * size):
                return bytes([major << 5 | code]) + n.to_bytes(size, "big")
        raise ValueError(n)

    if x is None:
        return b"\xf6"
    if isinstance(x, int):
        return head(0, x)
    if isinstance(x, bytes):
        return head(2, len(x)) + x
    if isinstance(x, str):
        raw = x.encode()
        return head(3, len(raw)) + raw
    if isinstance(x, (list, tuple)):
        return head(4, len(x)) + b"".join(cbor(e) for e in x)
    raise TypeError(type(x))


def vllm_hash(parent: bytes, tokens: list[int], extra: Any) -> bytes:
    return hashlib.sha256(cbor((parent, tuple(tokens), extra))).digest()


def as_keys(entry: Any) -> Any:
    """A decoded ``extra_keys`` entry as a tuple."""
    return None if entry is None else tuple(entry)


def hash_keys(entry: Any, first: bool, lora_paths: dict[str, str]) -> Any:
    """The tagged keys vLLM hashed a block with, rebuilt from its untagged event entry:
    the LoRA's name (its path known to the router), then the salt on the chain's first
    block."""
    if entry is None:
        return None
    name, *salt = entry
    keys: list[tuple[str, ...]] = [("lora", name, lora_paths[name])]
    if first:
        keys += [("cache_salt", s) for s in salt]
    else:
        assert not salt, "the salt keys the chain's first block only"
    return tuple(keys)


def run_request(manager: KVCacheManager, pub: ZmqEventPublisher, request: Request) -> None:
    sched = Scheduler(manager, event_publisher=pub)
    sched.add_request(request)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        n = int(out.sample_counts.sum())
        sched.update(out, ModelStepResult(np.full(n, 3), np.zeros(n, np.float32)))
    assert pub.flush()


def received(sub: Subscriber) -> list[Any]:
    events: list[Any] = []
    while (got := sub.recv(timeout_ms=300)) is not None:
        events.extend(DECODE.decode(got[2]).events)
    return events


def test_lora_name_and_extra_keys_reach_the_wire_and_rebuild_vllm_hashes() -> None:
    m = KVCacheManager(32, BLOCK, hash_algo="sha256_cbor", record_events=True, watermark=0.0)
    m.register_lora(7, LORA[1], LORA[2])
    prompt = list(range(1, 12))  # two full prompt blocks
    with ZmqEventPublisher(ANY_PORT, topic="kv", hash_format="bytes") as pub:
        sub = Subscriber(pub)
        try:
            sub.sync(pub)
            run_request(
                m,
                pub,
                Request("r", prompt, SamplingParams(max_tokens=6), cache_salt="t1", lora_id=7),
            )
            events = received(sub)
        finally:
            sub.close()
    stored = [e for e in events if isinstance(e, vllm.BlockStored)]
    assert stored, "no BlockStored reached the subscriber"
    assert all((e.lora_id, e.lora_name) == (7, "sql-adapter") for e in stored)
    none_hash = m.none_hash
    assert none_hash is not None
    n_blocks = 0
    parent: bytes = none_hash
    for ev in stored:
        assert ev.extra_keys is not None and len(ev.extra_keys) == len(ev.block_hashes)
        if ev.parent_block_hash is not None:
            parent = ev.parent_block_hash  # type: ignore[assignment]
        for i, h in enumerate(ev.block_hashes):
            first = n_blocks == 0
            assert as_keys(ev.extra_keys[i]) == ((LORA[1], "t1") if first else (LORA[1],))
            keys = hash_keys(ev.extra_keys[i], first, {LORA[1]: LORA[2]})
            tokens = ev.token_ids[i * BLOCK : (i + 1) * BLOCK]
            assert vllm_hash(parent, tokens, keys) == h, f"block {n_blocks}"
            parent = h  # type: ignore[assignment]
            n_blocks += 1
    assert n_blocks >= 3  # prompt blocks and the generated ones


def test_sequences_without_lora_send_none_and_arrays_carry_the_name() -> None:
    m = KVCacheManager(32, BLOCK, hash_algo="sha256_cbor", record_events=True, watermark=0.0)
    m.register_lora(2, "chat")
    m.add_sequence(0, list(range(9)))
    m.allocate_slots(0, 9)
    m.commit(0, 9)
    m.add_sequence(1, list(range(100, 109)), lora_id=2)
    m.allocate_slots(1, 9)
    m.commit(1, 9)
    events = m.take_events()
    with ZmqEventPublisher(ANY_PORT) as pub:
        got = publish_one(pub, events)
    assert got is not None
    plain, lora = DECODE.decode(got[2]).events
    assert (plain.lora_id, plain.lora_name, plain.extra_keys) == (None, None, [None, None])
    assert (lora.lora_id, lora.lora_name) == (2, "chat")
    assert [as_keys(k) for k in lora.extra_keys] == [("chat",)] * 2
    raw = msgspec.msgpack.decode(got[2])[1][1]
    assert raw["lora_name"] == "chat" and raw["extra_keys"][0] == ["chat"]

    with ZmqEventPublisher(ANY_PORT, wire_format="array") as pub:
        got = publish_one(pub, events)
    assert got is not None
    # Old subscribers decode the positional form (they skip the trailing lora_name).
    old = msgspec.msgpack.Decoder(type=legacy.KVEventBatch).decode(got[2])
    assert [e.lora_id for e in old.events] == [None, 2]
    assert msgspec.msgpack.decode(got[2])[1][1][7] == "chat"
