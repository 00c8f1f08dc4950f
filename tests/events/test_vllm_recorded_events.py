"""kvblocks' published events against the events vLLM 0.33 published for the same steps.

``data/vllm_events.json`` was recorded by ``data/record_vllm_events.py`` with vLLM's own
``KVCacheManager``, ``Request`` (``sha256_cbor`` block hasher), ``LoRARequest``, event
structs and ``ZmqEventPublisher``; vLLM is not needed here. Each scenario is replayed on a
kvblocks manager step for step (allocate, commit) and each batch's msgpack is compared
with vLLM's: decoded field by field first (a readable diff), then byte for byte.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from zmq_helpers import END_SEQ, Subscriber

from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.events import AllBlocksCleared, BlockStored, ZmqEventPublisher
from kvblocks.events.wire import KVEventBatch, to_wire_events

DATA = json.loads((Path(__file__).parent / "data" / "vllm_events.json").read_text())
BS = DATA["block_size"]
TS = DATA["ts"]
ANY_PORT = "tcp://127.0.0.1:*"
ENCODER = msgspec.msgpack.Encoder()


def encode(events: list[Any], hash_format: str) -> bytes:
    """One batch as kvblocks' publisher encodes it (with vLLM's recorded ``ts``)."""
    wire = to_wire_events(events, hash_format=hash_format)  # type: ignore[arg-type]
    return ENCODER.encode(KVEventBatch(TS, wire, 0))


def assert_same_batch(ours: bytes, vllm_hex: str, what: str) -> None:
    theirs = bytes.fromhex(vllm_hex)
    assert msgspec.msgpack.decode(ours) == msgspec.msgpack.decode(theirs), what
    assert ours == theirs, what


def manager(num_blocks: int, **kw: Any) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BS, hash_algo="sha256_cbor", record_events=True, watermark=0.0, **kw
    )


def run(m: KVCacheManager, sid: int, prompt: list[int], decode: list[int]) -> list[list[Any]]:
    """vLLM's steps on kvblocks: prefill the prompt in one step, then compute one decode
    token a step; the non-empty ``take_events()`` of each step."""
    steps = []
    tokens = [*decode, None]
    assert m.allocate_slots(sid, len(prompt)) is not None
    m.commit(sid, len(prompt), tokens[:1] if decode else [])
    steps.append(m.take_events())
    for i in range(len(decode)):
        assert m.allocate_slots(sid, 1) is not None
        nxt = tokens[i + 1]
        m.commit(sid, 1, [] if nxt is None else [nxt])
        steps.append(m.take_events())
    return [s for s in steps if s]


def variant_id(v: dict[str, Any]) -> str:
    lora = v["lora"]["name"] if v["lora"] else None
    return f"salt={v['cache_salt']!r}-lora={lora!r}-n={len(v['prompt'])}"


VARIANTS = DATA["hash_formats"]["int"]["variants"]


def test_the_recording_covers_the_issue_s_80_variants() -> None:
    assert len(VARIANTS) == 80
    assert {(v["cache_salt"], json.dumps(v["lora"])) for v in VARIANTS}.__len__() == 16
    example = next(
        v
        for v in VARIANTS
        if v["cache_salt"] == "s" and v["lora"] and v["lora"]["name"] == "my-lora"
        and len(v["prompt"]) == 8
    )  # fmt: skip
    first = msgspec.msgpack.decode(bytes.fromhex(example["batches"][0]))[1][0]
    assert first["extra_keys"] == [["my-lora", "s"], ["my-lora"]]


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=[variant_id(v) for v in VARIANTS])
def test_salt_and_lora_variants_match_vllm(hash_format: str, index: int) -> None:
    v = DATA["hash_formats"][hash_format]["variants"][index]
    m = manager(32)
    lora = v["lora"]
    if lora is not None:
        m.register_lora(lora["id"], lora["name"], lora["path"])
    m.add_sequence(0, v["prompt"], cache_salt=v["cache_salt"], lora_id=lora and lora["id"])
    ours = run(m, 0, v["prompt"], v["decode"])
    assert len(ours) == len(v["batches"])
    for step, (events, theirs) in enumerate(zip(ours, v["batches"], strict=True)):
        assert_same_batch(encode(events, hash_format), theirs, f"batch {step}")


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_eviction_and_reset_match_vllm(hash_format: str) -> None:
    rec = DATA["hash_formats"][hash_format]["evict_and_reset"]
    m = manager(rec["num_blocks"])
    a, b = rec["prompts"]
    m.add_sequence(0, a)
    batches = run(m, 0, a, [])
    m.free(0)
    m.add_sequence(1, b)
    batches += run(m, 1, b, [])
    m.free(1)
    assert m.reset_prefix_cache()
    batches.append(m.take_events())
    assert len(batches) == len(rec["batches"])
    for step, (events, theirs) in enumerate(zip(batches, rec["batches"], strict=True)):
        assert_same_batch(encode(events, hash_format), theirs, f"batch {step}")


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_a_sliding_window_group_matches_vllm(hash_format: str) -> None:
    rec = DATA["hash_formats"][hash_format]["sliding_window"]
    m = manager(32, sliding_window=rec["sliding_window"])
    m.add_sequence(0, rec["prompt"])
    ours = run(m, 0, rec["prompt"], rec["decode"])
    assert len(ours) == len(rec["batches"])
    for step, (events, theirs) in enumerate(zip(ours, rec["batches"], strict=True)):
        assert_same_batch(encode(events, hash_format), theirs, f"batch {step}")


def drive(rec: dict[str, Any]) -> list[list[Any]]:
    """The recorded scheduler steps on kvblocks, as its scheduler drives the manager: a
    step adds its new (or resumed) sequences, allocates for every scheduled one, then
    commits each (appending the sampled token); a preempted sequence is freed and added
    again with its tokens. Every step's ``take_events()``, empty ones included."""
    m = manager(rec["num_blocks"], sliding_window=rec.get("sliding_window"))
    ids = {rid: sid for sid, rid in enumerate(rec["requests"])}
    tokens = {rid: list(r["prompt"]) for rid, r in rec["requests"].items()}
    batches = []
    for step in rec["steps"]:
        for rid in step.get("preempt", []):
            m.free(ids[rid])
        scheduled = []
        for rid, _ in step.get("run", []):
            sid = ids[rid]
            if sid not in m:
                m.add_sequence(sid, tokens[rid])
            n = m.num_tokens(sid) - m.num_computed_tokens(sid)
            assert m.allocate_slots(sid, n) is not None, f"{rid}: pool short"
            scheduled.append(n)
        for (rid, tok), n in zip(step.get("run", []), scheduled, strict=True):
            m.commit(ids[rid], n, [] if tok is None else [tok])
            tokens[rid] += [] if tok is None else [tok]
        for rid in step.get("free", []):
            m.free(ids[rid])
        if step.get("reset"):
            assert m.reset_prefix_cache()
        batches.append(m.take_events())
    return batches


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_duplicate_blocks_match_vllm(hash_format: str) -> None:
    """Copies of a cached hash: the same prompt computed twice in one step, both decoding
    the same tokens, a prompt's last block recomputed while a copy is cached, copies
    evicted one at a time (each its own ``BlockRemoved``) and a preempted sequence
    resuming on its surviving prefix; reset with copies cached."""
    rec = DATA["hash_formats"][hash_format]["duplicates"]
    ours = drive(rec)
    assert len(ours) == len(rec["batches"])
    for step, (events, theirs) in enumerate(zip(ours, rec["batches"], strict=True)):
        assert_same_batch(encode(events, hash_format), theirs, f"step {step + 1}")


