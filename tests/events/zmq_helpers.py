"""A real ZeroMQ subscriber (SUB + DEALER replay) for the KV-event tests, on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvblocks.events import AllBlocksCleared, ZmqEventPublisher

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true (the sender thread runs on its own schedule)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the publisher"
        time.sleep(0.002)


class Subscriber:
    """What a router runs: a SUB on the PUB endpoint, a DEALER on the replay endpoint."""

    def __init__(self, pub: ZmqEventPublisher, topic: str = "") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(pub.endpoint)
        self.dealer: zmq.Socket | None = None
        if pub.replay_endpoint is not None:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.connect(pub.replay_endpoint)

    def sync(self, pub: ZmqEventPublisher, timeout: float = 10.0) -> int:
        """Publish probe batches until one arrives (PUB drops messages until the
        subscription has propagated); returns the seq the next batch will carry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pub.publish([AllBlocksCleared()])
            got = self.recv(timeout_ms=50)
            if got is not None:
                # Drain probes still in flight so the caller starts on a clean stream.
                last = got[1]
                while (more := self.recv(timeout_ms=100)) is not None:
                    last = more[1]
                return last + 1
        raise AssertionError("the subscription never reached the publisher")

    def recv(self, timeout_ms: int = 5000) -> tuple[bytes, int, bytes] | None:
        """One ``(topic, seq, payload)`` message, or ``None`` on timeout."""
        if not self.sub.poll(timeout_ms):
            return None
        frames = self.sub.recv_multipart()
        assert len(frames) == 3, f"PUB messages have 3 frames, got {len(frames)}"
        topic, seq, payload = frames
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def replay(self, start: int, timeout_ms: int = 5000) -> list[list[bytes]]:
        """Ask for every buffered batch from ``start``; the reply frames after the empty
        delimiter, up to and including the end marker."""
        assert self.dealer is not None
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        while True:
            assert self.dealer.poll(timeout_ms), "replay reply timed out"
            frames = self.dealer.recv_multipart()
            assert frames[0] == b"", "ROUTER replies start with the empty delimiter"
            replies.append(frames[1:])
            if END_SEQ in frames[1:3]:
                return replies

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)


def publish_one(pub: ZmqEventPublisher, events: Sequence[Any]) -> tuple[bytes, int, bytes] | None:
    """Subscribe, publish ``events`` as one batch and receive it: the ``(topic, seq,
    payload)`` message a fresh subscriber sees, or ``None`` if none arrived."""
    sub = Subscriber(pub)
    try:
        sub.sync(pub)
        pub.publish(events)
        return sub.recv()
    finally:
        sub.close()
