"""The engine's KV cache groups for models mixing sliding-window and full attention.

Each attention kind gets its own groups of ``L`` layer slots (``attention_layout``), the
runner keeps one K/V tensor pair per slot, and every layer reads and writes its slot
through its own group's table: a long generation holds only what
docs/hybrid-groups.md's arithmetic says per sequence, and the tokens are still
transformers' own, under preemption (recompute and swap) and prefix hits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvblocks import GroupSpec
from kvblocks.engine import LLM
from kvblocks.engine.config import ModelConfig
from kvblocks.engine.layer_groups import attention_layout
from kvblocks.engine.runner import PagedAttention, kv_block_bytes
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams

from .hf_families import VOCAB, hf_greedy, load_hf, save_hf_checkpoint

FULL, SLIDE = "full_attention", "sliding_attention"


def _layout(kinds: str, window: int = 1024) -> tuple[int, list[int | None], int]:
    """``(L, group windows, padding slots)`` of a Ministral config whose layers are
    ``kinds`` (``s`` sliding, ``f`` full)."""
    types = tuple(SLIDE if k == "s" else FULL for k in kinds)
    config = tiny_config(
        "ministral", num_hidden_layers=len(types), layer_types=types, sliding_window=window
    )
    layout = attention_layout(config)
    assert layout is not None
    assert len(layout.layer_group) == len(types)
    for i, kind in enumerate(types):  # every layer is in a group of its own kind
        assert (layout.group_windows[layout.layer_group[i]] is None) == (kind == FULL)
    slots = set(zip(layout.layer_group, layout.layer_slot, strict=True))
    assert len(slots) == len(types)  # no two layers share a slot of a group
    return layout.layers_per_group, list(layout.group_windows), layout.num_padding_slots


def test_layer_slots_follow_the_design() -> None:
    # Gemma 3 27B: 10 full, 52 window layers: L = 10, 1 + 6 groups, 8 padding slots.
    assert _layout(("sssssf" * 10) + "ss") == (10, [None] + [1024] * 6, 8)
    # Gemma 3's 5:1 pattern in 6 layers: one full group and five window groups of 1.
    assert _layout("sssssf") == (1, [None] + [1024] * 5, 0)
    # gpt-oss alternates 1:1: L = n / 2, one group of each kind.
    assert _layout("sf" * 12) == (12, [None, 1024], 0)
    # OLMo 3's 3:1.
    assert _layout("sssf" * 4) == (4, [None, 1024, 1024, 1024], 0)
    # Nearly balanced kinds (10 vs 12) share L = 12: two groups, two padding slots.
    assert _layout("sf" * 10 + "ss") == (12, [None, 1024], 2)


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("llama"),  # every layer full
        tiny_config("mistral"),  # one window everywhere
        tiny_config("bamba"),  # recurrent hybrids have their own layout
    ],
    ids=["full", "uniform-window", "bamba"],
)
def test_one_attention_kind_needs_no_layout(config: ModelConfig) -> None:
    assert attention_layout(config) is None


def test_too_many_groups_is_refused_by_name() -> None:
    types = tuple([FULL] + [SLIDE] * 64)
    config = tiny_config("ministral", num_hidden_layers=65, layer_types=types, sliding_window=8)
    with pytest.raises(InvalidArgumentError, match="kv_cache_groups=False"):
        attention_layout(config)


def _cache_bytes(llm: LLM) -> int:
    return sum(k.nbytes + v.nbytes for k, v in llm.runner.kv_caches)


@pytest.mark.parametrize(
    ("model_type", "layers", "slots", "windows"),
    [
        ("gemma2", 2, 1, [None, 8]),
        ("gemma3_text", 6, 1, [None] + [8] * 5),
        ("gpt_oss", 4, 2, [None, 8]),
        ("olmo3", 4, 1, [None, 8, 8, 8]),
    ],
)
def test_engine_builds_one_group_per_kind_and_slot_tensors(
    model_type: str, layers: int, slots: int, windows: list[int | None]
) -> None:
    """The manager has the layout's groups and the cache one tensor pair per layer slot:
    ``L`` slots' bytes per block, not ``n_layers``'."""
    model = build_tiny_model(tiny_config(model_type, num_hidden_layers=layers, layer_types=None))
    llm = LLM(model, num_blocks=32, block_size=8, device="cpu")
    want = [
        GroupSpec.full_attention() if w is None else GroupSpec.sliding_window(w) for w in windows
    ]
    assert llm.manager.groups == want
    assert llm.manager.sliding_window is None
    assert len(llm.runner.kv_caches) == slots
    per_block = kv_block_bytes(model, 8, torch.float32, slots)
    assert _cache_bytes(llm) == 32 * per_block
    # The same model in one group keeps every layer: n_layers / L times the bytes.
    uniform = LLM(model, num_blocks=32, block_size=8, device="cpu", kv_cache_groups=False)
    assert uniform.manager.groups == [GroupSpec.full_attention()]
    assert len(uniform.runner.kv_caches) == layers
    assert _cache_bytes(uniform) * slots == _cache_bytes(llm) * layers
    # Both run the same tokens.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 40))
    assert llm.generate([prompt], params)[0].token_ids == (
        uniform.generate([prompt], params)[0].token_ids
    )


def test_kv_cache_groups_is_a_bool_switch() -> None:
    """Groups unless ``kv_cache_groups=False`` (a remote tier keeps them too: its store
    keys a block by group and hash, tests/engine/test_remote_tier_groups.py)."""
    from kvblocks.engine.build import attention_groups

    model = build_tiny_model(tiny_config("gemma3_text", num_hidden_layers=6, layer_types=None))
    assert attention_groups(model, True) is not None
    assert attention_groups(model, False) is None
    with pytest.raises(InvalidArgumentError, match="kv_cache_groups"):
        attention_groups(model, 1)  # type: ignore[arg-type]


def _held(total: int, window: int | None, block: int) -> int:
    """docs/hybrid-groups.md: blocks a group holds for ``total`` computed tokens."""
    blocks = -(-total // block)
    if window is None:
        return blocks
    return blocks - max(0, (total + 1 - window) // block)


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss"])
def hf_model(request, tmp_path_factory) -> tuple[Path, object]:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(transformers, request.param, path, seed=5)
    return path, load_hf(transformers, path)


def test_long_generation_holds_the_window_and_matches_transformers(hf_model) -> None:
    """One sequence decodes 120 tokens past a 33-token prompt: after every step each
    group holds exactly the arithmetic's blocks (a window group at most 2 of 8 tokens,
    the full group every block), and the tokens are transformers' own."""
    path, hf = hf_model
    block = 8
    prompt = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(9)).tolist()
    expected = hf_greedy(hf, prompt, 120)
    llm = LLM(str(path), num_blocks=64, block_size=block, device="cpu")
    windows = [g.window for g in llm.manager.groups]
    assert windows[0] is None and set(windows[1:]) == {8}
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    checked = 0
    for rec in llm.stream([prompt], params):
        tokens = rec.outputs[0].token_ids
        if rec.outputs[0].finish_reason is not None:
            break
        # Between steps the sequence has computed the prompt and all but the last token.
        computed = len(prompt) + len(tokens) - 1
        used = llm.manager.group_stats()["num_used_blocks"]
        assert used == [_held(computed, w, block) for w in windows], computed
        assert max(used[1:]) <= 2
        checked += 1
    assert tokens == expected
    assert checked >= 100
    # What the sequence held at its end against uniform allocation (every layer slot
    # keeping every token): the full group's blocks plus two per window group.
    total = len(prompt) + 120 - 1
    held = sum(_held(total, w, block) for w in windows)
    assert held < len(windows) * _held(total, None, block)


