"""The host tier in the engine: evicted prefix blocks come back by loads, not recompute.

On CPU with the tiny model and a device pool too small to keep one prompt cached while
others run: the prompt is computed, pushed out of the pool by other prompts (into the
host tier), then asked again. The second run must load its prefix (``host_loads``),
compute fewer prefill tokens than an engine without the tier, produce the dense
reference's tokens, and leave in the device blocks exactly the K/V the first run wrote.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvblocks.cli import main
from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.runner import ModelRunner
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams
from kvblocks.tiers.transfer import gather_blocks

from .test_llm import _prompt

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
BLOCK = 16
TARGET = _prompt(4 * BLOCK, 1)  # four full blocks: three can be loaded, the last recomputed
OTHERS = [_prompt(4 * BLOCK, 10 + i) for i in range(3)]
POOL = 12  # 11 usable blocks: one 68-token sequence takes 5, so each prompt evicts earlier ones

SEQ_PROBE = 1 << 40  # a sequence id the scheduler never uses


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY)[0].outputs[0].token_ids


def _prefix_payloads(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The device K/V payloads of ``prompt``'s full cached blocks (a probe sequence).

    The probe claims the cached prefix, reads its blocks and is freed again; it runs
    between two generate calls, when no step is in flight.
    """
    manager = llm.manager
    manager.add_sequence(SEQ_PROBE, prompt)
    try:
        # Tier hits would become device blocks only through loads the probe never applies.
        assert manager.num_tier_tokens(SEQ_PROBE) == 0, "the prefix should be on the device"
        cached = manager.num_cached_tokens(SEQ_PROBE) // BLOCK
        assert manager.allocate_slots(SEQ_PROBE, 0) is not None  # claims the prefix only
        if manager.host_cache_blocks:
            assert manager.take_memory_ops() == []
        blocks = manager.block_table(SEQ_PROBE).tolist()
        assert len(blocks) == cached
        return gather_blocks(llm.runner.host_layout, llm.runner.kv_caches, blocks)
    finally:
        manager.free(SEQ_PROBE)


def _evict_and_reload(llm: LLM) -> tuple[list[int], list[int], int, torch.Tensor]:
    """Run TARGET, the others, TARGET again: (first tokens, second tokens, the second run's
    prefill tokens, the K/V of TARGET's cached blocks after the first run)."""
    first = _tokens(llm, TARGET)
    written = _prefix_payloads(llm, TARGET)
    for other in OTHERS:
        _tokens(llm, other)
    before = llm.scheduler.counters.num_prefill_tokens
    second = _tokens(llm, TARGET)
    return first, second, llm.scheduler.counters.num_prefill_tokens - before, written


@pytest.fixture(scope="module")
def expected(tiny_llama: LlamaForCausalLM) -> list[int]:
    return dense_greedy_generate(tiny_llama, [TARGET], GREEDY.max_tokens)[0]


@pytest.fixture(scope="module")
def without_tier(tiny_llama: LlamaForCausalLM) -> tuple[list[int], list[int], int]:
    llm = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0)
    first, second, prefill, _ = _evict_and_reload(llm)
    assert llm.manager.host_cache_blocks == 0
    return first, second, prefill


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_evicted_prefix_is_loaded_from_the_host_tier(
    tiny_llama: LlamaForCausalLM,
    expected: list[int],
    without_tier: tuple[list[int], list[int], int],
    policy: str,
) -> None:
    llm = LLM(
        tiny_llama,
        num_blocks=POOL,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=16,
        host_offload=policy,  # type: ignore[arg-type]
    )
    assert llm.runner.host_pool is not None and llm.runner.host_pool.shape[0] == 16
    first, second, prefill, written = _evict_and_reload(llm)
    assert first == second == expected
    assert without_tier[0] == without_tier[1] == expected
    # Without the tier the whole prompt is recomputed; with it only the last block.
    assert without_tier[2] == len(TARGET)
    assert prefill == BLOCK < without_tier[2]
    cache = llm.stats()["cache"]
    assert cache["host_loads"] == 3
    assert cache["host_hits"] == 3 * BLOCK
    assert cache["host_offloads"] > 0
    assert cache["num_host_pinned_blocks"] == 0  # every op confirmed
    # The loaded device blocks hold exactly what the first run wrote there.
    reloaded = _prefix_payloads(llm, TARGET)
    assert reloaded.shape == written.shape == (3, llm.runner.host_layout.payload_nbytes)
    assert torch.equal(reloaded, written)
    llm.manager.check_invariants()


