"""Two engines sharing a Valkey tier: B loads what A computed instead of recomputing it.

Each ``LLM`` has its own manager, device pool and host tier; both write their offloaded
blocks to one real Valkey server (write-through, so every computed block reaches it) and
read a new prompt's blocks past their own hit from it. Checked on the memory: B's device
blocks for the shared prefix hold exactly A's K/V, B computes only the last block, and its
tokens are A's and the dense reference's. A dead server or a corrupted value means
recompute, never a wrong token or a hang.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import pytest
import torch

from kvblocks.engine import LLM, LlamaForCausalLM, weights_digest
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.router import PromptHasher
from kvblocks.sampling_params import SamplingParams
from kvblocks.tiers import KVLayout
from kvblocks.tiers.codec import encode_block
from kvblocks.tiers.remote_link import PendingFetch, RemoteTierLink

from .test_host_tier_engine import BLOCK, GREEDY, POOL, TARGET, _prefix_payloads, _tokens

pytest.importorskip("valkey", reason="the valkey client is missing: pip install 'kvblocks[tiers]'")

from kvblocks.tiers.valkey_tier import ValkeyTier
from tiers.valkey_server import ServerProcess, running_server

LOADABLE = 3  # TARGET has four full blocks; the last is always computed


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with running_server() as proc:
        yield proc


@pytest.fixture(scope="module")
def expected(tiny_llama: LlamaForCausalLM) -> list[int]:
    return dense_greedy_generate(tiny_llama, [TARGET], GREEDY.max_tokens)[0]


def _layout(model: LlamaForCausalLM) -> KVLayout:
    """The tiny Llama's block layout, naming its weights (both engines run copies)."""
    cfg = model.config
    return KVLayout(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        BLOCK,
        cfg.head_dim,
        torch.float32,
        weights_digest=weights_digest(model),
    )


def _engine(model: LlamaForCausalLM, server: ServerProcess, mac_key: str | None = None) -> LLM:
    """An engine with a host tier and a remote tier on ``server``."""
    store = ValkeyTier(
        _layout(model),
        port=server.port,
        socket_timeout_s=0.5,
        retry_interval_s=30.0,
        mac_key=mac_key,
    )
    return LLM(
        model,
        num_blocks=POOL,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=16,
        host_offload="commit",
        remote_tier=store,
    )


def _fresh_model() -> LlamaForCausalLM:
    """Another copy of the tiny Llama: same seed, same weights, own tensors."""
    return build_tiny_model(tiny_config("llama"))


