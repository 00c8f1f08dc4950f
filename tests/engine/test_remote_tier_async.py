"""The remote tier off the step path, and re-probed for requests preempted by recompute.

Real parts only: a real Valkey server (killed or stopped mid-run), real disk directories,
the tiny model on CPU. Checked on tokens (against an engine without any tier) and on
memory (the K/V a second engine loads is the K/V the first computed), plus the counters
that say what was loaded, queued, dropped or timed out.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvblocks.engine import LLM, LlamaForCausalLM, weights_digest
from kvblocks.engine.tiny import build_tiny_model
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams
from kvblocks.tiers import DiskTier, KVLayout, RemoteTierOptions
from kvblocks.tiers.codec import Payload
from kvblocks.tiers.remote_admission import RemoteAdmission

from .test_host_tier_engine import BLOCK, GREEDY, POOL, TARGET, _prefix_payloads, _tokens
from .test_llm import _prompt

pytest.importorskip("valkey", reason="the valkey client is missing: pip install 'kvblocks[tiers]'")

from kvblocks.tiers.valkey_tier import ValkeyTier
from tiers.valkey_server import ServerProcess, running_server

SYNC = RemoteTierOptions(async_io=False)
LAYOUT = KVLayout(2, 2, BLOCK, 64, torch.float32, weights_digest=weights_digest(build_tiny_model()))
# Three requests whose decodes outgrow a 9-block pool: recompute preemption.
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
CROWD = [[(7 * i + j) % 250 + 1 for j in range(40)] for i in range(3)]
OTHERS = [_prompt(4 * BLOCK, 10 + i) for i in range(3)]


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    # Closing kills with SIGCONT first, so a test that paused the server still ends it.
    with running_server() as proc:
        yield proc


def _valkey(server: ServerProcess) -> ValkeyTier:
    return ValkeyTier(LAYOUT, port=server.port, socket_timeout_s=0.5, retry_interval_s=30.0)


def _engine(
    model: LlamaForCausalLM,
    store: object,
    options: RemoteTierOptions | None = None,
    **kwargs: object,
) -> LLM:
    settings: dict[str, object] = {
        "num_blocks": POOL,
        "block_size": BLOCK,
        "num_cpu_blocks": 0,
        "host_cache_blocks": 16,
        "host_offload": "commit",
        **kwargs,
    }
    return LLM(model, remote_tier=store, remote_tier_options=options, **settings)  # type: ignore[arg-type]


def _plain(
    model: LlamaForCausalLM, prompts: Sequence[list[int]], params: SamplingParams, **kwargs: object
) -> list[list[int]]:
    """Tokens of an engine without any tier."""
    llm = LLM(model, block_size=BLOCK, num_cpu_blocks=0, **kwargs)  # type: ignore[arg-type]
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), params)]


def _generate(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), params)]


def _digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.numpy().tobytes()).hexdigest()


# -- re-admission after recompute preemption ----------------------------------------------
@pytest.mark.parametrize("refetch", [True, False])
def test_a_readmitted_request_loads_its_blocks_from_the_store(
    tiny_llama: LlamaForCausalLM,
    server: ServerProcess,
    monkeypatch: pytest.MonkeyPatch,
    refetch: bool,
) -> None:
    """A request preempted by recompute lost its blocks on the device and in the small
    host tier while it waited; write-through had put them in Valkey, and the probe before
    its re-admission imports them: it loads them instead of recomputing them. Without
    the probe (``refetch=False``, the engine as it was) the checks fail."""
    pool: dict[str, Any] = {"num_blocks": 10, "preemption_mode": "recompute"}
    want = _plain(tiny_llama, CROWD, LONG, **pool)
    if not refetch:
        monkeypatch.setattr(RemoteAdmission, "refetch", lambda self, still_waiting: None)
    llm = _engine(tiny_llama, _valkey(server), SYNC, host_cache_blocks=6, **pool)
    got = _generate(llm, CROWD, LONG)
    stats = llm.stats()

    def check() -> None:
        assert got == want
        assert llm.scheduler.counters.num_preemptions_recompute >= 1
        remote = stats["remote"]
        # Nothing came from the store at first admission (it was empty): every import
        # is a re-admission's, and each imported block was loaded, not recomputed.
        assert remote["refetches"] >= 1
        assert remote["refetched_blocks"] == remote["imported_blocks"] == 2
        assert stats["cache"]["host_loads"] >= remote["refetched_blocks"]
        plain = LLM(tiny_llama, block_size=BLOCK, num_cpu_blocks=0, **pool)  # type: ignore[arg-type]
        plain.generate(CROWD, LONG)
        saved = (
            plain.scheduler.counters.num_prefill_tokens - stats["scheduler"]["num_prefill_tokens"]
        )
        assert saved >= remote["refetched_blocks"] * BLOCK
        llm.manager.check_invariants()

    if refetch:
        check()
    else:
        with pytest.raises(AssertionError):
            check()
    assert llm.close()


def test_readmission_with_background_io_keeps_the_tokens(
    tiny_llama: LlamaForCausalLM, server: ServerProcess
) -> None:
    pool: dict[str, Any] = {"num_blocks": 10, "preemption_mode": "recompute"}
    want = _plain(tiny_llama, CROWD, LONG, **pool)
    with _engine(tiny_llama, _valkey(server), host_cache_blocks=6, **pool) as llm:
        assert _generate(llm, CROWD, LONG) == want
        assert llm.scheduler.counters.num_preemptions_recompute >= 1
        assert llm.stats()["remote"]["worker_errors"] == 0
        llm.manager.check_invariants()


# -- background I/O ------------------------------------------------------------------------
@pytest.mark.parametrize("options", [SYNC, RemoteTierOptions()], ids=["sync", "async"])
def test_background_io_shares_the_same_blocks_and_tokens(
    tiny_llama: LlamaForCausalLM, server: ServerProcess, options: RemoteTierOptions
) -> None:
    want = _plain(tiny_llama, [TARGET], GREEDY, num_blocks=POOL)
    a = _engine(tiny_llama, _valkey(server), options)
    a_tokens = _tokens(a, TARGET)
    a_kv = _prefix_payloads(a, TARGET)[:3]
    # generate() returns once its writes reached the store: B sees all of them.
    assert a.stats()["remote"]["published_blocks"] >= 3
    b = _engine(tiny_llama, _valkey(server), options)
    before = b.scheduler.counters.num_prefill_tokens
    assert a_tokens == _tokens(b, TARGET) == want[0]
    assert b.scheduler.counters.num_prefill_tokens - before == BLOCK
    assert b.stats()["remote"]["imported_blocks"] == 3
    assert _digest(_prefix_payloads(b, TARGET)[:3]) == _digest(a_kv)
    for llm in (a, b):
        assert llm.stats()["remote"]["dropped_writes"] == 0
        assert llm.close()


class _GatedDisk(DiskTier):
    """A disk tier whose writes wait for the test to open a gate: the step thread runs
    as far ahead of them as the test wants."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()

    def put_many(
        self, block_hashes: Sequence[bytes], kvs: Sequence[Payload], *, priority: int = 0
    ) -> int:
        self.gate.wait(60.0)
        return super().put_many(block_hashes, kvs, priority=priority)