def _prompts(seed: int) -> list[list[int]]:
    """Three prompts sharing 24 tokens (three blocks), and one of their own."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 17, 3)]
    return [*prompts, torch.randint(0, VOCAB, (13,), generator=gen).tolist()]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_below_the_prompt_with_prefix_hits_and_preemption(hf_model, mode: str) -> None:
    """Prompts of 13-41 tokens through 8-token windows in a 24-block pool: the engine
    preempts (``mode``), prompts sharing a prefix hit it (the first computes it, the
    others wait a step and claim it), and every token is transformers'."""
    path, hf = hf_model
    llm = LLM(
        str(path),
        num_blocks=24,
        block_size=8,
        num_cpu_blocks=64,
        max_num_batched_tokens=32,
        preemption_mode=mode,
        device="cpu",
    )
    assert len(llm.manager.groups) >= 2
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    hits = []
    for seed in (11, 12):
        prompts = _prompts(seed)
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [hf_greedy(hf, p, 20) for p in prompts]
        hits += [o.num_cached_tokens for o in got]
    sched = llm.stats()["scheduler"]
    assert sched[f"num_preemptions_{mode}"] > 0, sched
    assert max(hits) >= 24, hits
    # The null block is never written: a masked key gathered from it adds exactly 0.
    for k, v in llm.runner.kv_caches:
        assert not k[0].any() and not v[0].any()