def _prefill(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    before = llm.scheduler.counters.num_prefill_tokens
    tokens = _tokens(llm, prompt)
    return tokens, llm.scheduler.counters.num_prefill_tokens - before


def _share(tiny_llama: LlamaForCausalLM, server: ServerProcess) -> dict[str, object]:
    """A computes TARGET, then a fresh B computes it; what both did."""
    a = _engine(tiny_llama, server)
    a_tokens, a_prefill = _prefill(a, TARGET)
    a_kv = _prefix_payloads(a, TARGET)
    b = _engine(_fresh_model(), server)
    b_tokens, b_prefill = _prefill(b, TARGET)
    return {
        "a": a,
        "b": b,
        "a_tokens": a_tokens,
        "a_prefill": a_prefill,
        "a_kv": a_kv,
        "b_tokens": b_tokens,
        "b_prefill": b_prefill,
        "b_kv": _prefix_payloads(b, TARGET),
    }


def _check_shared(run: dict[str, object], expected: list[int]) -> None:
    a, b = run["a"], run["b"]
    assert isinstance(a, LLM) and isinstance(b, LLM)
    assert run["a_tokens"] == run["b_tokens"] == expected
    assert run["a_prefill"] == len(TARGET)
    # B computes only the last block: the rest came from A through the server.
    assert run["b_prefill"] == BLOCK
    a_remote = a.stats()["remote"]
    assert a_remote["puts"] >= LOADABLE and a_remote["published_blocks"] >= LOADABLE
    b_remote = b.stats()["remote"]
    assert b_remote["hits"] == LOADABLE and b_remote["imported_blocks"] == LOADABLE
    cache = b.stats()["cache"]
    assert cache["host_imports"] == LOADABLE
    assert cache["host_loads"] == LOADABLE and cache["host_hits"] == LOADABLE * BLOCK
    assert cache["num_host_pinned_blocks"] == 0
    # The memory: B's device blocks of the prefix hold exactly the K/V A computed.
    a_kv, b_kv = run["a_kv"], run["b_kv"]
    assert isinstance(a_kv, torch.Tensor) and isinstance(b_kv, torch.Tensor)
    assert a_kv.shape == b_kv.shape == (LOADABLE, b.runner.host_layout.payload_nbytes)
    assert torch.equal(a_kv, b_kv)
    a.manager.check_invariants()
    b.manager.check_invariants()


def test_b_loads_a_prompt_a_computed(
    tiny_llama: LlamaForCausalLM, server: ServerProcess, expected: list[int]
) -> None:
    _check_shared(_share(tiny_llama, server), expected)


@pytest.mark.parametrize("broken", ["publish", "fetch", "write"])
def test_a_link_that_skips_a_step_is_caught(
    tiny_llama: LlamaForCausalLM,
    server: ServerProcess,
    expected: list[int],
    monkeypatch: pytest.MonkeyPatch,
    broken: str,
) -> None:
    """The checks above see a skipped put, a skipped import or unwritten imported rows."""
    complete = RemoteTierLink.complete
    if broken == "publish":
        monkeypatch.setattr(RemoteTierLink, "publish", lambda self, ops: None)
    elif broken == "fetch":
        monkeypatch.setattr(RemoteTierLink, "complete", lambda self, fetch: 0)
    else:

        def unwritten(self: RemoteTierLink, fetch: PendingFetch) -> int:
            n = complete(self, fetch)
            self.host_pool.zero_()
            return n

        monkeypatch.setattr(RemoteTierLink, "complete", unwritten)
    with pytest.raises(AssertionError):
        _check_shared(_share(tiny_llama, server), expected)


@pytest.mark.parametrize(
    ("priority", "flood_priority", "kept"), [(None, 10, True), (0, 10, False), (80, None, True)]
)
def test_imports_keep_the_requests_retention_priority(
    tiny_llama: LlamaForCausalLM,
    server: ServerProcess,
    priority: int | None,
    flood_priority: int | None,
    kept: bool,
) -> None:
    """B's blocks read from the store enter its host tier at B's request's priority
    (a claim only ever raises a block's priority): a flood of imports at
    ``flood_priority`` then evicts them exactly when that is not below theirs."""
    a = _engine(tiny_llama, server)
    _tokens(a, TARGET)
    b = _engine(_fresh_model(), server)
    params = SamplingParams(max_tokens=2, temperature=0.0, retention_priority=priority)
    b.generate([TARGET], params)
    assert b.stats()["remote"]["imported_blocks"] == LOADABLE
    m = b.manager
    slots = list(range(m.host_cache_blocks))
    hasher = PromptHasher(m.block_size, hash_algo=m.hash_algo)
    prefix = list(hasher.block_hashes(TARGET))[:LOADABLE]
    assert set(prefix) <= set(m.tier_slot_hashes(slots))
    flood = [bytes([i]) * len(prefix[0]) for i in range(m.host_cache_blocks)]
    m.import_tier_blocks(flood, retention_priority=flood_priority)
    m.confirm_memory_ops()
    m.check_invariants()
    held = set(m.tier_slot_hashes(slots))
    assert (set(prefix) <= held) == kept, (priority, held)
    assert set(prefix).isdisjoint(held) != kept


def test_a_dead_server_means_recompute(
    tiny_llama: LlamaForCausalLM, server: ServerProcess, expected: list[int]
) -> None:
    a = _engine(tiny_llama, server)
    assert _tokens(a, TARGET) == expected
    b = _engine(_fresh_model(), server)
    server.kill()
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, prefill = _prefill(b, TARGET)
        # Further calls while it is down neither hang nor warn again.
        assert _tokens(b, TARGET) == expected
    # A hang guard, not a speed claim: each command gives up after 0.5 s.
    assert time.monotonic() - start < 60
    assert tokens == expected
    assert prefill == len(TARGET)
    unreachable = [w for w in caught if "unreachable" in str(w.message)]
    assert len(unreachable) == 1, [str(w.message) for w in caught]
    remote = b.stats()["remote"]
    assert remote["imported_blocks"] == 0 and remote["hits"] == 0
    assert remote["errors"] >= 1
    b.manager.check_invariants()


def test_a_corrupted_value_is_rejected_never_loaded(
    tiny_llama: LlamaForCausalLM, server: ServerProcess, expected: list[int]
) -> None:
    a = _engine(tiny_llama, server)
    assert _tokens(a, TARGET) == expected
    assert a.remote is not None
    store = a.remote.store
    assert isinstance(store, ValkeyTier)
    hashes = PromptHasher(BLOCK).block_hashes(TARGET)
    key = store.key_of(hashes[1])  # type: ignore[arg-type]
    value = bytearray(store.client.get(key))
    value[-1] ^= 0xFF  # one payload byte of the second block
    store.client.set(key, bytes(value))
    b = _engine(_fresh_model(), server)
    tokens, prefill = _prefill(b, TARGET)
    assert tokens == expected
    # Block 0 is loaded; block 1 is rejected, so it and block 2 are recomputed.
    assert prefill == len(TARGET) - BLOCK
    remote = b.stats()["remote"]
    assert remote["rejected"] == 1 and remote["imported_blocks"] == 1
    assert b.stats()["cache"]["host_loads"] == 1
    b.manager.check_invariants()


@pytest.mark.parametrize("key", [None, "a-shared-secret"])
def test_a_forged_record_with_a_valid_crc_is_loaded_only_without_a_key(
    tiny_llama: LlamaForCausalLM, server: ServerProcess, expected: list[int], key: str | None
) -> None:
    """Issue 16.2: whoever can write to the server re-encodes block 1 with an all-zero
    payload and a valid CRC. With a key, B rejects it (counted) and computes it; without
    one, B loads it and its tokens change: the trust boundary the README states."""
    a = _engine(tiny_llama, server, key)
    assert _tokens(a, TARGET) == expected
    assert a.remote is not None
    store = a.remote.store
    assert isinstance(store, ValkeyTier)
    hashes = PromptHasher(BLOCK).block_hashes(TARGET)
    zeros = torch.zeros(store.layout.payload_nbytes, dtype=torch.uint8)
    forged = encode_block(store.layout, hashes[1], zeros)  # type: ignore[arg-type]
    store.client.set(store.key_of(hashes[1]), forged)  # type: ignore[arg-type]
    b = _engine(_fresh_model(), server, key)
    tokens, prefill = _prefill(b, TARGET)
    remote = b.stats()["remote"]
    if key is None:
        assert remote["imported_blocks"] == LOADABLE and remote["rejected"] == 0
        assert tokens != expected  # the planted KV was attended to
        return
    assert tokens == expected
    # Block 0 is loaded; block 1 is refused, so it and block 2 are computed.
    assert prefill == len(TARGET) - BLOCK
    assert remote["imported_blocks"] == 1
    assert remote["rejected"] == 1 and remote["unauthenticated"] == 1
    b.manager.check_invariants()


def test_remote_tier_argument_is_checked(
    tiny_llama: LlamaForCausalLM, server: ServerProcess
) -> None:
    store = ValkeyTier(_layout(tiny_llama), port=server.port)
    with pytest.raises(InvalidArgumentError, match="host_cache_blocks"):
        LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0, remote_tier=store)
    with pytest.raises(InvalidArgumentError, match="TierStore"):
        LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, host_cache_blocks=4, remote_tier=1)
    other = ValkeyTier(
        KVLayout(1, 1, BLOCK, 8, torch.float32, "x", trust_model_id=True), port=server.port
    )
    with pytest.raises(InvalidArgumentError, match="layout"):
        LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, host_cache_blocks=4, remote_tier=other)
    llm = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, host_cache_blocks=4, remote_tier=store)
    assert llm.remote is not None and llm.remote.store is store


