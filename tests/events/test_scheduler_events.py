"""Scheduler and LLM publish their KV events: a router's index built from the stream holds
exactly the manager's cached blocks, each with the tokens it caches."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import vllm_structs as vllm
from zmq_helpers import Subscriber, wait_for

from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.events import PublisherClosedError, ZmqEventPublisher
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import ModelStepResult, Request, Scheduler, SchedulerConfig

DECODE = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
BLOCK = 4


def fake_step(output: object) -> ModelStepResult:
    """Deterministic tokens: the next token follows from the last input token."""
    last = output.input_token_ids[output.logits_indices]  # type: ignore[attr-defined]
    tokens = ((last * 31 + 5) % 97).astype(np.int64)
    return ModelStepResult(tokens, np.zeros(len(tokens), dtype=np.float32))


class Index:
    """A router's view of one instance: block hash -> its tokens, from the event stream."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[int]] = {}
        self.parents: dict[int, int | None] = {}
        self.seqs: list[int] = []

    def apply(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        for ev in DECODE.decode(payload).events:
            if isinstance(ev, vllm.BlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.blocks
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[h] = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                    self.parents[h] = parent
                    parent = h
            elif isinstance(ev, vllm.BlockRemoved):
                for h in ev.block_hashes:
                    del self.blocks[h]  # a removal names a block the index holds
            else:
                self.blocks.clear()

    def prefix(self, h: int) -> list[int]:
        """The tokens from the first block to ``h``, following the parent chain."""
        out: list[int] = []
        cur: int | None = h
        while cur is not None:
            out = self.blocks.get(cur, [-1] * BLOCK) + out
            cur = self.parents.get(cur)
        return out


def test_scheduler_publishes_each_step_and_the_index_matches_the_cache() -> None:
    manager = KVCacheManager(24, BLOCK, record_events=True)
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        sub = Subscriber(pub)
        try:
            base = sub.sync(pub)
            sched = Scheduler(
                manager,
                SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                event_publisher=pub,
            )
            rng = np.random.default_rng(0)
            shared = [int(t) for t in rng.integers(1, 90, 9)]
            prompts = {}
            for i in range(12):  # more than the pool holds at once: evictions happen
                tail = [int(t) for t in rng.integers(1, 90, 5 + i % 4)]
                prompts[f"r{i}"] = (shared if i % 2 else shared[:5]) + tail
                sched.add_request(Request(f"r{i}", prompts[f"r{i}"], SamplingParams(max_tokens=6)))
            full: dict[str, list[int]] = {}
            steps = 0
            while sched.has_unfinished_requests():
                out = sched.schedule()
                for done in sched.update(out, fake_step(out)).finished:
                    full[done.request_id] = prompts[done.request_id] + list(
                        done.outputs[0].token_ids
                    )
                steps += 1
            wait_for(lambda: pub.published_batches >= 1 and not pub._queue)
            index = Index()
            while (got := sub.recv(timeout_ms=300)) is not None:
                index.apply(got[1], got[2])
        finally:
            sub.close()
    assert manager.take_events() == []  # the scheduler drained every event
    # One batch per step that had events, numbered without gaps.
    assert index.seqs == list(range(base, base + len(index.seqs)))
    assert 0 < len(index.seqs) <= steps
    assert manager.stats()["evictions"] > 0
    # The index holds exactly the manager's cached blocks ...
    assert len(index.blocks) == manager.stats()["num_cached_blocks"]
    # ... and each cached block's chain spells a block-aligned prefix of a real sequence.
    sequences = [tuple(t) for t in full.values()]
    for h in index.blocks:
        pre = tuple(index.prefix(h))
        assert any(s[: len(pre)] == pre for s in sequences), pre


def test_scheduler_needs_a_manager_that_records_events() -> None:
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*") as pub,
        pytest.raises(InvalidArgumentError, match="record_events"),
    ):
        Scheduler(KVCacheManager(8, BLOCK, record_events=False), event_publisher=pub)
    with pytest.raises(InvalidArgumentError, match="publish"):
        Scheduler(KVCacheManager(8, BLOCK), event_publisher=object())


def test_llm_publishes_its_prefix_cache() -> None:
    pytest.importorskip("torch")
    from kvblocks.engine import LLM
    from kvblocks.engine.tiny import build_tiny_model, tiny_config

    with ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        sub = Subscriber(pub)
        try:
            sub.sync(pub)
            llm = LLM(
                build_tiny_model(tiny_config("llama")),
                num_blocks=64,
                block_size=8,
                device="cpu",
                event_publisher=pub,
            )
            assert llm.manager.record_events
            prompt = list(range(1, 40))
            llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
            index = Index()
            while (got := sub.recv(timeout_ms=1000)) is not None:
                index.apply(got[1], got[2])
        finally:
            sub.close()
    # The prompt's 4 full blocks are cached and announced, in order, with their tokens.
    chains = [index.prefix(h) for h in index.blocks]
    assert prompt[:32] in chains
    assert len(index.blocks) == llm.manager.stats()["num_cached_blocks"]


def test_llm_failing_mid_step_publishes_the_clear_and_stays_consistent() -> None:
    """A step that fails between schedule() and update() drops the prefix cache (its blocks
    may hold unfinished KV); the replacement scheduler keeps the publisher, so routers hear
    AllBlocksCleared and their index matches the cache again: when the failed call
    returns, not only once a later call runs a step (an idle instance would otherwise be
    routed requests for blocks it dropped)."""
    pytest.importorskip("torch")
    from kvblocks.engine import LLM

    with ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        sub = Subscriber(pub)
        try:
            sub.sync(pub)
            llm = LLM(num_blocks=64, block_size=8, device="cpu", event_publisher=pub)
            params = SamplingParams(max_tokens=8, temperature=0.0)
            prompts = [list(range(1, 30)), list(range(40, 75))]
            llm.generate(prompts, params)
            real = llm.runner.execute
            calls = {"n": 0}

            def failing(out: object) -> object:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("device lost")
                return real(out)

            llm.runner.execute = failing  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="device lost"):
                llm.generate([list(range(100, 140))], params)
            assert pub.flush()
            index = Index()
            kinds: list[str] = []
            while (got := sub.recv(timeout_ms=1000)) is not None:
                kinds += [type(e).__name__ for e in DECODE.decode(got[2]).events]
                index.apply(got[1], got[2])
            assert kinds[-1:] == ["AllBlocksCleared"]
            assert len(index.blocks) == llm.manager.stats()["num_cached_blocks"] == 0
            assert llm.manager.take_events() == []  # nothing left for a later step to send
            llm.generate(prompts, params)
            assert pub.flush()
            while (got := sub.recv(timeout_ms=1000)) is not None:
                kinds += [type(e).__name__ for e in DECODE.decode(got[2]).events]
                index.apply(got[1], got[2])
        finally:
            sub.close()
    assert "AllBlocksCleared" in kinds
    assert len(index.blocks) == llm.manager.stats()["num_cached_blocks"] > 0


def test_a_failing_publisher_does_not_hide_why_a_call_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call that fails mid-step publishes its clear on the way out; a publisher that
    raises there (closed by then, say) replaced the call's own error with its own. The
    call's error propagates now and the publisher's is logged."""
    pytest.importorskip("torch")
    from kvblocks.engine import LLM

    class Closing:
        closed = False

        def publish(self, events: object) -> None:
            if self.closed:
                raise PublisherClosedError("publish after close()")

    pub = Closing()
    llm = LLM(num_blocks=64, block_size=8, device="cpu", event_publisher=pub)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    real = llm.runner.execute

    def failing(out: object) -> object:
        pub.closed = True
        raise RuntimeError("device lost")

    llm.runner.execute = failing  # type: ignore[method-assign]
    with (
        caplog.at_level("ERROR", logger="kvblocks.engine"),
        pytest.raises(RuntimeError, match="device lost"),
    ):
        llm.generate([list(range(1, 30))], params)
    assert "cut short failed" in caplog.text and "publish after close" in caplog.text
    # A call that ends normally still reports a publisher's error.
    llm.runner.execute = real  # type: ignore[method-assign]
    with pytest.raises(PublisherClosedError):
        llm.generate([list(range(1, 30))], params)