def decoded(events: list[Any], hash_format: str) -> list[Any]:
    return msgspec.msgpack.decode(encode(events, hash_format))[1]  # type: ignore[no-any-return]


def vllm_events(batch_hex: str) -> list[Any]:
    return msgspec.msgpack.decode(bytes.fromhex(batch_hex))[1]  # type: ignore[no-any-return]


def removed(hashes: list[Any]) -> dict[str, Any]:
    """A decoded ``BlockRemoved`` of ``hashes`` (GPU, group 0)."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_a_hit_on_copies_claims_one_in_use_where_vllm_claims_the_oldest(
    hash_format: str,
) -> None:
    """A known difference, pinned: with a's copies free and b's in use, a hit on them
    shares b's (no block leaves the free queue) where vLLM takes a's, the oldest. The
    same blocks are stored, but a's copies stay the oldest free blocks, so the last step
    evicts a's copy of the 2nd hash where vLLM evicts f's 2nd block."""
    rec = DATA["hash_formats"][hash_format]["duplicate_claim"]
    ours = drive(rec)
    for step, (events, theirs) in enumerate(zip(ours[:-1], rec["batches"][:-1], strict=True)):
        assert_same_batch(encode(events, hash_format), theirs, f"step {step + 1}")
    twins, f = vllm_events(rec["batches"][0])[0], vllm_events(rec["batches"][2])[0]
    ours_last, theirs_last = decoded(ours[-1], hash_format), vllm_events(rec["batches"][-1])
    assert [e["type"] for e in ours_last] == [e["type"] for e in theirs_last]
    assert ours_last[1] == theirs_last[1]  # g's BlockStored
    assert theirs_last[0]["block_hashes"] == f["block_hashes"][1:]
    assert ours_last[0]["block_hashes"] == twins["block_hashes"][1:]


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_a_step_s_evictions_come_before_its_stores_where_vllm_interleaves(
    hash_format: str,
) -> None:
    """A known difference, pinned: vLLM caches a sequence's blocks when it allocates, so
    a step's batch is each sequence's evictions then its stores in turn; kvblocks caches
    at commit, after the step's allocations: the same events, evictions first."""
    rec = DATA["hash_formats"][hash_format]["step_order"]
    ours = drive(rec)
    for step, (events, theirs) in enumerate(zip(ours[:-1], rec["batches"][:-1], strict=True)):
        assert_same_batch(encode(events, hash_format), theirs, f"step {step + 1}")
    ours_last, theirs_last = decoded(ours[-1], hash_format), vllm_events(rec["batches"][-1])
    assert [e["type"] for e in theirs_last] == ["BlockStored", "BlockRemoved"]
    assert ours_last == theirs_last[::-1]


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_a_window_group_releases_at_commit_where_vllm_releases_at_the_next_allocation(
    hash_format: str,
) -> None:
    """A known difference, pinned: the block a's window left is free from a's commit in
    kvblocks, from a's next allocation in vLLM, so x's blocks, freed in between, queue
    after it in kvblocks and before it in vLLM: c's block evicts a's first block (its
    ``BlockRemoved``) where vLLM evicts x's last."""
    rec = DATA["hash_formats"][hash_format]["window_release"]
    ours = drive(rec)
    assert len(ours) == len(rec["batches"]) == 3
    for step in (0, 2):
        assert_same_batch(encode(ours[step], hash_format), rec["batches"][step], f"step {step}")
    a, x = vllm_events(rec["batches"][0])
    assert vllm_events(rec["batches"][1]) == [removed(x["block_hashes"][1:])]
    assert decoded(ours[1], hash_format) == [removed(a["block_hashes"][:1])]