def test_cuda_call_shapes_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the CPU plans every layer goes through the ops front-ends, as on CUDA,
    with its own group's ``[S, B]`` table and ``[T]`` slot mapping and its slot's cache;
    the result is the planned path's."""
    from kvblocks import ops

    torch.manual_seed(0)
    num_blocks, bs, heads, dim = 12, 8, 2, 64
    caches = ops.allocate_kv_cache(2, num_blocks, bs, heads, dim, torch.float32, "cpu")
    for kc, vc in caches:  # earlier steps' KV everywhere but the null block
        kc[1:].normal_()
        vc[1:].normal_()
    start = [(kc.clone(), vc.clone()) for kc, vc in caches]
    # Sequence 0 computes positions 16..19 (its window starts at 9: block 0 released),
    # sequence 1 its first 11 tokens.
    seq_lens = torch.tensor([20, 11], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 15], dtype=torch.int32)
    full = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    window = torch.tensor([[0, 6, 7], [8, 9, 0]], dtype=torch.int32)
    tables = torch.stack([full, window])
    positions = [list(range(16, 20)), list(range(11))]
    slots = torch.tensor(
        [
            [int(t[s, p // bs]) * bs + p % bs for s, ps in enumerate(positions) for p in ps]
            for t in (full, window)
        ]
    )
    calls: list[tuple[str, int, tuple[int, ...]]] = []
    real_cache, real_prefill = ops.reshape_and_cache, ops.paged_prefill_attention

    def cache(key, value, key_cache, value_cache, slot_mapping):  # type: ignore[no-untyped-def]
        calls.append(("cache", int(slot_mapping[-1]), tuple(slot_mapping.shape)))
        return real_cache(key, value, key_cache, value_cache, slot_mapping)

    def prefill(query, key_cache, value_cache, block_tables, *args, **kw):  # type: ignore[no-untyped-def]
        calls.append(("attend", int(block_tables[0, 1]), tuple(block_tables.shape)))
        return real_prefill(query, key_cache, value_cache, block_tables, *args, **kw)

    monkeypatch.setattr(ops, "reshape_and_cache", cache)
    monkeypatch.setattr(ops, "paged_prefill_attention", prefill)
    from kvblocks.engine.config import AttentionSpec

    q = torch.randn(15, 4, dim) / 4
    k, v = torch.randn(15, heads, dim), torch.randn(15, heads, dim)
    outs = {}
    for planned in (True, False):
        for (kc, vc), (k0, v0) in zip(caches, start, strict=True):
            kc.copy_(k0)
            vc.copy_(v0)
        attention = PagedAttention(
            caches,
            slot_mappings=slots,
            block_tables=tables,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            seq_lens_host=seq_lens.numpy(),
            decode_only=False,
            max_seq_len=20,
            max_query_len=11,
            layer_group=(1, 0),
            layer_slot=(0, 1),
            cpu_plans=planned,
        )
        # Layer 0 is the window group's slot 0, layer 1 the full group's slot 1.
        outs[planned] = [
            attention(0, q, k, v, AttentionSpec(sliding_window=8, scale=0.25)),
            attention(1, q, k, v, AttentionSpec(sliding_window=None, scale=0.25)),
        ]
        assert not caches[0][0][0].any()  # the null block stays zero
    assert calls == [
        ("cache", int(slots[1, -1]), (15,)),
        ("attend", 6, (2, 3)),
        ("cache", int(slots[0, -1]), (15,)),
        ("attend", 2, (2, 3)),
    ]
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert np.isfinite(outs[True][0].numpy()).all()


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_host_tier_reloads_each_groups_blocks(policy: str) -> None:
    """Gemma 3's three groups (2 window, 1 full) over a host tier: a prompt pushed out of
    a small pool by others comes back by loads of each group's own blocks (keyed by
    group), and its tokens are the dense reference's."""
    from kvblocks.engine.dense import dense_greedy_generate

    model = build_tiny_model(tiny_config("gemma3_text"))
    gen = torch.Generator().manual_seed(21)
    target, *others = (torch.randint(1, 256, (64,), generator=gen).tolist() for _ in range(4))
    expected = dense_greedy_generate(model, [target], 4)[0]
    llm = LLM(
        model,
        num_blocks=20,
        block_size=16,
        num_cpu_blocks=0,
        host_cache_blocks=48,
        host_offload=policy,  # type: ignore[arg-type]
        device="cpu",
    )
    assert len(llm.manager.groups) == 3 and len(llm.runner.kv_caches) == 1
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert llm.generate([target], params)[0].token_ids == expected
    for prompt in others:
        llm.generate([prompt], params)
    again = llm.generate([target], params)[0]
    assert again.token_ids == expected
    cache = llm.stats()["cache"]
    assert cache["host_loads"] > 0 and again.num_cached_tokens == 48, cache
    llm.manager.check_invariants()
