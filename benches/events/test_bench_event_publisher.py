"""What publishing KV events costs a step at 1,024 running sequences, against no publisher
in the same run.

Every step commits ~1,000 decode tokens and admits new requests whose prompts share 8
system prompts; the pool churns, so a step's batch carries ~72 stored and ~53 removed
blocks. Modes:

* ``none``: the manager records no events, no publisher (``LLM``'s default);
* ``null``: events recorded and drained into a :class:`NullEventPublisher` (the price of
  recording and ``take_events``);
* ``zmq``: a :class:`ZmqEventPublisher` on 127.0.0.1 with a subscriber draining it. The step
  thread only queues the batch; conversion, msgpack encoding and the send run on the
  publisher's thread, which still shares the GIL with the step.

``publish_call`` times :meth:`ZmqEventPublisher.publish` alone on one step's events.
``interleaved`` runs a ``none`` and a ``zmq`` scheduler step by step in turn, so machine
noise hits both alike, and reports the median of the per-round ratios in ``extra_info``.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvblocks import KVCacheManager
from kvblocks.events import NullEventPublisher, ZmqEventPublisher
from kvblocks.scheduler import ModelStepResult, Request, SamplingParams, Scheduler, SchedulerConfig

NUM_SEQS = 1024
_ids = itertools.count()


class _Drain:
    """A subscriber on its own thread, as a router would be (zmq recv releases the GIL)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sock.connect(endpoint)
        self.received = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            if self.sock.poll(50):
                self.sock.recv_multipart()
                self.received += 1

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        self.sock.close(linger=0)


def _setup(mode: str) -> tuple[Scheduler, Any, Any]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, size=(8, 32))
    publisher: Any = None
    drain = None
    if mode == "null":
        publisher = NullEventPublisher()
    elif mode == "zmq":
        publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        drain = _Drain(publisher.endpoint)
    mgr = KVCacheManager(8_000, 16, record_events=mode != "none")
    sched = Scheduler(
        mgr,
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=NUM_SEQS),
        event_publisher=publisher,
        record_history=False,
    )

    def refill() -> None:
        while sched.num_unfinished_requests() < NUM_SEQS + 64:
            i = next(_ids)
            prompt = np.concatenate([system[i % 8], rng.integers(0, 32000, size=16)])
            max_tokens = int(rng.integers(16, 96))
            sched.add_request(Request(f"q{i}", prompt, SamplingParams(max_tokens=max_tokens)))

    def step() -> None:
        out = sched.schedule()
        total = int(out.sample_counts.sum())
        sched.update(
            out, ModelStepResult(rng.integers(0, 32000, size=total), np.zeros(total, np.float32))
        )

    refill()
    for _ in range(40):  # a full running batch, a pool that has started evicting
        step()
        refill()
    return sched, (step, refill), (publisher, drain)


@pytest.mark.parametrize("mode", ["none", "null", "zmq"])
def test_step_with_event_publisher(benchmark: Any, mode: str) -> None:
    """One schedule()+update() at 1,024 running sequences, events published or not."""
    sched, (step, refill), (publisher, drain) = _setup(mode)
    try:
        benchmark.group = f"step at {NUM_SEQS} sequences, KV events"
        benchmark.extra_info.update(mode=mode)
        benchmark.pedantic(step, setup=refill, rounds=200, iterations=1, warmup_rounds=2)
        assert sched.stats()["num_running"] >= NUM_SEQS // 2
        benchmark.extra_info.update(evictions=sched.manager.stats()["evictions"])
        if mode == "zmq":
            assert publisher.published_batches > 0
            assert publisher.dropped_batches == 0
    finally:
        if publisher is not None:
            publisher.close()
        if drain is not None:
            drain.close()


def test_publish_call(benchmark: Any) -> None:
    """ZmqEventPublisher.publish() alone on one step's events (the step thread's share)."""
    mgr = KVCacheManager(12_000, 16, record_events=True)
    sched, (step, refill), _ = _setup("none")
    del sched, step, refill
    rng = np.random.default_rng(1)
    for s in range(NUM_SEQS // 16):  # ~64 full blocks stored, as in one decode step
        mgr.add_sequence(s, rng.integers(0, 32000, size=16))
        mgr.allocate_slots(s, 16)
        mgr.commit(s, 16)
    events = mgr.take_events()
    with ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=1_000_000) as pub:
        benchmark.group = "publish() call"
        benchmark.extra_info.update(num_events=len(events))
        benchmark.pedantic(pub.publish, args=(events,), rounds=2000, iterations=1)


def _one_step_of_events() -> list[Any]:
    """The events of one steady-state ``zmq``-mode step (stored and removed blocks)."""
    sched, (step, refill), (publisher, drain) = _setup("null")
    del publisher, drain
    for _ in range(160):  # into the evicting steady state
        refill()
        step()
    sched.event_publisher = None  # keep this step's events in the manager
    refill()
    step()
    return sched.manager.take_events()


def test_sender_work_per_step(benchmark: Any) -> None:
    """Conversion to vLLM's structs + msgpack encoding of one step's events: the work the
    publisher thread does per step (off the step thread, but under the same GIL)."""
    from kvblocks.events.wire import KVEventBatch, to_wire_events

    events = _one_step_of_events()
    encoder = msgspec.msgpack.Encoder()

    def work() -> bytes:
        return encoder.encode(KVEventBatch(0.0, to_wire_events(events), 0))

    benchmark.group = "publisher thread, per step"
    payload = benchmark.pedantic(work, rounds=500, iterations=1, warmup_rounds=5)
    benchmark.extra_info.update(num_events=len(events), payload_bytes=len(payload))


def test_interleaved_none_vs_zmq(benchmark: Any) -> None:
    """A step without and a step with the ZeroMQ publisher, alternated; ratio of medians."""
    runs = {mode: _setup(mode) for mode in ("none", "zmq")}
    times: dict[str, list[float]] = {"none": [], "zmq": []}

    def one_round() -> None:
        for mode, (_, (step, refill), _) in runs.items():
            refill()
            t0 = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t0)

    try:
        benchmark.group = f"none then zmq step at {NUM_SEQS} sequences"
        benchmark.pedantic(one_round, rounds=300, iterations=1, warmup_rounds=2)
    finally:
        pub, drain = runs["zmq"][2]
        pub.close()
        drain.close()
    none = np.array(times["none"][2:])
    zmq_t = np.array(times["zmq"][2:])
    ratio = float(np.median(zmq_t / none))
    benchmark.extra_info.update(
        none_median_us=float(np.median(none) * 1e6),
        zmq_median_us=float(np.median(zmq_t) * 1e6),
        none_min_us=float(none.min() * 1e6),
        zmq_min_us=float(zmq_t.min() * 1e6),
        median_ratio_zmq_over_none=ratio,
    )
    print(
        f"\nstep at {NUM_SEQS} seqs: none median {np.median(none) * 1e6:.0f} us, zmq median "
        f"{np.median(zmq_t) * 1e6:.0f} us, median per-round ratio zmq/none {ratio:.3f}"
    )
