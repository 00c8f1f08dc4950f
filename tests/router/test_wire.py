"""vLLM-format KV events, through a real ZMQ socket on 127.0.0.1, feed the prefix index."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvblocks import KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.router import (
    AllBlocksClearedRecord,
    BlockRemovedRecord,
    BlockStoredRecord,
    CacheAwareRouter,
    PromptHasher,
    records_from_wire,
)

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
events_mod = pytest.importorskip("kvblocks.events")


def _subscribe(pub: object) -> object:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(pub.endpoint)  # type: ignore[attr-defined]
    # PUB drops messages until the subscription has propagated: probe until one arrives.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish([events_mod.AllBlocksCleared()])  # type: ignore[attr-defined]
        if sub.poll(50):
            while sub.poll(100):
                sub.recv_multipart()
            return sub
    raise AssertionError("the subscription never reached the publisher")


def _receive_records(sub: object, instance: int) -> list[object]:
    assert sub.poll(5000)  # type: ignore[attr-defined]
    _topic, _seq, payload = sub.recv_multipart()  # type: ignore[attr-defined]
    _ts, events, _rank = msgspec.msgpack.decode(payload)
    return records_from_wire(instance, events)


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_a_subscribers_stream_routes_to_the_instance_holding_the_prefix(
    hash_format: str, wire_format: str
) -> None:
    bs = 16
    prompt = np.arange(1, 101)
    manager = KVCacheManager(32, bs)
    router = CacheAwareRouter(3)
    with events_mod.ZmqEventPublisher(
        "tcp://127.0.0.1:*", hash_format=hash_format, wire_format=wire_format
    ) as pub:
        sub = _subscribe(pub)
        manager.add_sequence(1, prompt)
        manager.allocate_slots(1, 100)
        manager.commit(1, 100)
        pub.publish(manager.take_events())
        stored = _receive_records(sub, instance=2)
        router.apply_events(stored)
        hashes = PromptHasher(bs).block_hashes(prompt, hash_format=hash_format)
        assert [type(r) for r in stored] == [BlockStoredRecord]
        assert stored[0].block_hashes == tuple(hashes)  # type: ignore[attr-defined]
        assert router.overlaps(hashes) == [0.0, 0.0, 6.0]
        assert router.route(hashes, 7) == 2
        # Eviction and a reset reach the index through the same stream.
        manager.free(1)
        assert manager.reset_prefix_cache()
        pub.publish(manager.take_events())
        cleared = _receive_records(sub, instance=2)
        assert any(isinstance(r, AllBlocksClearedRecord) for r in cleared)
        router.apply_events(cleared)
        assert router.overlaps(hashes) == [0.0, 0.0, 0.0]
        sub.close(linger=0)  # type: ignore[attr-defined]


def test_decoded_forms_and_bad_events() -> None:
    h = [b"\x01" * 32, b"\x02" * 32]
    as_map = [
        {"type": "BlockStored", "block_hashes": h, "parent_block_hash": None, "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": None},
        {"type": "AllBlocksCleared"},
    ]
    as_array = [
        ["BlockStored", h, None, [1] * 32, 16, None, "CPU", None],
        ["BlockRemoved", [7], None],
        ["AllBlocksCleared"],
    ]
    expected = [
        BlockStoredRecord(4, tuple(h), None, "CPU"),
        BlockRemovedRecord(4, (7,), "GPU"),
        AllBlocksClearedRecord(4),
    ]
    assert records_from_wire(4, as_map) == expected
    # The array form carries the block size (the map above names none).
    expected[0] = dataclasses.replace(expected[0], block_size=16)
    assert records_from_wire(4, as_array) == expected
    for bad in (
        [{"type": "BlockMoved"}],
        [{"type": "BlockRemoved", "block_hashes": "ab"}],
        [{"type": "BlockRemoved", "block_hashes": [1.5]}],
        [{"type": "BlockStored", "block_hashes": [], "parent_block_hash": 2.0}],
        [{"type": "BlockRemoved", "block_hashes": [True]}],
        [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}],
        [object()],
    ):
        with pytest.raises(InvalidArgumentError):
            records_from_wire(0, bad)


@pytest.mark.parametrize("events", [None, 3, 1.5, np.array(3)])
def test_a_batch_whose_events_are_not_a_list_is_refused(events: object) -> None:
    # A decoded KVEventBatch with a null or scalar events field: bare TypeError before.
    with pytest.raises(InvalidArgumentError, match="events"):
        records_from_wire(0, events)  # type: ignore[arg-type]


def test_vllm_0_33_fields_are_accepted_and_the_group_kept() -> None:
    """A vLLM 0.33 stream: stores and removals name their group, stores carry the group's
    spec, untagged extra keys and the offloading/session fields."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": [1] * 8,
        "block_size": 4,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": "my-lora",
        "extra_keys": [["my-lora", "s"], ["my-lora"]],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 8,
        "locality": "LOCAL",
        "ownership": None,
        "session_id": "sess-1",
        "lookahead_token_ids": [[5], [6]],
    }
    removed = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 1,
               "locality": "LOCAL", "ownership": "tier-a"}  # fmt: skip
    assert records_from_wire(3, [stored, removed]) == [
        BlockStoredRecord(3, (11, 12), None, "GPU", 1, "sliding_window", 8, 4),
        BlockRemovedRecord(3, (11,), "GPU", group_idx=1),
    ]
    # Decoded into structs (vLLM's own or kvblocks'): the group is kept too.
    wire = events_mod.wire
    as_structs = [
        wire.BlockStored([11], None, [1] * 4, 4, None, "GPU", None, group_idx=2),
        wire.BlockRemoved([11], "GPU", group_idx=2),
    ]
    assert [r.group_idx for r in records_from_wire(3, as_structs)] == [2, 2]  # type: ignore[union-attr]
    for bad in (-1, True, "0", 1.0):
        with pytest.raises(InvalidArgumentError, match="group_idx"):
            records_from_wire(0, [{**removed, "group_idx": bad}])
    # The group's spec and the block size are type-checked where the record keeps them.
    for name, bad in (
        ("kv_cache_spec_kind", 3),
        ("kv_cache_spec_sliding_window", 0),
        ("kv_cache_spec_sliding_window", "8"),
        ("block_size", -4),
    ):
        with pytest.raises(InvalidArgumentError, match=name):
            records_from_wire(0, [{**stored, name: bad}])


def test_hash_format_int_is_the_digests_low_64_bits() -> None:
    hasher = PromptHasher(8)
    digests = hasher.block_hashes(np.arange(16))
    ints = hasher.block_hashes(np.arange(16), hash_format="int")
    assert ints == [int.from_bytes(d[-8:], "big") for d in digests]  # type: ignore[index]
    with pytest.raises(InvalidArgumentError):
        hasher.block_hashes(np.arange(16), hash_format="hex")


@pytest.mark.parametrize("events", [None, 3, np.array(3)])
def test_event_conversions_refuse_what_is_no_sequence(events: object) -> None:
    # records_from_manager and to_wire_events iterated it: a bare TypeError.
    from kvblocks.router import records_from_manager

    with pytest.raises(InvalidArgumentError, match="events"):
        records_from_manager(0, events)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="events"):
        events_mod.to_wire_events(events)


@pytest.mark.parametrize("name", ["wire_format", "hash_format"])
def test_a_format_that_is_no_str_is_refused(name: str) -> None:
    # An array was NumPy's ambiguous-truth ValueError.
    with pytest.raises(InvalidArgumentError, match=name):
        events_mod.to_wire_events([], **{name: np.array(["map", "int"])})
