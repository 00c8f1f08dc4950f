"""ZmqEventPublisher against a real SUB/DEALER on 127.0.0.1, decoded with vLLM's structs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import vllm_array_structs as legacy
import vllm_structs as vllm
from zmq_helpers import END_SEQ, Subscriber, publish_one, wait_for

from kvblocks import InvalidArgumentError, InvalidTypeError, KVCacheManager
from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    NullEventPublisher,
    PublisherClosedError,
    ZmqEventPublisher,
)
from kvblocks.events import publisher as publisher_mod

DECODE = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
DECODE_LEGACY = msgspec.msgpack.Decoder(type=legacy.KVEventBatch)
ANY_PORT = "tcp://127.0.0.1:*"


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


@pytest.fixture
def pub() -> Iterator[ZmqEventPublisher]:
    p = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, topic="kv@a@model")
    yield p
    p.close()


def manager_events() -> tuple[list[Any], list[Any], list[Any], list[int]]:
    """Real manager events: a 3-block store in two commits, evictions, a clear."""
    m = KVCacheManager(8, 4, record_events=True)
    tokens = list(range(1, 14))
    m.add_sequence(0, tokens)
    m.allocate_slots(0, 5)
    m.commit(0, 5)
    first = m.take_events()
    m.allocate_slots(0, 8)
    m.commit(0, 8)
    second = m.take_events()
    m.free(0)
    m.add_sequence(1, list(range(50, 80)))
    m.allocate_slots(1, 28)  # evicts the cached blocks
    removed = m.take_events()
    return first, second, removed, tokens


def test_batches_decode_with_vllm_structs(pub: ZmqEventPublisher) -> None:
    first, second, removed, tokens = manager_events()
    sub = Subscriber(pub)
    try:
        seq0 = sub.sync(pub)
        for batch in (first, second, removed):
            pub.publish(batch)
        got = [sub.recv() for _ in range(3)]
    finally:
        sub.close()
    assert all(g is not None for g in got)
    assert [g[0] for g in got] == [b"kv@a@model"] * 3  # type: ignore[index]
    assert [g[1] for g in got] == [seq0, seq0 + 1, seq0 + 2]  # type: ignore[index]
    b1, b2, b3 = (DECODE.decode(g[2]) for g in got)  # type: ignore[index]

    (s1,) = b1.events
    assert isinstance(s1, vllm.BlockStored)
    assert s1.block_hashes == [low64(first[0].block_hashes[0])]
    assert s1.parent_block_hash is None
    assert s1.token_ids == tokens[:4]
    assert (s1.block_size, s1.lora_id, s1.medium, s1.lora_name) == (4, None, "GPU", None)
    assert (s1.group_idx, s1.kv_cache_spec_kind) == (0, "full_attention")
    assert b1.data_parallel_rank == 0

    (s2,) = b2.events
    assert s2.block_hashes == [low64(h) for h in second[0].block_hashes]
    assert len(s2.block_hashes) == 2
    assert s2.parent_block_hash == s1.block_hashes[0]  # the chain a router follows
    assert s2.token_ids == tokens[4:12]

    assert all(isinstance(e, vllm.BlockRemoved) for e in b3.events)
    gone = {h for e in b3.events for h in e.block_hashes}
    assert gone == {*s1.block_hashes, *s2.block_hashes}
    assert all(e.medium == "GPU" for e in b3.events)


def test_wire_shape_is_array_batch_of_tagged_maps(pub: ZmqEventPublisher) -> None:
    # vLLM v0.26+: [ts, [ {"type": "BlockStored", ...} ], rank]. Subscribers in other
    # languages read it untyped, so pin the shape itself, not only a msgspec round trip.
    first, *_ = manager_events()
    got = publish_one(pub, first)
    assert got is not None
    raw = msgspec.msgpack.decode(got[2])
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    (event,) = raw[1]
    assert event["type"] == "BlockStored"
    assert event["block_hashes"] == [low64(first[0].block_hashes[0])]
    assert "lora_name" in event and event["lora_name"] is None


def test_bytes_hashes_and_array_wire_format_for_older_subscribers() -> None:
    first, second, _, tokens = manager_events()
    with ZmqEventPublisher(ANY_PORT, wire_format="array", hash_format="bytes") as p:
        got = publish_one(p, second)
    assert got is not None
    batch = DECODE_LEGACY.decode(got[2])
    (ev,) = batch.events
    assert isinstance(ev, legacy.BlockStored)
    assert ev.block_hashes == list(second[0].block_hashes)  # the whole digests
    assert ev.parent_block_hash == first[0].block_hashes[0]
    assert ev.token_ids == tokens[4:12]
    assert ev.medium == "GPU"
    # ... and that really is the positional form, which the map decoder refuses.
    with pytest.raises(msgspec.ValidationError):
        DECODE.decode(got[2])


def test_replay_after_missed_range_ends_with_marker(pub: ZmqEventPublisher) -> None:
    first, second, removed, _ = manager_events()
    sub = Subscriber(pub)
    try:
        base = sub.sync(pub)
        batches = [first, second, removed] * 3
        for b in batches:
            pub.publish(b)
        seen = []
        for _ in batches:
            got = sub.recv()
            assert got is not None
            seen.append(got)
        # The router "missed" the middle of the stream (e.g. a reconnect): it knows the
        # gap from the sequence numbers and asks for it.
        kept = [seen[0], seen[1], seen[7], seen[8]]
        last_seen = kept[1][1]
        assert kept[2][1] > last_seen + 1
        replies = sub.replay(last_seen + 1)
    finally:
        sub.close()
    *data, end = replies
    assert end == [b"", END_SEQ, b""]  # vLLM 0.33: the marker's topic frame is empty
    seqs = [int.from_bytes(r[1], "big") for r in data]
    # Everything from the requested seq that the buffer holds, in order.
    assert seqs == list(range(base + 2, base + len(batches)))
    assert all(r[0] == b"kv@a@model" for r in data)
    # Replayed payloads are the very bytes the PUB sent.
    by_seq = {s: p for _, s, p in seen}
    assert [r[2] for r in data] == [by_seq[s] for s in seqs]
    assert (
        DECODE.decode(data[0][2]).events[0].block_hashes
        == DECODE.decode(seen[2][2]).events[0].block_hashes
    )


def test_replay_is_bounded_by_buffer_steps_and_topic_frame_optional() -> None:
    first, *_ = manager_events()
    with ZmqEventPublisher(
        ANY_PORT, replay_endpoint=ANY_PORT, buffer_steps=4, replay_topic_frame=False
    ) as p:
        for _ in range(10):
            p.publish(first)
        assert p.flush()
        assert p.published_batches == 10
        sub = Subscriber(p)
        try:
            replies = sub.replay(0)
            again = sub.replay(100)  # nothing that new: the marker alone
        finally:
            sub.close()
    *data, end = replies
    assert end == [END_SEQ, b""]  # pre-#45177 framing: (seq, payload)
    assert [int.from_bytes(r[0], "big") for r in data] == [6, 7, 8, 9]
    assert again == [[END_SEQ, b""]]


def test_malformed_replay_request_is_answered_and_harmless(pub: ZmqEventPublisher) -> None:
    first, *_ = manager_events()
    sub = Subscriber(pub)
    try:
        assert sub.dealer is not None
        sub.dealer.send_multipart([b"", b"abc"])  # not an 8-byte seq
        assert sub.dealer.poll(5000)
        assert sub.dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
        sub.dealer.send_multipart([b"", b"x", b"y", b"z"])  # wrong frame count: ignored
        base = sub.sync(pub)
        pub.publish(first)
        got = sub.recv()
        assert got is not None and got[1] == base
        assert len(sub.replay(base)) == 2
    finally:
        sub.close()


def test_publish_never_blocks_and_drops_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stuck sender (or a slow network) must not stall the step: publish() returns at
    once, the bounded queue drops its oldest batch, and the gap shows in the seqs."""
    first, *_ = manager_events()
    gate = threading.Event()
    entered = threading.Event()
    real = publisher_mod.to_wire_events

    def stuck(events: Any, **kw: Any) -> Any:
        if events is first:
            entered.set()
            gate.wait(30)
        return real(events, **kw)

    monkeypatch.setattr(publisher_mod, "to_wire_events", stuck)
    p = ZmqEventPublisher(ANY_PORT, max_queue_size=4)
    sub = Subscriber(p)
    try:
        base = sub.sync(p)
        p.publish(first)
        assert entered.wait(10)  # the sender is now stuck inside batch `base`

        def flood() -> None:
            for _ in range(100):
                p.publish(first)

        t = threading.Thread(target=flood)
        t.start()
        t.join(10)
        assert not t.is_alive(), "publish() blocked while the sender was stuck"
        assert p.dropped_batches == 96
        gate.set()
        got = [sub.recv() for _ in range(5)]
    finally:
        gate.set()
        sub.close()
        p.close()
    assert all(g is not None for g in got)
    # The stuck batch, then the newest four; the 96 oldest queued ones are a visible gap.
    assert [g[1] for g in got] == [base, base + 97, base + 98, base + 99, base + 100]  # type: ignore[index]


