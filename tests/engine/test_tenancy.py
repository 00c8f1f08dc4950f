"""Tenancy through the engine: a cache salt and a LoRA id per prompt (vLLM's prompt dict).

Two prompts of one salt (or one LoRA id) share their prefix blocks; two of different salts
never do, neither in the engine's own cache (the KV events of each salt name disjoint
blocks, and the second computes its whole prompt) nor through a shared tier (nothing is
imported across salts). Tokens are those of the same prompt without any salt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvblocks import BlockStored
from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.errors import InvalidArgumentError
from kvblocks.router import PromptHasher
from kvblocks.tiers import DiskTier, KVLayout

from .test_host_tier_engine import BLOCK, GREEDY, POOL, TARGET, _tokens

FULL = len(TARGET) // BLOCK  # four full blocks
LOADABLE = FULL - 1  # the last block is always computed


class _Events:
    """An event publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.stored: list[bytes] = []

    def publish(self, events: Sequence[Any]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored.extend(ev.block_hashes)

    def take(self) -> set[bytes]:
        taken, self.stored = set(self.stored), []
        return taken


def _prompt(salt: str | None = None, lora_id: int | None = None) -> dict[str, Any]:
    return {"prompt_token_ids": TARGET, "cache_salt": salt, "lora_id": lora_id}


@pytest.fixture(scope="module")
def alone(tiny_llama: LlamaForCausalLM) -> list[int]:
    return _tokens(LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0), TARGET)


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        (_prompt("tenant-a"), _prompt("tenant-b"), False),
        (_prompt("tenant-a"), _prompt(None), False),
        (_prompt("tenant-a"), _prompt("tenant-a"), True),
        (_prompt(lora_id=1), _prompt(lora_id=2), False),
        (_prompt(lora_id=1), _prompt(None), False),
        (_prompt("s", lora_id=1), _prompt("s", lora_id=2), False),
        (_prompt("s", lora_id=1), _prompt("s", lora_id=1), True),
        ({"prompt_token_ids": TARGET}, TARGET, True),  # a dict without keys is the plain prompt
    ],
)
def test_namespaces_share_only_within_themselves(
    tiny_llama: LlamaForCausalLM, alone: list[int], first: Any, second: Any, shared: bool
) -> None:
    events = _Events()
    llm = LLM(tiny_llama, num_blocks=64, block_size=BLOCK, num_cpu_blocks=0, event_publisher=events)
    (a,) = llm.generate([first], GREEDY)
    a_blocks = events.take()
    (b,) = llm.generate([second], GREEDY)
    b_blocks = events.take()
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == alone
    assert a.num_cached_tokens == 0 and len(a_blocks) >= FULL
    if shared:
        assert b.num_cached_tokens == LOADABLE * BLOCK
    else:
        # B computed its whole prompt and stored blocks of its own: none is one of A's.
        assert b.num_cached_tokens == 0
        assert len(b_blocks) >= FULL and a_blocks.isdisjoint(b_blocks)
    llm.manager.check_invariants()


def test_salts_in_one_call_never_share(tiny_llama: LlamaForCausalLM, alone: list[int]) -> None:
    """Three requests of one call, admitted together: the two of salt "x" share (the second
    waits one step for the first's blocks), the one of salt "y" shares nothing."""
    events = _Events()
    llm = LLM(tiny_llama, num_blocks=64, block_size=BLOCK, num_cpu_blocks=0, event_publisher=events)
    outs = llm.generate([_prompt("x"), _prompt("y"), _prompt("x")], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [alone] * 3
    assert [o.num_cached_tokens for o in outs] == [0, 0, LOADABLE * BLOCK]
    hasher = PromptHasher(BLOCK)
    x, y = (set(hasher.block_hashes(TARGET, cache_salt=s)) for s in ("x", "y"))  # type: ignore[arg-type]
    assert x | y <= events.take() and x.isdisjoint(y)


@pytest.fixture(params=["disk", "valkey"])
def shared_tier(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[KVLayout], Any]]:
    """One store for the engines of a test: a DiskTier directory or a real Valkey server."""
    opened: dict[KVLayout, Any] = {}
    if request.param == "disk":

        def disk(layout: KVLayout) -> Any:
            if layout not in opened:
                opened[layout] = DiskTier(tmp_path, layout, 64)
            return opened[layout]

        yield disk
        return
    pytest.importorskip("valkey")
    from kvblocks.tiers.valkey_tier import ValkeyTier
    from tiers.valkey_server import running_server

    with running_server() as server:
        yield lambda layout: ValkeyTier(layout, port=server.port)


def test_two_salts_never_share_through_a_tier(
    tiny_llama: LlamaForCausalLM, alone: list[int], shared_tier: Callable[[KVLayout], Any]
) -> None:
    def engine() -> LLM:
        return LLM(
            tiny_llama,
            num_blocks=POOL,
            block_size=BLOCK,
            num_cpu_blocks=0,
            host_cache_blocks=16,
            host_offload="commit",
            remote_tier=shared_tier,
        )

    a = engine()
    assert a.generate([_prompt("tenant-a")], GREEDY)[0].outputs[0].token_ids == alone
    assert a.stats()["remote"]["published_blocks"] >= LOADABLE
    for other in (_prompt("tenant-b"), _prompt(None), _prompt("tenant-a", lora_id=3)):
        b = engine()
        assert b.generate([other], GREEDY)[0].outputs[0].token_ids == alone
        assert b.stats()["remote"]["imported_blocks"] == 0, other
        assert b.stats()["remote"]["hits"] == 0
    same = engine()
    (out,) = same.generate([_prompt("tenant-a")], GREEDY)
    assert out.outputs[0].token_ids == alone
    assert same.stats()["remote"]["imported_blocks"] == LOADABLE
    assert out.num_cached_tokens == LOADABLE * BLOCK


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt_token_ids": TARGET, "salt": "x"}, "unknown prompt keys"),
        ({"cache_salt": "x"}, "exactly one of"),
        ({"prompt": "hi", "prompt_token_ids": TARGET}, "exactly one of"),
        ({"prompt": 5}, "'prompt' must be a str"),
        ({"prompt_token_ids": TARGET, "cache_salt": 5}, "cache_salt"),
        ({"prompt_token_ids": TARGET, "cache_salt": b"\xff"}, "UTF-8"),
        ({"prompt_token_ids": TARGET, "lora_id": -1}, "lora_id"),
        ({"prompt_token_ids": TARGET, "lora_id": True}, "lora_id"),
        ({"prompt_token_ids": TARGET, "lora_id": "1"}, "lora_id"),
    ],
)
def test_a_bad_prompt_dict_is_refused_before_anything_is_queued(
    tiny_llama: LlamaForCausalLM, alone: list[int], prompt: dict[str, Any], message: str
) -> None:
    llm = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0)
    with pytest.raises(InvalidArgumentError, match=message):
        llm.generate([_prompt("ok"), prompt], GREEDY)
    assert not llm.scheduler.has_unfinished_requests()
    assert llm.generate([_prompt("ok")], GREEDY)[0].outputs[0].token_ids == alone