def test_queued_writes_are_staged_copies_of_the_host_rows(
    tiny_llama: LlamaForCausalLM, tmp_path: Path
) -> None:
    """Every write waits while the host tier's four slots are rewritten many times over:
    what reaches the store must still be the K/V each block had when it was offloaded
    (a queued reference to the slot would store whatever the slot holds later)."""
    slow = _GatedDisk(tmp_path, LAYOUT, 1000)
    # close_timeout_s=0: generate() does not wait for its writes, so they lag across calls.
    lagging = RemoteTierOptions(max_pending_write_blocks=1000, close_timeout_s=0.0)
    a = _engine(tiny_llama, slow, lagging, host_cache_blocks=4)
    _tokens(a, TARGET)
    a_kv = _prefix_payloads(a, TARGET)[:3]
    for other in OTHERS:
        _tokens(a, other)
    assert a.stats()["remote"]["published_blocks"] == 0  # all queued behind the gate
    assert a.stats()["cache"]["host_evictions"] >= 4 * len(OTHERS)  # slots were reused
    slow.gate.set()
    assert a.close(timeout=60.0)
    assert a.stats()["remote"]["published_blocks"] == 4 * (1 + len(OTHERS))
    assert a.stats()["remote"]["dropped_writes"] == 0
    slow.close()
    b = _engine(tiny_llama, DiskTier(tmp_path, LAYOUT, 1000), SYNC)
    before = b.scheduler.counters.num_prefill_tokens
    assert _tokens(b, TARGET) == _plain(tiny_llama, [TARGET], GREEDY, num_blocks=POOL)[0]
    assert b.scheduler.counters.num_prefill_tokens - before == BLOCK
    assert _digest(_prefix_payloads(b, TARGET)[:3]) == _digest(a_kv)