@pytest.mark.parametrize("skipped", ["offload", "load"])
def test_a_runner_that_skips_a_tier_copy_is_caught(
    tiny_llama: LlamaForCausalLM,
    monkeypatch: pytest.MonkeyPatch,
    skipped: str,
) -> None:
    """The checks above see a missing copy (this file's own sanity check)."""
    apply = ModelRunner._tier_copy

    def broken(self: ModelRunner, kind: str, pairs) -> None:
        if kind != skipped:
            apply(self, kind, pairs)

    monkeypatch.setattr(ModelRunner, "_tier_copy", broken)
    llm = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0, host_cache_blocks=16)
    _first, _second, _prefill, written = _evict_and_reload(llm)
    assert llm.stats()["cache"]["host_loads"] == 3
    # The memory check sees it even where four greedy tokens of the tiny model happen
    # to survive zeroed or stale K/V.
    assert not torch.equal(_prefix_payloads(llm, TARGET), written)


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_a_full_host_tier_evicts_and_never_fails_a_request(
    tiny_llama: LlamaForCausalLM, policy: str
) -> None:
    prompts = [TARGET, *OTHERS, TARGET, *OTHERS[:1]]
    want = dense_greedy_generate(tiny_llama, prompts, GREEDY.max_tokens)
    llm = LLM(
        tiny_llama,
        num_blocks=POOL,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=2,
        host_offload=policy,  # type: ignore[arg-type]
        max_num_seqs=2,
    )
    got = [_tokens(llm, p) for p in prompts]
    got += [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want + want
    cache = llm.stats()["cache"]
    assert cache["host_evictions"] > 0
    assert cache["num_host_cached_blocks"] <= 2
    llm.manager.check_invariants()


def test_tier_options_are_checked(tiny_llama: LlamaForCausalLM) -> None:
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching"):
        LLM(tiny_llama, num_blocks=8, enable_prefix_caching=False, host_cache_blocks=4)
    with pytest.raises((InvalidArgumentError, ValueError, TypeError)):
        LLM(tiny_llama, num_blocks=8, host_cache_blocks=4, host_offload="later")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="host_cache_blocks"):
        ModelRunner(tiny_llama, num_blocks=8, block_size=BLOCK, host_cache_blocks=-1)


def test_a_runner_without_a_pool_rejects_tier_ops(tiny_llama: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, num_blocks=8, block_size=BLOCK)
    assert runner.host_pool is None
    # apply_memory_ops reads only the op list of the step's output.
    out = SimpleNamespace(memory_ops=[("load", np.array([[0, 1]], dtype=np.int64))])
    with pytest.raises(InvalidArgumentError, match="host pool"):
        runner.apply_memory_ops(out)  # type: ignore[arg-type]