def test_no_subscriber_never_blocks() -> None:
    first, *_ = manager_events()
    with ZmqEventPublisher(ANY_PORT, hwm=1) as p:
        for _ in range(500):
            p.publish(first)
        wait_for(lambda: p.published_batches == 500)
        assert p.dropped_batches == 0


def test_close_joins_thread_and_frees_the_port() -> None:
    first, *_ = manager_events()
    p = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT)
    sub = Subscriber(p)
    try:
        sub.sync(p)
        for _ in range(20):
            p.publish(first)
        p.close()
        assert not p._thread.is_alive()
        assert p.published_batches >= 20  # what was queued is sent before the thread stops
        with pytest.raises(PublisherClosedError):
            p.publish(first)
        p.close()  # idempotent
        # The sockets are closed: the same endpoints bind again (ZeroMQ releases a
        # listener on its I/O thread, a moment after close()).
        reopened: list[ZmqEventPublisher] = []

        def rebind() -> bool:
            try:
                reopened.append(
                    ZmqEventPublisher(p.endpoint, replay_endpoint=p.replay_endpoint, bind=True)
                )
            except InvalidArgumentError:
                return False
            return True

        wait_for(rebind)
        assert reopened[0].endpoint == p.endpoint
        reopened[0].close()
    finally:
        sub.close()