def test_manager_import_api_rejects_bad_input(tiny_llama: LlamaForCausalLM) -> None:
    llm = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, host_cache_blocks=4)
    m = llm.manager
    before = dict(m.stats())
    for bad in [[b"x" * 16], [b"x" * 33], ["a" * 32], b"x" * 32, [1]]:
        with pytest.raises((InvalidArgumentError, TypeError)):
            m.import_tier_blocks(bad)  # type: ignore[arg-type]
    assert dict(m.stats()) == before
    assert m.num_cached_prefix_blocks([b"x" * 32, b"y"]) == 0
    assert m.tier_slot_hashes([0, -1, 10**6]) == [None, None, None]
    for bad_priority in [-1, 101, 1.5, "80", True]:
        with pytest.raises(InvalidArgumentError, match="retention_priority"):
            m.import_tier_blocks([b"x" * 32], retention_priority=bad_priority)  # type: ignore[arg-type]
    assert dict(m.stats()) == before
    slots = m.import_tier_blocks([b"x" * 32, b"x" * 32])
    assert slots.tolist() == [0, -1]
    assert m.tier_slot_hashes(slots[:1]) == [b"x" * 32]
    m.confirm_memory_ops()
    assert m.num_cached_prefix_blocks([b"x" * 32]) == 1
    m.check_invariants()