def test_generate_cli_host_cache_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    """One call: the last prompt repeats the first after the others pushed it out."""
    ids = [",".join(map(str, p)) for p in [TARGET, *OTHERS, TARGET]]
    argv = ["generate", "--max-tokens", "2", "--num-blocks", str(POOL), "--device", "cpu"]
    argv += ["--host-cache-blocks", "16", "--max-num-seqs", "1", "--json"]
    for p in ids:
        argv += ["--prompt-ids", p]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["cache"]["host_loads"] == 3
    outs = [o["completions"][0]["token_ids"] for o in doc["outputs"]]
    assert outs[0] == outs[-1]


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_a_step_that_fails_before_its_offloads_leaves_no_unwritten_slot(
    tiny_llama: LlamaForCausalLM, expected: list[int], policy: str
) -> None:
    """A step cut short after schedule() (its offloads never ran) is abandoned: the
    tier slots it named must not become prefix hits that load unwritten bytes."""
    llm = LLM(
        tiny_llama,
        num_blocks=POOL,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=16,
        host_offload=policy,  # type: ignore[arg-type]
    )
    execute = llm.runner.execute
    failed: list[str] = []
    armed = False

    def failing(out):  # type: ignore[no-untyped-def]
        if armed and not failed and any(kind == "offload" for kind, _ in out.memory_ops):
            failed.append("offload")
            raise RuntimeError("device lost")
        return execute(out)

    llm.runner.execute = failing  # type: ignore[method-assign]
    _tokens(llm, TARGET)
    armed = True
    with pytest.raises(RuntimeError, match="device lost"):
        for other in OTHERS:
            _tokens(llm, other)
    assert failed
    assert llm.stats()["cache"]["num_host_pinned_blocks"] == 0
    written = []
    for prompt in [TARGET, *OTHERS, TARGET]:
        _tokens(llm, prompt)
        if prompt is TARGET and not written:
            written.append(_prefix_payloads(llm, TARGET))
    assert _tokens(llm, TARGET) == expected
    assert torch.equal(_prefix_payloads(llm, TARGET), written[0])
    llm.manager.check_invariants()


def test_write_through_offloads_of_the_last_step_are_applied_before_generate_returns(
    tiny_llama: LlamaForCausalLM,
) -> None:
    """The last step's commit queues the offload of a block it filled; no later step would
    carry it, so the call applies it: the tier holds the block, no slot stays pinned."""
    prompt = _prompt(20, 5)
    # 20 + 12 computed tokens fill block 1 in the last step (its 13th token is sampled only).
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    llm = LLM(
        tiny_llama, num_blocks=5, block_size=BLOCK, host_cache_blocks=8, host_offload="commit"
    )
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    cache = llm.stats()["cache"]
    assert cache["num_host_pinned_blocks"] == 0
    assert cache["num_host_cached_blocks"] == 2
    pool = llm.runner.host_pool
    assert pool is not None
    # Both written slots hold K/V (a slot never written is zeros).
    assert int((pool.abs().sum(dim=1) > 0).sum()) == 2
    # Push both blocks out of the 4-block device pool, then ask for the whole sequence:
    # its two full blocks load back and the next token is the dense one.
    _tokens(llm, _prompt(60, 6))
    whole = prompt + out
    want = dense_greedy_generate(tiny_llama, [whole], 1)[0]
    again = llm.generate([whole], SamplingParams(max_tokens=1, temperature=0.0))
    assert llm.stats()["cache"]["host_loads"] == 2
    assert again[0].outputs[0].token_ids == want


@pytest.mark.parametrize("others_priority", [10, 90])
def test_retention_priority_keeps_a_prefix_through_a_flood(
    tiny_llama: LlamaForCausalLM, expected: list[int], others_priority: int
) -> None:
    """``SamplingParams.retention_priority`` reaches the manager: TARGET at 90 outlives a
    flood of six other prompts at 10 (in the device cache or the 4-block host tier) and comes
    back with the K/V its first run wrote; at equal priorities the same flood pushes it
    out of both, so its second run recomputes every block."""
    llm = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0, host_cache_blocks=4)
    keep = SamplingParams(max_tokens=4, temperature=0.0, retention_priority=90)
    flood = SamplingParams(max_tokens=4, temperature=0.0, retention_priority=others_priority)
    first = llm.generate([TARGET], keep)[0].outputs[0].token_ids
    written = _prefix_payloads(llm, TARGET)
    for i in range(6):
        llm.generate([_prompt(4 * BLOCK, 20 + i)], flood)
    before = llm.scheduler.counters.num_prefill_tokens
    second = llm.generate([TARGET], keep)[0].outputs[0].token_ids
    prefill = llm.scheduler.counters.num_prefill_tokens - before
    assert first == second == expected
    if others_priority < 90:
        assert prefill == BLOCK
        assert torch.equal(_prefix_payloads(llm, TARGET), written)
    else:
        assert prefill == len(TARGET)
    llm.manager.check_invariants()


def test_retention_priority_is_checked() -> None:
    for bad in (-1, 101, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="retention_priority"):
            SamplingParams(retention_priority=bad)  # type: ignore[arg-type]