def test_bad_arguments_raise_and_leave_nothing_open() -> None:
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher(ANY_PORT, buffer_steps=0)
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher(ANY_PORT, wire_format="json")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher(ANY_PORT, hash_format="hex")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher("nonsense://x")
    # Any object was taken for its truth (an array raised NumPy's ValueError).
    for frame in ("no", 1, np.array([1, 0])):
        with pytest.raises(InvalidArgumentError, match="replay_topic_frame"):
            ZmqEventPublisher(ANY_PORT, replay_topic_frame=frame)  # type: ignore[arg-type]
    with ZmqEventPublisher(ANY_PORT) as p:
        with pytest.raises(InvalidArgumentError):
            ZmqEventPublisher(p.endpoint, bind=True)  # address in use
        with pytest.raises(InvalidArgumentError):
            ZmqEventPublisher(ANY_PORT, replay_endpoint=p.endpoint)
        # The sender thread survives a batch it cannot encode (an event of the right type
        # holding a hash msgpack has no form for); the seq is skipped.
        unencodable = BlockRemoved(block_hashes=[object()], medium="GPU")  # type: ignore[list-item]
        p.publish([unencodable])
        p.publish([unencodable])
        wait_for(lambda: p.failed_batches == 2)
        assert p._thread.is_alive()


def test_publish_rejects_a_non_event_list_on_the_callers_thread(pub: ZmqEventPublisher) -> None:
    # It was checked only on the sending thread: the caller got no error, the batch took a
    # seq that was never sent (a gap for subscribers) and only failed_batches counted it.
    first, _, _, _ = manager_events()
    sub = Subscriber(pub)
    try:
        seq0 = sub.sync(pub)
        for bad in (
            [object()],
            [*first, 3],  # one bad element after good ones
            [AllBlocksCleared(), None],
            "BlockStored",
            b"\x01",
            5,
            None,
            {"a": AllBlocksCleared()}.values(),  # not a sequence: not the documented input
            iter([AllBlocksCleared()]),
        ):
            with pytest.raises(InvalidTypeError):
                pub.publish(bad)  # type: ignore[arg-type]
        pub.publish(first)
        got = sub.recv()
    finally:
        sub.close()
    # Nothing queued, no seq taken: the next good batch carries the next number.
    assert got is not None and got[1] == seq0
    assert DECODE.decode(got[2]).events[0].block_hashes == [low64(first[0].block_hashes[0])]
    assert pub.flush() and (pub.failed_batches, pub.dropped_batches) == (0, 0)
    # A subclass of a wire struct is an event (the check's slow path) and is sent.
    pub.publish((*first, _Cleared()))
    assert pub.flush() and pub.published_batches == seq0 + 2 and pub.failed_batches == 0


class _Cleared(AllBlocksCleared):
    """A wire-struct subclass, as a caller's own event type would be."""


def test_close_checks_its_timeout_and_says_whether_the_thread_ended() -> None:
    p = ZmqEventPublisher(ANY_PORT)
    try:
        for bad in (float("inf"), float("nan"), -1.0, "5", True):
            with pytest.raises(InvalidArgumentError):
                p.close(bad)  # type: ignore[arg-type]
            assert not p.is_closed()  # a bad call changes nothing
    finally:
        assert p.close() is True
    assert p.close() is True  # idempotent


def test_flush_checks_its_timeout() -> None:
    # "5" raised a bare TypeError (monotonic() + "5"); nan never reached the deadline.
    p = ZmqEventPublisher(ANY_PORT)
    try:
        # An array was NumPy's ambiguous-truth ValueError from the inf comparison.
        for bad in (float("nan"), -1.0, "5", True, np.array([1.0, 2.0])):
            with pytest.raises(InvalidArgumentError):
                p.flush(bad)  # type: ignore[arg-type]
        assert p.flush(0.0) is True and p.flush(float("inf")) is True  # nothing queued
    finally:
        assert p.close() is True


def test_null_publisher_drops_events_and_refuses_what_zmq_refuses() -> None:
    with NullEventPublisher() as p:
        p.publish([])
        p.publish([BlockRemoved(block_hashes=[1], medium="GPU")])
        for bad in ([object()], None, "events"):
            with pytest.raises(InvalidTypeError):
                p.publish(bad)  # type: ignore[arg-type]
    assert p.close() is True
