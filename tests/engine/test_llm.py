"""End to end: LLM.generate on the paged engine equals the dense, cache-free reference.

The engine runs the real scheduler, the Rust block manager and the paged ops (torch
reference on the CPU); the reference recomputes every sequence from scratch each step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvblocks.engine import LLM, LlamaForCausalLM
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.loader import save_checkpoint
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams

from .test_tokenizer import write_word_tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _prompt(40, 100)
# Shared 40-token prefix (two and a half 16-token blocks) plus distinct tails.
PROMPTS = [SYSTEM + _prompt(n, i) for i, n in enumerate([5, 17, 1, 30])] + [_prompt(9, 9)]


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(tiny_llama: LlamaForCausalLM) -> list[list[int]]:
    return dense_greedy_generate(tiny_llama, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_dense(
    tiny_llama: LlamaForCausalLM, expected: list[list[int]], prefix_caching: bool
) -> None:
    llm = LLM(tiny_llama, num_blocks=128, enable_prefix_caching=prefix_caching, device="cpu")
    first = llm.generate(PROMPTS, GREEDY)
    assert _tokens(first) == expected
    assert all(o.finish_reason == "length" for o in first)
    # Run again: with caching the shared system prompt (and each repeated prompt) hits.
    second = llm.generate(PROMPTS, GREEDY)
    assert _tokens(second) == expected
    cached = [o.num_cached_tokens for o in second]
    if prefix_caching:
        assert cached[0] >= 32 and all(c % 16 == 0 for c in cached)
    else:
        assert cached == [0] * len(PROMPTS)


def test_chunked_prefill_equals_dense(
    tiny_llama: LlamaForCausalLM, expected: list[list[int]]
) -> None:
    llm = LLM(tiny_llama, num_blocks=128, max_num_batched_tokens=16, device="cpu")
    outputs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outputs) == expected
    # Prompts of up to 70 tokens through a 16-token budget: prefill took many steps.
    assert llm.stats()["engine"]["steps"] > sum(len(p) for p in PROMPTS) / 16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_equal_to_dense(tiny_llama: LlamaForCausalLM, mode: str) -> None:
    prompts = [_prompt(20 + 3 * i, 50 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = dense_greedy_generate(tiny_llama, prompts, params.max_tokens)
    # 6 sequences growing to ~95 tokens (6 blocks each) in 16 usable blocks.
    llm = LLM(tiny_llama, num_blocks=17, num_cpu_blocks=64, preemption_mode=mode, device="cpu")
    outputs = llm.generate(prompts, params)
    assert _tokens(outputs) == expected
    sched = llm.stats()["scheduler"]
    assert sched[f"num_preemptions_{mode}"] > 0, sched
    other = "swap" if mode == "recompute" else "recompute"
    assert sched[f"num_preemptions_{other}"] == 0, sched


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(tiny_config("mistral"), id="mistral-window24"),
        pytest.param(tiny_config("qwen2"), id="qwen2-bias"),
        pytest.param(tiny_config("llama", tie_word_embeddings=True), id="llama-tied"),
    ],
)
def test_loaded_checkpoint_greedy_equals_dense(config, tmp_path: Path) -> None:
    model = build_tiny_model(config, seed=3)
    save_checkpoint(model, tmp_path, max_shard_bytes=100_000)
    prompts = [_prompt(30, 1), _prompt(7, 2), _prompt(51, 3)]
    params = SamplingParams(max_tokens=30, temperature=0.0)
    expected = dense_greedy_generate(model, prompts, params.max_tokens)
    llm = LLM(str(tmp_path), num_blocks=64, block_size=8, device="cpu")
    assert llm.model.config == model.config
    assert llm.manager.sliding_window == config.sliding_window
    assert _tokens(llm.generate(prompts, params)) == expected
    # Again, now from the prefix cache (with a window, released blocks must not be reused).
    again = llm.generate(prompts, params)
    assert _tokens(again) == expected
    assert again[2].num_cached_tokens > 0


def _beam_and_n(llm: LLM) -> list[list[list[int]]]:
    prompts = [_prompt(25, 70 + i) for i in range(4)]
    params = [
        SamplingParams(max_tokens=24, beam_width=3, n=2),
        SamplingParams(max_tokens=24, n=3, temperature=0.8, seed=11),
        SamplingParams(max_tokens=24, beam_width=2),
        SamplingParams(max_tokens=24, n=2, temperature=1.0, top_k=20, seed=5),
    ]
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def test_beam_search_and_parallel_sampling_are_stable_under_memory_pressure(
    tiny_llama: LlamaForCausalLM,
) -> None:
    roomy = LLM(tiny_llama, num_blocks=256, device="cpu")
    relaxed = _beam_and_n(roomy)
    assert [len(x) for x in relaxed] == [2, 3, 1, 2]
    for num_blocks in (12, 8):
        tight = LLM(tiny_llama, num_blocks=num_blocks, num_cpu_blocks=128, device="cpu")
        assert _beam_and_n(tight) == relaxed
        sched = tight.stats()["scheduler"]
        assert sched["num_preemptions_swap"] > 0, sched


@pytest.mark.parametrize("num_blocks", [8, 10])
def test_every_step_matches_dense_under_memory_pressure(
    tiny_llama: LlamaForCausalLM, num_blocks: int
) -> None:
    """Each sampled row's logits equal the dense forward over that sequence's tokens.

    Checked at every step while beams fork, copy on write and get swapped out and back
    in (and single-sequence requests are recomputed), so stale or misplaced KV anywhere
    in the cache shows up even when it would not change an argmax.
    """
    from kvblocks.engine.dense import dense_logits

    llm = LLM(tiny_llama, num_blocks=num_blocks, num_cpu_blocks=128, device="cpu")
    forward = llm.runner.forward_logits
    checked = 0

    def checked_forward(out):
        nonlocal checked
        logits = forward(out)
        if logits is None:
            return logits
        for row, seq in enumerate(out.sample_seq_ids.tolist()):
            length = int(out.seq_lens[list(out.seq_ids).index(seq)])
            tokens = torch.from_numpy(llm.manager.token_ids(seq)[:length].astype("int64"))
            expected = dense_logits(tiny_llama, tokens[None])[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
            checked += 1
        return logits

    llm.runner.forward_logits = checked_forward  # type: ignore[method-assign]
    _beam_and_n(llm)
    llm.generate(
        [_prompt(30, 60 + i) for i in range(3)], SamplingParams(max_tokens=30, temperature=0.0)
    )
    sched = llm.stats()["scheduler"]
    assert sched["num_preemptions_swap"] > 0 and checked > 100, sched


def test_seeded_sampling_is_reproducible(tiny_llama: LlamaForCausalLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    prompt = _prompt(10, 4)
    alone = LLM(tiny_llama, num_blocks=64, device="cpu", seed=1).generate([prompt], params)
    others = [_prompt(10 + i, 20 + i) for i in range(3)]
    mixed = LLM(tiny_llama, num_blocks=64, device="cpu", seed=2).generate(
        [*others, prompt], [SamplingParams(max_tokens=20, temperature=1.0)] * 3 + [params]
    )
    assert mixed[-1].token_ids == alone[0].token_ids
    unseeded = SamplingParams(max_tokens=20, temperature=1.0)
    a = LLM(tiny_llama, num_blocks=64, device="cpu", seed=7).generate([prompt] * 2, unseeded)
    b = LLM(tiny_llama, num_blocks=64, device="cpu", seed=7).generate([prompt] * 2, unseeded)
    assert _tokens(a) == _tokens(b)  # the engine seed makes a whole run reproducible
    assert a[0].token_ids != a[1].token_ids  # ...and unseeded requests differ from each other


def test_stop_tokens_and_eos(tiny_llama: LlamaForCausalLM, expected: list[list[int]]) -> None:
    llm = LLM(tiny_llama, num_blocks=64, device="cpu")
    stop = expected[0][4]
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    )
    cut = expected[0].index(stop) + 1
    assert out[0].token_ids == expected[0][:cut]
    assert out[0].finish_reason == "stop"

    config = tiny_config("llama", eos_token_ids=(expected[1][3], 250))
    model = build_tiny_model(config)
    eos_llm = LLM(model, num_blocks=64, device="cpu")
    out = eos_llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0))
    assert out[0].token_ids == expected[1][: expected[1].index(expected[1][3]) + 1]
    assert out[0].finish_reason == "eos"
    ignored = eos_llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert ignored[0].token_ids == expected[1]


def test_text_prompts_through_tokenizer_json(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(255)]
    save_checkpoint(build_tiny_model(), tmp_path)
    write_word_tokenizer(tmp_path, words)
    llm = LLM(str(tmp_path), num_blocks=64, device="cpu")
    out = llm.generate(["w1 w2 w3", [4, 5]], SamplingParams(max_tokens=5, temperature=0.0))
    assert out[0].prompt == "w1 w2 w3" and out[0].prompt_token_ids == [2, 3, 4]
    assert llm.tokenizer is not None
    assert out[0].text == llm.tokenizer.decode(out[0].token_ids)
    assert out[1].prompt is None and isinstance(out[1].text, str)


def test_tiny_model_default_speaks_bytes() -> None:
    llm = LLM(num_blocks=32, device="cpu")
    out = llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.0))
    assert out[0].prompt_token_ids == [104, 105]
    assert out[0].text == bytes(out[0].token_ids).decode("utf-8", errors="replace")


def test_bad_requests_raise_and_leave_the_engine_usable(tiny_llama: LlamaForCausalLM) -> None:
    llm = LLM(tiny_llama, num_blocks=32, device="cpu")
    with pytest.raises(InvalidArgumentError, match=r"token ids must be in \[0, 256\)"):
        llm.generate([[1, 2, 300]])
    with pytest.raises(InvalidArgumentError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY])
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        llm.generate([[]])
    no_tok = LLM(tiny_llama, tokenizer=None, num_blocks=32, device="cpu")
    no_tok.tokenizer = None
    with pytest.raises(InvalidArgumentError, match="text prompts need a tokenizer"):
        no_tok.generate("hello")
    with pytest.raises(InvalidArgumentError, match="block_size must be one of"):
        LLM(tiny_llama, block_size=12, device="cpu")
    # A prompt the pool can never hold is refused up front; the batch's other requests
    # are withdrawn, so nothing is left half-queued.
    with pytest.raises(InvalidArgumentError):
        llm.generate([[1, 2, 3], list(range(200)) * 4], GREEDY)
    assert not llm.scheduler.has_unfinished_requests()
    assert _tokens(llm.generate([[1, 2, 3]], GREEDY)) == dense_greedy_generate(
        tiny_llama, [[1, 2, 3]], GREEDY.max_tokens
    )


def _dense_beam_search(
    model: LlamaForCausalLM, prompt: list[int], width: int, max_tokens: int
) -> list[tuple[list[int], float]]:
    """Plain beam search over dense logits: keep the ``width`` best (beam, token) extensions."""
    from kvblocks.engine.dense import dense_logits

    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(max_tokens):
        seqs = torch.tensor([prompt + generated for generated, _ in beams])
        logprobs = torch.log_softmax(dense_logits(model, seqs)[:, -1], dim=-1).double()
        top = logprobs.topk(2 * width, dim=-1)
        scores = torch.tensor([cum for _, cum in beams], dtype=torch.float64)[:, None] + top.values
        best = torch.argsort(-scores.flatten(), stable=True)[:width].tolist()
        beams = [
            (
                beams[i // (2 * width)][0] + [int(top.indices.flatten()[i])],
                float(scores.flatten()[i]),
            )
            for i in best
        ]
    return sorted(beams, key=lambda b: b[1], reverse=True)


def test_beam_search_equals_dense_beam_search(tiny_llama: LlamaForCausalLM) -> None:
    """Forked beams on shared, copy-on-write blocks score exactly like independent dense runs."""
    prompts = [_prompt(21, 90), _prompt(6, 91)]
    params = SamplingParams(max_tokens=10, beam_width=3, n=3)
    llm = LLM(tiny_llama, num_blocks=64, block_size=8, device="cpu")
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        expected = _dense_beam_search(tiny_llama, prompt, 3, 10)
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in expected]
        for c, (_, cum) in zip(out.outputs, expected, strict=True):
            assert c.cumulative_logprob == pytest.approx(cum, abs=1e-3)
    assert llm.manager.stats()["cow_copies"] > 0


class _StepFault(Exception):
    """Raised by a wrapped step to stand for an engine error."""


def _fail_on_step(llm: LLM, step: int, exc: BaseException) -> None:
    """Make the ``step``-th ``runner.execute`` call raise ``exc`` (an error or Ctrl-C)."""
    execute = llm.runner.execute
    calls = 0

    def faulty(out):
        nonlocal calls
        calls += 1
        if calls == step:
            raise exc
        return execute(out)

    llm.runner.execute = faulty  # type: ignore[method-assign]


@pytest.mark.parametrize("exc", [_StepFault("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("step", [1, 3])
def test_generate_recovers_from_an_exception_in_a_step(
    tiny_llama: LlamaForCausalLM, exc: BaseException, step: int
) -> None:
    """Issue 7, item 9: after an exception mid-step, the next generate works (and is right)."""
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[2]]
    params = [GREEDY, SamplingParams(max_tokens=12, n=2, temperature=0.9, seed=4), GREEDY]
    llm = LLM(tiny_llama, num_blocks=64, device="cpu")
    scheduler = llm.scheduler
    _fail_on_step(llm, step, exc)
    generated = scheduler.counters.num_generated_tokens
    with pytest.raises(type(exc)):
        llm.generate(prompts, params)
    # Nothing of the failed call is left behind, and the scheduler carried on (issue 17.2:
    # it was replaced by a new one with the old counters copied in).
    assert llm.scheduler is scheduler
    assert not llm.scheduler.has_unfinished_requests()
    assert len(llm.manager) == 0
    llm.manager.check_invariants()
    if step == 1:  # the failed step drew nothing
        assert scheduler.counters.num_generated_tokens == generated
    again = llm.generate(prompts, params)
    fresh = LLM(tiny_llama, num_blocks=64, device="cpu").generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in fresh
    ]
    greedy = dense_greedy_generate(tiny_llama, [prompts[0], prompts[2]], GREEDY.max_tokens)
    assert _tokens([again[0], again[2]]) == greedy


def test_a_fault_inside_update_surfaces_and_leaves_nothing_behind(
    tiny_llama: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault inside ``Scheduler.update`` after a request left prefill and before its
    decode rows exist: before, the clean-up's abort failed on the missing rows
    (``IndexError``), hid the fault and left the request and its sequence behind."""
    from kvblocks.scheduler import request_state

    table_rows = request_state.RequestState.table_rows
    calls = 0

    def faulty(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise _StepFault("fault inside update")
        return table_rows(self, *args, **kwargs)

    llm = LLM(tiny_llama, num_blocks=64, device="cpu")
    monkeypatch.setattr(request_state.RequestState, "table_rows", faulty)
    params = [GREEDY, SamplingParams(max_tokens=12, n=2, temperature=0.9, seed=4)]
    with pytest.raises(_StepFault, match="fault inside update"):
        llm.generate([PROMPTS[0], PROMPTS[2]], params)
    assert calls == 1
    assert not llm.scheduler.has_unfinished_requests()
    assert len(llm.manager) == 0
    llm.manager.check_invariants()
    monkeypatch.undo()
    again = llm.generate([PROMPTS[0], PROMPTS[2]], params)
    fresh = LLM(tiny_llama, num_blocks=64, device="cpu").generate([PROMPTS[0], PROMPTS[2]], params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in fresh
    ]


class _Events:
    """An event publisher that keeps every event."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def publish(self, events: list[object]) -> None:
        self.events.extend(events)


@pytest.mark.parametrize("where", ["before update", "after update", "execute"])
def test_a_failed_step_with_a_host_tier_leaves_the_engine_consistent(
    tiny_llama: LlamaForCausalLM, where: str
) -> None:
    """A fault at each point of a step, with write-through to a host tier and events on:
    the step is cancelled in the same scheduler, no host slot stays pinned, and the next
    call gives a fresh engine's tokens."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    events = _Events()
    options = {"num_blocks": 64, "device": "cpu", "host_cache_blocks": 32}
    llm = LLM(tiny_llama, host_offload="commit", event_publisher=events, **options)  # type: ignore[arg-type]
    scheduler = llm.scheduler
    if where == "execute":
        _fail_on_step(llm, 3, _StepFault("boom"))
    else:
        update = scheduler.update
        calls = 0

        def faulty(out, result):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 3 and where == "before update":
                raise _StepFault("boom")
            step = update(out, result)
            if calls == 3:
                raise _StepFault("boom")
            return step

        scheduler.update = faulty  # type: ignore[method-assign]
    with pytest.raises(_StepFault):
        llm.generate(prompts, GREEDY)
    assert llm.scheduler is scheduler and not scheduler.has_unfinished_requests()
    assert len(llm.manager) == 0 and llm.manager.stats()["num_host_pinned_blocks"] == 0
    llm.manager.check_invariants()
    if where != "execute":
        scheduler.update = update  # type: ignore[method-assign]
    fresh = LLM(tiny_llama, **options).generate(prompts, GREEDY)  # type: ignore[arg-type]
    again = llm.generate(prompts, GREEDY)
    assert _tokens(again) == _tokens(fresh)
    assert llm.manager.stats()["num_host_pinned_blocks"] == 0


def test_max_model_len_rejects_long_prompts_and_stops_generation(
    tiny_llama: LlamaForCausalLM,
) -> None:
    """Issue 7, item 11: prompt + generated tokens never exceed max_model_len."""
    llm = LLM(tiny_llama, num_blocks=64, device="cpu", max_model_len=20)
    assert llm.max_model_len == 20
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        llm.generate([_prompt(20, 1)], GREEDY)
    assert not llm.scheduler.has_unfinished_requests()
    prompt = _prompt(15, 2)
    out = llm.generate([prompt, _prompt(3, 3)], GREEDY)
    expected = dense_greedy_generate(tiny_llama, [prompt, _prompt(3, 3)], GREEDY.max_tokens)
    assert out[0].token_ids == expected[0][:5] and out[0].finish_reason == "length"
    assert out[1].token_ids == expected[1] and out[1].finish_reason == "length"
    beams = llm.generate([prompt], SamplingParams(max_tokens=12, beam_width=2, n=2))
    assert all(len(c.token_ids) <= 5 for c in beams[0].outputs)


def test_max_model_len_defaults_to_the_config_and_is_validated() -> None:
    model = build_tiny_model(tiny_config("llama", max_position_embeddings=24))
    llm = LLM(model, num_blocks=64, device="cpu")
    assert llm.max_model_len == 24
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        llm.generate([_prompt(30, 1)], GREEDY)
    assert len(llm.generate([_prompt(20, 1)], GREEDY)[0].token_ids) == 4
    for bad in (0, 25, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="max_model_len"):
            LLM(model, num_blocks=64, device="cpu", max_model_len=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "prompt",
    [
        [1.9, 2.7],
        [1, 2.0],
        [True, 3],
        ["1", "2"],
        np.array([1.0, 2.0]),
        np.array([1, 2], dtype=bool),
        np.array([[1.5, 2.5]]),
    ],
)
def test_non_integer_token_ids_are_rejected(tiny_llama: LlamaForCausalLM, prompt) -> None:
    """Issue 7, item 13: float ids were silently truncated (``[1.9, 2.7]`` ran as ``[1, 2]``)."""
    llm = LLM(tiny_llama, num_blocks=32, device="cpu")
    with pytest.raises(InvalidArgumentError, match="token ids"):
        llm.generate(prompt if isinstance(prompt, np.ndarray) else [prompt], GREEDY)
    assert not llm.scheduler.has_unfinished_requests()
    # Integer NumPy types are token ids.
    ids = [np.array([1, 2], dtype=np.int32), [np.int64(1), np.uint8(2)]]
    expected = dense_greedy_generate(tiny_llama, [[1, 2]], GREEDY.max_tokens)[0]
    assert _tokens(llm.generate(ids, GREEDY)) == [expected, expected]


def test_non_integer_stop_token_ids_are_rejected() -> None:
    for bad in ((1.5,), (True,), ("3",), np.array([2.0])):
        with pytest.raises(InvalidArgumentError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)


@pytest.mark.parametrize("device", ["tpu", "cuda:99", "not a device", "meta"])
def test_unusable_devices_are_clear_errors(device: str) -> None:
    """Issue 7, item 16: a device torch cannot use is an InvalidArgumentError, not a torch error."""
    model = build_tiny_model()  # not the shared fixture: a failed move must not touch it
    with pytest.raises(InvalidArgumentError, match="device"):
        LLM(model, num_blocks=32, device=device)
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="no CUDA GPU"):
        LLM(build_tiny_model(), num_blocks=32, device="cuda")