def test_the_publisher_sends_vllm_s_bytes() -> None:
    """Through a real socket: the payload the subscriber receives is vLLM's (its ``ts``
    aside, the first field: ``0x93`` array, ``0xcb`` float64, 8 bytes)."""
    v = next(v for v in VARIANTS if v["cache_salt"] == "s" and v["lora"] and len(v["prompt"]) == 8)
    m = manager(32)
    m.register_lora(v["lora"]["id"], v["lora"]["name"], v["lora"]["path"])
    m.add_sequence(0, v["prompt"], cache_salt="s", lora_id=v["lora"]["id"])
    events = run(m, 0, v["prompt"], [])[0]
    with ZmqEventPublisher(ANY_PORT) as pub:
        sub = Subscriber(pub)
        try:
            sub.sync(pub)
            pub.publish(events)
            got = sub.recv()
        finally:
            sub.close()
    assert got is not None
    payload, theirs = got[2], bytes.fromhex(v["batches"][0])
    assert payload[:2] == theirs[:2] == b"\x93\xcb"
    assert payload[10:] == theirs[10:]


def test_replay_frames_match_vllm() -> None:
    """vLLM 0.33 answers a replay with ``(b"", topic, seq, payload)`` per batch, then the
    end marker ``(b"", b"", -1, b"")``: an empty topic frame."""
    rec = DATA["replay"]
    want = [[bytes.fromhex(f) for f in frames] for frames in rec["replies"]]
    assert want[-1] == [b"", b"", END_SEQ, b""]
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, topic=rec["topic"]) as pub:
        pub.publish([AllBlocksCleared()])
        assert pub.flush()
        assert pub.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([bytes.fromhex(f) for f in rec["request"]])
            got = [dealer.recv_multipart() for _ in want]
        finally:
            dealer.close(linger=0)
    assert len(got[0]) == len(want[0]) == 4
    assert got[0][:3] == want[0][:3]  # delimiter, topic, seq 0
    assert got[0][3][10:] == want[0][3][10:]  # the payload, ts aside
    assert got[-1] == want[-1]


def test_a_whole_replay_buffer_reaches_a_slow_subscriber() -> None:
    """Regression: the ROUTER kept ZeroMQ's default high-water mark (1,000 messages), so a
    replay of more batches than a subscriber had read lost the rest and the end marker
    without a word; vLLM 0.33 sizes it for the whole buffer and the marker."""
    n = 4000
    # ~3 KB a batch, so the reply outgrows the kernel's socket buffers too.
    big = BlockStored([1], None, list(range(1000, 2000)), 1000, None, "GPU", None)
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, buffer_steps=n) as pub:
        for _ in range(n):
            pub.publish([big])
        assert pub.flush(timeout=60)
        assert pub.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            time.sleep(1.0)  # the publisher queues the whole reply before we read
            seqs, ended = [], False
            while not ended and dealer.poll(5000):
                frames = dealer.recv_multipart()
                ended = frames[2] == END_SEQ
                seqs += [] if ended else [int.from_bytes(frames[2], "big")]
        finally:
            dealer.close(linger=0)
    assert ended, f"no end marker after {len(seqs)} of {n} batches"
    assert seqs == list(range(n))


def test_to_wire_events_refuses_unknown_formats() -> None:
    # An unknown hash_format sent whole digests as bytes, an unknown wire_format the map
    # form, both without a word (the publisher checks its formats; this did not).
    m = manager(8)
    m.add_sequence(0, list(range(BS)))
    events = run(m, 0, list(range(BS)), [])[0]
    for kwargs in ({"hash_format": "hex"}, {"wire_format": "json"}, {"hash_format": None}):
        with pytest.raises(InvalidArgumentError):
            to_wire_events(events, **kwargs)  # type: ignore[arg-type]
