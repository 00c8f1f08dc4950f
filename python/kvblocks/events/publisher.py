"""KV-event publishers: ZeroMQ PUB + ROUTER replay in vLLM's protocol, and a no-op one.

The protocol is vLLM's (``vllm/distributed/kv_events.py``), so its subscribers, llm-d's
indexer and Dynamo's relay consume a kvblocks instance unchanged:

* PUB, multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian batch counter from
  0, ``payload`` one msgpack :class:`~kvblocks.events.wire.KVEventBatch`.
* ROUTER replay (``replay_endpoint``): a request ``(b"", start_seq)`` (a REQ socket adds the
  empty delimiter; a DEALER sends it) is answered with every buffered batch whose
  ``seq >= start_seq``, ``(b"", topic, seq, payload)`` each, then the end marker
  ``(b"", b"", -1 as 8 signed bytes, b"")`` (an empty topic frame, as vLLM 0.33 sends it).
  ``replay_topic_frame=False`` leaves the topic frame out, for subscribers older than
  vLLM's PR #45177.

Publishing never blocks a step: :meth:`ZmqEventPublisher.publish` numbers the batch and
appends it to a bounded queue that a background thread converts, encodes and sends. When
the queue is full the *oldest* queued batch is dropped (counted in ``dropped_batches``):
its sequence number is then never sent nor replayable, so subscribers see a gap they
cannot fill. Batches are deltas: an index built from the stream stays wrong (a routing
error, never a wrong token) until the next ``AllBlocksCleared``, so ``max_queue_size``
should cover the sending thread's longest stall.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec
import zmq

from kvblocks.errors import InvalidArgumentError, KVBlocksError
from kvblocks.events.wire import (
    HashFormat,
    KVEventBatch,
    WireFormat,
    check_events,
    check_formats,
    to_wire_events,
)
from kvblocks.validation import INT32_MAX, check_bool, check_int, check_number, check_optional_int

logger = logging.getLogger("kvblocks.events")

#: The replay stream's end marker: sequence number -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class PublisherClosedError(KVBlocksError):
    """``publish`` on a publisher that was closed."""


class NullEventPublisher:
    """A publisher that drops everything (the default when events are off)."""

    def publish(self, events: Sequence[Any]) -> None:
        """Drop ``events`` after the check :meth:`ZmqEventPublisher.publish` makes, so an
        engine that swaps one publisher for the other meets the same errors.

        Raises:
            InvalidTypeError: ``events`` is not a sequence of events.
        """
        check_events(events)

    def close(self) -> bool:
        """Do nothing; True."""
        return True

    def __enter__(self) -> NullEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _should_bind(endpoint: str) -> bool:
    # vLLM's convention: a wildcard host, ipc or inproc binds (the stable side); a concrete
    # host connects to a proxy or a subscriber that binds.
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class ZmqEventPublisher:
    """Publishes KV-cache events over ZeroMQ in vLLM's wire format.

    Args:
        endpoint: PUB address, e.g. ``"tcp://*:5557"`` (bind) or ``"tcp://host:5557"``
            (connect). ``"tcp://127.0.0.1:*"`` binds a free port; read it back from
            :attr:`endpoint`.
        replay_endpoint: ROUTER address for replay requests (always bound); ``None``: no
            replay.
        topic: the first frame of every message (subscribers filter on its prefix).
        buffer_steps: batches kept for replay.
        hwm: ZeroMQ send high-water mark of the PUB socket (messages per subscriber).
        max_queue_size: batches waiting for the sending thread before the oldest is dropped.
        data_parallel_rank: written into each batch (``None`` leaves it out).
        wire_format: ``"map"`` (tagged-map events, vLLM v0.26+) or ``"array"`` (positional
            events, older vLLM); see :mod:`kvblocks.events.wire`.
        hash_format: ``"int"`` (the low 64 bits, vLLM's default) or ``"bytes"``.
        replay_topic_frame: put the topic frame in replay replies (vLLM after PR #45177).
        bind: force binding (``True``) or connecting (``False``) the PUB socket instead of
            guessing from ``endpoint``.
        context: a ``zmq.Context``; default the process-wide one (never terminated here).

    Raises:
        InvalidArgumentError: a bad size or format, or an endpoint ZeroMQ cannot use
            (address in use, malformed); nothing is left open.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int | None = 0,
        wire_format: WireFormat = "map",
        hash_format: HashFormat = "int",
        replay_topic_frame: bool = True,
        bind: bool | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        check_formats(wire_format, hash_format)
        # Every check comes before the first socket: a bad argument leaves nothing open.
        for name, value in (
            ("buffer_steps", buffer_steps),
            ("hwm", hwm),
            ("max_queue_size", max_queue_size),
        ):
            # hwm is a C int for ZeroMQ and buffer_steps a deque's maxlen (ssize_t).
            check_int(value, name, minimum=1, maximum=INT32_MAX, expected="an int in [1, 2^31)")
        if not isinstance(topic, str):
            raise InvalidArgumentError(f"topic must be a str, got {type(topic).__name__}")
        if not isinstance(endpoint, str):
            raise InvalidArgumentError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise InvalidArgumentError(
                f"replay_endpoint must be a str or None, got {type(replay_endpoint).__name__}"
            )
        # It goes on the wire as an integer: anything else fails every batch's encoding.
        check_optional_int(
            data_parallel_rank,
            "data_parallel_rank",
            minimum=0,
            maximum=2**63 - 1,
            expected="None or an int in [0, 2^63)",
        )
        check_bool(replay_topic_frame, "replay_topic_frame")
        if bind is not None and not isinstance(bind, bool):
            raise InvalidArgumentError(f"bind must be a bool or None, got {bind!r}")
        if context is not None and not isinstance(context, zmq.Context):
            raise InvalidArgumentError(
                f"context must be a zmq.Context or None, got {type(context).__name__}"
            )
        self._wire_format: WireFormat = wire_format
        self._hash_format: HashFormat = hash_format
        self._rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._replay_topic_frame = bool(replay_topic_frame)
        self._ctx = context if context is not None else zmq.Context.instance()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            if bind if bind is not None else _should_bind(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A ROUTER drops what is over its high-water mark (1,000 by default) without
                # a word: leave room for a whole replay and its end marker, twice (ZeroMQ
                # acknowledges reads only every HWM/2 messages), as vLLM 0.33 does.
                self._replay.setsockopt(zmq.SNDHWM, min(2 * (buffer_steps + 1), 2**31 - 1))
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets(linger=0)
            raise InvalidArgumentError(f"cannot open KV event sockets: {e}") from e

        # The step thread only appends (seq, ts, events); the sender owns sockets and buffer.
        self._queue: deque[tuple[int, float, Sequence[Any]]] = deque()
        self._max_queue = max_queue_size
        self._cond = threading.Condition(threading.Lock())
        self._next_seq = 0
        self._closing = False
        self._closed = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.dropped_batches = 0
        self.published_batches = 0
        self.replay_requests = 0
        self.failed_batches = 0
        self._thread = threading.Thread(target=self._run, name="kvblocks-kv-events", daemon=True)
        self._thread.start()

    # -- step thread ----------------------------------------------------------------------
    def publish(self, events: Sequence[Any]) -> None:
        """Queue one step's events as one batch; returns at once.

        ``events`` is ``KVCacheManager.take_events()`` output (or vLLM wire structs); an
        empty list publishes nothing. Conversion and encoding happen on the sending thread,
        so the list must not be mutated afterwards.

        Raises:
            InvalidTypeError: ``events`` is not a sequence of events (checked here, before
                anything is queued: no sequence number is taken).
            PublisherClosedError: after :meth:`close`.
        """
        if not check_events(events):
            return
        ts = time.time()
        with self._cond:
            if self._closing:
                raise PublisherClosedError("publish() on a closed ZmqEventPublisher")
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped_batches += 1
            self._queue.append((self._next_seq, ts, events))
            self._next_seq += 1
            self._cond.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch published so far was sent (or dropped); ``False`` if
        ``timeout`` seconds passed first (``inf``: no deadline). Replay serves a batch
        only once it was sent.

        Raises:
            InvalidArgumentError: ``timeout`` is not a number >= 0.
        """
        check_number(timeout, "timeout", minimum=0, expected="a number >= 0", infinite=True)
        deadline = time.monotonic() + timeout
        while self.published_batches + self.failed_batches + self.dropped_batches < (
            self._next_seq
        ):
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Send what is queued (up to ``timeout`` seconds), stop the thread, close the
        sockets; whether the thread ended in time. Idempotent."""
        # A wait past threading.TIMEOUT_MAX (inf included) raises OverflowError in join.
        timeout = check_number(timeout, "timeout", minimum=0, maximum=threading.TIMEOUT_MAX)
        with self._cond:
            if self._closed:
                return not self._thread.is_alive()
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if not ended:
            logger.warning("KV event publisher thread did not stop within %.1f s", timeout)
        self._closed = True
        return ended

    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closing

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- sending thread -------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                if self._replay is not None:
                    self._serve_replays()
                with self._cond:
                    if not self._queue:
                        if self._closing:
                            break
                        # Short waits keep replay requests answered while no step publishes.
                        self._cond.wait(0.005 if self._replay is not None else 0.1)
                    items = list(self._queue)
                    self._queue.clear()
                for seq, ts, events in items:
                    self._send(encoder, seq, ts, events)
        finally:
            self._close_sockets(linger=1000)

    def _send(
        self, encoder: msgspec.msgpack.Encoder, seq: int, ts: float, events: Sequence[Any]
    ) -> None:
        assert self._pub is not None
        try:
            wire = to_wire_events(
                events,
                wire_format=self._wire_format,
                hash_format=self._hash_format,
            )
            payload = encoder.encode(KVEventBatch(ts, wire, self._rank))
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
        except Exception:
            # A bad batch must not stop the stream: its seq stays a gap for subscribers.
            self.failed_batches += 1
            logger.exception("KV event batch %d was not published", seq)
            return
        self._buffer.append((seq, payload))
        self.published_batches += 1

    def _serve_replays(self) -> None:
        replay = self._replay
        assert replay is not None
        while replay.poll(0):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.replay_requests += 1
            # (identity, b"", start) from REQ or a DEALER with the delimiter; a DEALER
            # without it sends (identity, start) and is answered without it.
            if len(frames) == 3 and frames[1] == b"":
                head = [frames[0], b""]
            elif len(frames) == 2:
                head = [frames[0]]
            else:
                logger.warning("malformed KV event replay request: %d frames", len(frames))
                continue
            start = frames[-1]
            topic = [self._topic] if self._replay_topic_frame else []
            if len(start) == 8:
                first = int.from_bytes(start, "big", signed=True)
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        replay.send_multipart([*head, *topic, seq.to_bytes(8, "big"), payload])
            else:
                logger.warning("KV event replay request with a %d-byte seq", len(start))
            # vLLM 0.33's end marker has an empty topic frame (the batches carry the topic).
            end_topic = [b""] if self._replay_topic_frame else []
            replay.send_multipart([*head, *end_topic, END_SEQ, b""])

    def _close_sockets(self, linger: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=linger)