def test_generated_token_counts_agree(tiny_llama: LlamaForCausalLM) -> None:
    """Issue 7, item 17: the engine's and the scheduler's generated-token counts agree."""
    llm = LLM(tiny_llama, num_blocks=64, device="cpu")
    params = SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=1, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3], [4, 5]], params)
    stats = llm.stats()
    assert stats["engine"]["generated_tokens"] == 2 * 2 * 8
    assert stats["scheduler"]["num_generated_tokens"] == stats["engine"]["generated_tokens"]
    assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == 32
    for section in ("engine", "scheduler"):
        for name, value in stats[section].items():
            if name.startswith("num_") or name in ("steps", "computed_tokens", "generated_tokens"):
                assert type(value) is int, (section, name, value)


@pytest.mark.parametrize(
    "kwargs",
    [{"seed": 2**70}, {"seed": 1.5}, {"dtype": torch.int8}, {"dtype": "float16"}],
    ids=["seed 2**70", "seed float", "dtype int8", "dtype str"],
)
def test_bad_seed_or_dtype_is_refused_by_name(
    tiny_llama: LlamaForCausalLM, kwargs: dict[str, object]
) -> None:
    """Before: seed=2**70 raised ValueError ("Overflow when unpacking long long"), dtype
    torch.int8 or "float16" TypeError from torch's Module.to."""
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        LLM(tiny_llama, num_blocks=16, block_size=8, device="cpu", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        LLM(None, num_blocks=16, block_size=8, device="cpu", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_blocks": "64"}, "num_blocks"),  # TypeError from the comparison
        ({"num_blocks": np.array([64, 64])}, "num_blocks"),  # NumPy's ValueError
        ({"num_cpu_blocks": [8]}, "num_cpu_blocks"),
        ({"block_size": np.array([16, 16])}, "block_size"),
        ({"tokenizer": 3}, "tokenizer"),  # kept, then an AttributeError on the first text
    ],
)
def test_constructor_arguments_of_the_wrong_kind_are_refused(
    tiny_llama: LlamaForCausalLM, kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        LLM(tiny_llama, device="cpu", **{"num_blocks": 32, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("model", [3, 2.5, ["m"], b"path"])
def test_a_model_that_is_no_path_or_model_is_refused(model: object) -> None:
    # A TypeError from Path() or os.fspath.
    with pytest.raises(InvalidArgumentError, match="model"):
        LLM(model, num_blocks=32, device="cpu")  # type: ignore[arg-type]


def test_generate_arguments_of_the_wrong_kind_are_refused(tiny_llama: LlamaForCausalLM) -> None:
    llm = LLM(tiny_llama, num_blocks=32, device="cpu")
    calls = [
        lambda: llm.generate(5, GREEDY),  # type: ignore[arg-type]  # 'int' is not iterable
        lambda: llm.generate(None, GREEDY),  # type: ignore[arg-type]
        lambda: llm.generate(np.array(3), GREEDY),  # type: ignore[arg-type]  # a 0-d array
        lambda: llm.generate([[1, 2]], 2.5),  # type: ignore[arg-type]
        lambda: llm.generate([True, False], GREEDY),  # bools read as the prompt [1, 0]
        lambda: llm.generate([[1, 2]], GREEDY, stream="no"),  # type: ignore[call-overload]
        lambda: llm.generate([[1, 2]], GREEDY, stream=np.array([1, 0])),  # type: ignore[call-overload]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()
    assert not llm.scheduler.has_unfinished_requests()
    assert _tokens(llm.generate([[1, 2, 3]], GREEDY)) == dense_greedy_generate(
        tiny_llama, [[1, 2, 3]], GREEDY.max_tokens
    )