def test_a_server_killed_mid_run_means_recompute_nothing_lost(
    tiny_llama: LlamaForCausalLM, server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = [TARGET, *OTHERS]
    want = _plain(tiny_llama, prompts, GREEDY, num_blocks=POOL)
    llm = _engine(tiny_llama, _valkey(server))
    start = time.monotonic()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvblocks.tiers"):
        final = {}
        for i, out in enumerate(llm.generate(prompts, GREEDY, stream=True)):
            if i == 2:
                server.kill()
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        again = _tokens(llm, TARGET)  # a call with the server gone: misses, recompute
        closed = llm.close(timeout=5.0)
    # A hang guard, not a speed claim: every store command gives up after 0.5 s.
    assert time.monotonic() - start < 60
    assert [final[str(i)] for i in range(len(prompts))] == want
    assert again == want[0]
    assert closed
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("unreachable" in m for m in logged), logged
    remote = llm.stats()["remote"]
    assert remote["errors"] >= 1 and remote["worker_errors"] == 0
    llm.manager.check_invariants()


def test_a_hung_server_drops_writes_and_times_out_reads(
    tiny_llama: LlamaForCausalLM, server: ServerProcess
) -> None:
    """A stopped server: writes beyond the queue bound are dropped (counted), a read not
    back within ``fetch_wait_s`` means recompute, and close() returns in bounded time."""
    want = _plain(tiny_llama, [TARGET, *OTHERS], GREEDY, num_blocks=POOL)
    store = ValkeyTier(LAYOUT, port=server.port, socket_timeout_s=2.0, retry_interval_s=30.0)
    options = RemoteTierOptions(max_pending_write_blocks=1, fetch_wait_s=0.2, close_timeout_s=1.0)
    llm = _engine(tiny_llama, store, options)
    server.pause()
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _generate(llm, [TARGET, *OTHERS], GREEDY)
        llm.close()
    assert time.monotonic() - start < 60  # a hang guard
    assert got == want
    remote = llm.stats()["remote"]
    assert remote["dropped_writes"] >= 1
    assert remote["fetch_timeouts"] >= 1 and remote["imported_blocks"] == 0
    llm.manager.check_invariants()


# A process whose engine's write is still under way when it exits (close_timeout_s=0:
# close() does not wait); the write frees tensors the whole time.
_EXIT_MID_WRITE = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    from kvblocks.engine import LLM
    from kvblocks.sampling_params import SamplingParams
    from kvblocks.tiers import DiskTier, RemoteTierOptions

    started = threading.Event()

    class Busy(DiskTier):
        def put_many(self, hashes, kvs, *, priority=0):
            started.set()
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                torch.empty(16)  # freeing a tensor releases and retakes the GIL
            return super().put_many(hashes, kvs, priority=priority)

    llm = LLM(block_size=16, num_blocks=12, device="cpu", host_cache_blocks=8,
              host_offload="commit", remote_tier=lambda layout: Busy(sys.argv[1], layout, 64),
              remote_tier_options=RemoteTierOptions(close_timeout_s=0.0))
    llm.generate([list(range(1, 34))], SamplingParams(max_tokens=1, temperature=0.0))
    assert started.wait(60)
    assert not llm.close()  # the write is still under way
    """
)


@pytest.mark.slow  # a real process killed mid-write (~5 s)
def test_a_process_exiting_mid_write_exits_cleanly(tmp_path: Path) -> None:
    """The worker thread still in a store call when the interpreter exits: the exit must
    not abort the process (a daemon thread taking the GIL back during finalization is
    ended inside torch's C++ code: std::terminate, exit status 134)."""
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_MID_WRITE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_remote_tier_options_are_checked(tiny_llama: LlamaForCausalLM, tmp_path: Path) -> None:
    for bad in [
        {"async_io": 1},
        {"max_pending_write_blocks": 0},
        {"max_pending_write_blocks": True},
        {"fetch_wait_s": -1.0},
        {"close_timeout_s": float("nan")},
    ]:
        with pytest.raises(InvalidArgumentError):
            RemoteTierOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="RemoteTierOptions"):
        _engine(tiny_llama, DiskTier(tmp_path, LAYOUT, 8), {"async_io": False})  # type: ignore[arg-type]


# A held beam search's record has its n completions, as a scheduled one's (all empty).
@pytest.mark.parametrize(
    "held",
    [GREEDY, pytest.param(SamplingParams(max_tokens=4, beam_width=3, n=2), marks=pytest.mark.slow)],
    ids=["greedy", "beam"],
)
def test_a_request_held_for_its_prefetch_can_be_aborted(
    tiny_llama: LlamaForCausalLM, tmp_path: Path, held: SamplingParams
) -> None:
    """Reads that never come back (a gated store): a request with blocks to read waits
    outside the scheduler while another runs, and aborting it ends it at once."""
    store = _GatedDisk(tmp_path, LAYOUT, 100)
    reads = store.get_many

    def gated_get_many(block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        store.gate.wait(60.0)
        return reads(block_hashes)

    store.get_many = gated_get_many  # type: ignore[method-assign]
    short = TARGET[: BLOCK - 1]  # no full block before its last token: nothing to read
    # The end of generate() waits close_timeout_s for request "0"'s writes, which the gate
    # holds too: half a second of that wait (the default's 5 s was most of this test).
    llm = _engine(tiny_llama, store, RemoteTierOptions(fetch_wait_s=30.0, close_timeout_s=0.5))
    final = {}
    aborted = False
    for out in llm.generate([short, TARGET], [GREEDY, held], stream=True):
        if not aborted:
            assert out.request_id == "0"  # "1" is held: its read is behind the gate
            assert llm.abort_request("1") is not None
            aborted = True
        if out.finished:
            final[out.request_id] = out.outputs[0]
            if out.request_id == "1":
                assert [c.index for c in out.outputs] == list(range(held.n))
                assert all(c.finish_reason == "abort" and not c.token_ids for c in out.outputs)
    assert final["1"].finish_reason == "abort" and final["1"].token_ids == []
    assert final["0"].token_ids == _plain(tiny_llama, [short], GREEDY, num_blocks=POOL)[0]
    assert llm.stats()["remote"]["imported_blocks"] == 0
    # Issue 17.2: the held request never reaches the scheduler (it was added only to be
    # aborted there).
    scheduler = llm.stats()["scheduler"]
    assert scheduler["num_requests_added"] == 1 and scheduler["num_requests_aborted"] == 0
    store.gate.set()
    assert llm.close(timeout=10.0)
    llm.manager.check_invariants()
