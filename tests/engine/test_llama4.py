"""Llama 4 (text-only ``Llama4ForCausalLM``) against transformers' own code.

Chunked local attention in the RoPE layers (an interleaved rope, L2-normalised queries
and keys), NoPE full-attention layers with the query temperature, experts and dense
MLPs. The engine's tiny model saved by the engine is run by transformers (the logits
agree, and every switch changes them); a random checkpoint written by transformers'
``save_pretrained`` runs on the paged engine token for token under preemption, chunked
prefill across chunk boundaries and prefix hits; the chunked group frees the blocks of
past chunks and the attention never reads them (poisoned, they change nothing).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvblocks import GroupSpec
from kvblocks.engine import LLM
from kvblocks.engine import runner as runner_module
from kvblocks.engine.chunked_attention import chunked_batch
from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.dense import dense_greedy_generate, dense_logits
from kvblocks.engine.hf_config import config_from_file, config_from_hf_dict
from kvblocks.engine.llama4_config import Llama4Options
from kvblocks.engine.loader import save_checkpoint
from kvblocks.engine.runner import PagedAttention
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams

from .hf_families import (
    assert_checkpoint_matches_hf,
    assert_logprobs_match_hf,
    hf_greedy,
    load_hf,
    random_ids,
    random_prompt,
    save_hf_checkpoint,
)

CHUNK, BLOCK = 32, 16
FULL, CHUNKED = "full_attention", "chunked_attention"


# -- the model against transformers -------------------------------------------------------


def test_tiny_model_matches_transformers(tmp_path: Path) -> None:
    """The engine's checkpoint (16-token chunks, a NoPE layer, experts and dense layers,
    Llama 3 rope): transformers loads it as Llama4ForCausalLM and computes the same
    logits over 40 tokens (three chunks)."""
    transformers = pytest.importorskip("transformers")
    config = tiny_config("llama4_text")
    hf = assert_checkpoint_matches_hf(transformers, config, tmp_path)
    assert config.architecture == "Llama4ForCausalLM"
    assert hf.config.layer_types == [CHUNKED, CHUNKED, CHUNKED, FULL]
    assert hf.config.moe_layers == [1, 3] and hf.config.attention_chunk_size == 16


def _options(**change: Any) -> Llama4Options:
    base = tiny_config("llama4_text").llama4
    assert base is not None
    return Llama4Options(**{**base.__dict__, **change})


# Each switch changes the logits: without it the comparison above would fail.
SWITCHES = {
    "no-chunks": {"attention_chunk_size": None},  # every layer full attention
    "no-rope-scaling": {"rope_scaling": None},
    "no-qk-norm": {"llama4": _options(use_qk_norm=False)},
    "no-temperature": {"llama4": _options(attn_temperature_tuning=False)},
    "no-nope-layer": {"llama4": _options(no_rope_layers=(1, 1, 1, 1))},
    "dense-everywhere": {"llama4": _options(moe_layers=())},
    "experts-everywhere": {"llama4": _options(moe_layers=(0, 1, 2, 3))},
    "top-1": {"num_experts_per_tok": 1},
}


@pytest.mark.parametrize("change", SWITCHES.values(), ids=SWITCHES.keys())
def test_each_switch_changes_the_logits(change: dict[str, Any]) -> None:
    base = build_tiny_model(tiny_config("llama4_text"))
    other = build_tiny_model(tiny_config("llama4_text", **change))
    ids = random_ids(1, 40)
    assert (dense_logits(base, ids) - dense_logits(other, ids)).abs().max() > 1e-2


# -- a transformers checkpoint on the paged engine ----------------------------------------


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A checkpoint written by transformers (hf_families.LLAMA4), and its model."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama4")
    save_hf_checkpoint(transformers, "llama4_text", path, seed=3)
    return path, load_hf(transformers, path)


SHARED = random_prompt(48, 50)  # three 16-token blocks shared by the first three prompts
PROMPTS = [
    SHARED + random_prompt(21, 1),
    SHARED + random_prompt(45, 2),
    SHARED + random_prompt(5, 3),
    random_prompt(37, 4),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(hf_checkpoint: tuple[Path, Any]) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS (computed once for the module)."""
    return [hf_greedy(hf_checkpoint[1], p, MAX_TOKENS) for p in PROMPTS]


def test_checkpoint_config(hf_checkpoint: tuple[Path, Any]) -> None:
    path, _ = hf_checkpoint
    config = config_from_file(path)
    assert config.model_type == "llama4_text" and config.architecture == "Llama4ForCausalLM"
    assert config.layer_attention_chunks() == [CHUNK, None, CHUNK, None]
    assert config.layer_sliding_windows() == [None] * 4
    assert config.llama4 is not None and config.llama4.moe_layers == (0, 1)
    assert config.llama4.floor_scale == 16.0 and config.llama4.attn_temperature_tuning
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.rms_norm_eps == 1e-6 and config.head_dim == 64


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kv_cache_groups", [False, True], ids=["one-group", "groups"])
def test_hf_checkpoint_runs_token_for_token(
    hf_checkpoint: tuple[Path, Any],
    expected: list[list[int]],
    kv_cache_groups: bool,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LLM(path)`` on transformers' checkpoint, prompts of 37-93 tokens (up to three
    32-token chunks) plus 24 generated: transformers' greedy tokens under preemption (a
    16-block pool), chunked prefill in 40-token steps (prefill chunks that cross chunk
    boundaries), and again from the prefix cache; the log-probs are transformers'
    teacher-forced ones. Once with a full-attention group and a chunked group (the
    default), once with one full-attention group of every layer (the chunked layers
    still read only their chunk)."""
    path, hf = hf_checkpoint
    split: list[int] = []  # sequences of a prefill batch split at a chunk boundary
    real = runner_module.chunked_batch

    def spy(qsl: np.ndarray, lens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        batch = real(qsl, lens, *args, **kwargs)
        split.append(len(batch.rows) - len(np.unique(batch.rows)))
        return batch

    monkeypatch.setattr(runner_module, "chunked_batch", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading must not warn about anything dropped
        llm = LLM(
            str(path),
            num_blocks=16,
            block_size=BLOCK,
            num_cpu_blocks=64,
            max_num_batched_tokens=40,
            preemption_mode=mode,  # type: ignore[arg-type]
            device="cpu",
            kv_cache_groups=kv_cache_groups,
        )
    want_groups = [GroupSpec.full_attention()]
    if kv_cache_groups:
        want_groups.append(GroupSpec.chunked_local_attention(CHUNK))
    assert llm.manager.groups == want_groups
    assert len(llm.runner.kv_caches) == (2 if kv_cache_groups else 4)  # L = 2 per group
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == expected
    assert all(len(set(tokens)) >= 5 for tokens in expected)  # informative continuations
    sched = llm.stats()["scheduler"]
    assert sched[f"num_preemptions_{mode}"] > 0, sched
    assert max(split) > 0  # some prefill step crossed a chunk boundary in a sequence
    assert_logprobs_match_hf(hf, PROMPTS, first)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == expected
    assert max(o.num_cached_tokens for o in again) >= 48  # a hit mid-chunk (32..63)
    llm.manager.check_invariants()


def _held(total: int, chunk: int | None, block: int) -> int:
    """docs/hybrid-groups.md: blocks a group holds for ``total`` computed tokens."""
    blocks = -(-total // block)
    if chunk is None:
        return blocks
    return blocks - (total // chunk * chunk) // block


def _poison_unheld_blocks(llm: LLM, poisoned: list[int]) -> None:
    """Before every forward pass, fill every block the step's sequences do not hold in
    any group (the null block, and the past chunks' blocks the chunked group freed) with
    NaN in every layer slot: an attention reading one turns the logits into NaN."""
    runner = llm.runner
    forward = runner.forward_logits

    def poisoned_forward(out: Any) -> Any:
        tables = out.group_block_table
        if tables is None:  # one group
            tables = np.asarray(out.block_table)[None]
        held = np.unique(np.asarray(tables)[:, np.asarray(out.block_table_rows)])
        unheld = np.setdiff1d(np.arange(runner.num_blocks), held)
        index = torch.from_numpy(unheld)
        for k, v in runner.kv_caches:
            k[index] = float("nan")
            v[index] = float("nan")
        poisoned.append(len(unheld))
        return forward(out)

    runner.forward_logits = poisoned_forward  # type: ignore[method-assign]


def test_chunked_group_frees_past_chunks_and_never_reads_them(
    hf_checkpoint: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 45-token prompt decodes 100 tokens (five chunks): after every step the chunked
    group holds exactly its current chunk's blocks (the formula of
    docs/hybrid-groups.md), the full group every block; with every block the sequence
    does not hold poisoned with NaN before each step, the tokens are still
    transformers' and the log-probs finite. The poison has teeth: chunks that start at
    block 0 (reading the freed entries) turn the output into NaN."""
    path, hf = hf_checkpoint
    prompt = random_prompt(45, 9)
    expected = hf_greedy(hf, prompt, 100)
    params = SamplingParams(max_tokens=100, temperature=0.0, logprobs=0, ignore_eos=True)

    def engine() -> LLM:
        llm = LLM(str(path), num_blocks=24, block_size=BLOCK, num_cpu_blocks=0, device="cpu")
        assert [g.chunk for g in llm.manager.groups] == [None, CHUNK]
        return llm

    llm = engine()
    poisoned: list[int] = []
    _poison_unheld_blocks(llm, poisoned)
    tokens: list[int] = []
    checked = 0
    logprobs: list[float] = []
    for rec in llm.stream([prompt], params):
        out = rec.outputs[0]
        tokens = out.token_ids
        logprobs = [t.logprob for t in out.logprobs or []]
        if out.finish_reason is not None:
            break
        computed = len(prompt) + len(tokens) - 1
        used = llm.manager.group_stats()["num_used_blocks"]
        assert used == [_held(computed, None, BLOCK), _held(computed, CHUNK, BLOCK)], computed
        assert used[1] <= CHUNK // BLOCK + 1
        checked += 1
    assert tokens == expected
    assert all(math.isfinite(lp) for lp in logprobs)
    assert checked >= 90
    # By the end the full group holds 10 blocks and the chunked one 1: the chunked
    # group's other 8 were freed and poisoned (with the pool's 13 never used).
    assert max(poisoned) >= 24 - 1 - 10 - 1
    # Negative control: a virtual batch whose pieces start at block 0 reads the freed
    # (poisoned) entries of the chunked group's table.
    real = runner_module.chunked_batch

    def from_block_zero(qsl: np.ndarray, lens: np.ndarray, chunk: int, *a: Any, **k: Any) -> Any:
        return real(qsl, lens, 1 << 20, *a, **k)

    monkeypatch.setattr(runner_module, "chunked_batch", from_block_zero)
    bad = engine()
    _poison_unheld_blocks(bad, [])
    (out,) = bad.generate([prompt], params)
    assert out.token_ids != expected or not all(
        math.isfinite(t.logprob) for t in out.outputs[0].logprobs or []
    )


# -- the virtual batches ------------------------------------------------------------------


def test_chunked_batch_splits_at_chunk_boundaries() -> None:
    """Sequence 0 computes positions 20..69 (chunks 0, 1, 2 with C = 32), sequence 1
    decodes position 40, sequence 2 computes 64..65: five pieces, in row order, each
    from its chunk's first block (blocks of 16)."""
    qsl = np.array([0, 50, 51, 53])
    lens = np.array([70, 41, 66])
    b = chunked_batch(qsl, lens, 32, 16, decode_only=False)
    assert b.rows.tolist() == [0, 0, 0, 1, 2]
    assert b.first_block.tolist() == [0, 2, 4, 2, 4]
    assert np.diff(b.query_start_loc).tolist() == [12, 32, 6, 1, 2]
    assert b.seq_lens.tolist() == [32, 32, 6, 9, 2]
    assert b.num_blocks.tolist() == [2, 2, 1, 1, 1]
    tables = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [0, 0, 0, 0, 9]])
    tables[1, :2] = 0  # released by the chunked group: never in a piece
    assert b.block_tables(tables).tolist() == [[1, 2], [3, 4], [5, 0], [8, 0], [9, 0]]
    # A decode batch keeps one piece per sequence (a padding sequence of length 0 too).
    d = chunked_batch(np.arange(4), np.array([41, 32, 0]), 32, 16, decode_only=True)
    assert d.rows.tolist() == [0, 1, 2]
    assert d.first_block.tolist() == [2, 0, 0]
    assert d.seq_lens.tolist() == [9, 32, 0]
    with pytest.raises(InvalidArgumentError, match=r"attention_chunk_size \(24\).*\(16\)"):
        chunked_batch(qsl, lens, 24, 16, decode_only=False)


def _chunked_reference(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    qsl: list[int],
    lens: list[int],
    chunk: int,
    scale: float,
) -> torch.Tensor:
    """Masked softmax over each sequence's whole cached context, keys of the query's own
    chunk only (independent of the virtual batches)."""
    kc, vc = caches
    bs = kc.shape[2]
    group = q.shape[1] // kc.shape[1]
    out = torch.zeros_like(q)
    for s, n in enumerate(lens):
        rows = range(qsl[s], qsl[s + 1])
        for i, row in enumerate(rows):
            p = n - len(rows) + i
            pos = torch.arange(p // chunk * chunk, p + 1)  # the visible keys only
            blocks = tables[s, pos // bs].long()
            keys = kc[blocks, :, pos % bs].repeat_interleave(group, 1)  # [n, H, D]
            values = vc[blocks, :, pos % bs].repeat_interleave(group, 1)
            scores = torch.einsum("hd,nhd->hn", q[row], keys) * scale
            out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("decode", [False, True], ids=["varlen", "decode"])
@pytest.mark.parametrize("planned", [True, False], ids=["cpu-plan", "ops"])
def test_paged_attention_attends_each_chunk_only(decode: bool, planned: bool) -> None:
    """A chunked layer's attention (the CPU plans, and the ops front-ends as CUDA calls
    them) equals masked attention over the whole context restricted to the query's
    chunk, though the blocks of past chunks hold NaN (freed and reused: the table's
    entries are the null block)."""
    from kvblocks import ops

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, chunk = 4, 2, 64, 16, 32
    kc, vc = ops.allocate_kv_cache(1, 16, bs, kv_heads, dim, torch.float32, "cpu")[0]
    kc[1:].normal_()
    vc[1:].normal_()
    full = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [10, 11, 12, 13, 9]])
    lens = [70, 41, 66]
    qsl = [0, 1, 2, 3] if decode else [0, 50, 51, 53]
    # The chunked group freed the blocks wholly before each sequence's first query's
    # chunk: NaN in the cache, null entries in its table.
    table = full.clone()
    first = [n - (qsl[s + 1] - qsl[s]) for s, n in enumerate(lens)]
    for s, p in enumerate(first):
        freed = (p // chunk * chunk) // bs
        kc[full[s, :freed]] = float("nan")
        vc[full[s, :freed]] = float("nan")
        table[s, :freed] = 0
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens, heads, dim) / 4
    positions = [p for s, n in enumerate(lens) for p in range(first[s], n)]
    slots = torch.tensor(
        [
            int(full[s, p // bs]) * bs + p % bs
            for s, n in enumerate(lens)
            for p in range(first[s], n)
        ]
    )
    k = kc.view(-1, kv_heads, dim)[slots].clone()  # the step's keys are what is cached
    v = vc.view(-1, kv_heads, dim)[slots].clone()
    assert len(positions) == num_tokens
    spec = AttentionSpec(sliding_window=None, scale=0.125, chunk_size=chunk)
    attention = PagedAttention(
        [(kc, vc)],
        slot_mappings=slots,
        block_tables=table.to(torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        seq_lens_host=np.array(lens),
        decode_only=decode,
        max_seq_len=max(lens),
        max_query_len=max(np.diff(qsl)),
        cpu_plans=planned,
    )
    got = attention(0, q, k, v, spec)
    want = _chunked_reference(q, (kc, vc), full, qsl, lens, chunk, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- configs and refusals -----------------------------------------------------------------

# A Llama-4-Scout-shaped text config (the fields transformers reads; Scout writes its
# temperature switch as the int 4 and an empty no_rope_layers list).
SCOUT_TEXT = {
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": 4,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "interleave_moe_layer_step": 1,
    "max_position_embeddings": 10485760,
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "use_qk_norm": True,
    "vocab_size": 202048,
}


def test_scout_shaped_config_and_its_groups() -> None:
    from kvblocks.engine.layer_groups import attention_layout

    c = config_from_hf_dict(SCOUT_TEXT)
    assert c.architecture == "Llama4ForCausalLM"
    assert c.llama4 is not None and c.llama4.attn_temperature_tuning
    assert c.llama4.moe_layers == tuple(range(48))  # interleave_moe_layer_step 1
    chunks = c.layer_attention_chunks()
    assert chunks[:4] == [8192, 8192, 8192, None]  # a NoPE layer every 4 (the default)
    assert chunks.count(None) == 12
    layout = attention_layout(c)
    assert layout is not None and layout.layers_per_group == 12
    assert (
        layout.groups()
        == [GroupSpec.full_attention()] + [GroupSpec.chunked_local_attention(8192)] * 3
    )
    assert c.layer_attention()[0] == AttentionSpec(None, 1 / math.sqrt(128), None, False, 8192)


def test_missing_fields_take_transformers_defaults() -> None:
    """A config.json with only the required fields reads as transformers reads it."""
    transformers = pytest.importorskip("transformers")
    required = ("model_type", "vocab_size", "hidden_size", "intermediate_size")
    raw = {k: SCOUT_TEXT[k] for k in (*required, "num_hidden_layers", "num_attention_heads")}
    c = config_from_hf_dict(raw)
    hf = transformers.Llama4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert c.llama4 is not None
    assert (c.head_dim, c.num_key_value_heads, c.rms_norm_eps) == (
        hf.head_dim,
        hf.num_key_value_heads,
        hf.rms_norm_eps,
    )
    assert (c.bos_token_id, c.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    assert c.max_position_embeddings == hf.max_position_embeddings
    assert c.rope_theta == hf.rope_parameters["rope_theta"] and c.rope_scaling is None
    assert (
        (c.num_local_experts, c.num_experts_per_tok)
        == (16, 1)
        == (
            hf.num_local_experts,
            hf.num_experts_per_tok,
        )
    )
    assert c.attention_chunk_size == hf.attention_chunk_size
    assert c.layer_types_resolved() == hf.layer_types
    assert list(c.llama4.no_rope_layers) == hf.no_rope_layers
    assert list(c.llama4.moe_layers) == hf.moe_layers
    assert c.llama4.intermediate_size_mlp == hf.intermediate_size_mlp
    assert (c.llama4.floor_scale, c.llama4.attn_scale) == (hf.floor_scale, hf.attn_scale)
    assert c.llama4.use_qk_norm == hf.use_qk_norm
    assert c.llama4.attn_temperature_tuning == hf.attn_temperature_tuning
    assert c.tie_word_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {**SCOUT_TEXT, "model_type": "llama4", "architectures": None},
            "Llama4ForConditionalGeneration; only the text-only Llama4ForCausalLM",
        ),
        (
            {**SCOUT_TEXT, "architectures": ["Llama4ForConditionalGeneration"]},
            r"architectures \['Llama4ForConditionalGeneration'\] are not supported",
        ),
        (
            {**SCOUT_TEXT, "layer_types": ["sliding_attention"] * 48},
            "'sliding_attention' are not supported for llama4_text",
        ),
        (
            {**SCOUT_TEXT, "attention_chunk_size": None, "layer_types": [CHUNKED] * 48},
            "chunked_attention layers but attention_chunk_size is None",
        ),
        ({**SCOUT_TEXT, "sliding_window": 128}, "sliding_window is not supported"),
        ({**SCOUT_TEXT, "no_rope_layers": [1, 2]}, "no_rope_layers must list 0 or 1"),
        ({**SCOUT_TEXT, "moe_layers": [48]}, "moe_layers"),
        ({**SCOUT_TEXT, "floor_scale": 0}, "floor_scale"),
        ({**SCOUT_TEXT, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({**SCOUT_TEXT, "rope_scaling": {"rope_type": "dynamic"}}, "'dynamic' is not supported"),
    ],
)
def test_refused_by_name(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        config_from_hf_dict(raw)


def test_llama4_fields_belong_to_llama4() -> None:
    with pytest.raises(InvalidArgumentError, match="llama4_text needs llama4"):
        tiny_config("llama4_text", llama4=None)
    with pytest.raises(InvalidArgumentError, match="applies to llama4_text, not to llama"):
        tiny_config("llama", attention_chunk_size=16)
    with pytest.raises(InvalidArgumentError, match="applies to llama4_text, not to llama"):
        tiny_config("llama", llama4=_options())


@pytest.mark.parametrize("kv_cache_groups", [True, False])
def test_chunk_not_a_multiple_of_the_block_size_is_refused(kv_cache_groups: bool) -> None:
    model = build_tiny_model(tiny_config("llama4_text", attention_chunk_size=24))
    with pytest.raises(
        InvalidArgumentError,
        match=r"attention_chunk_size \(24\) must be a multiple of block_size \(16\)",
    ):
        LLM(model, num_blocks=32, block_size=16, device="cpu", kv_cache_groups=kv_cache_groups)
    # 24 is a multiple of 8: the same model runs in blocks of 8.
    llm = LLM(model, num_blocks=32, block_size=8, device="cpu", kv_cache_groups=kv_cache_groups)
    prompt = list(range(1, 60))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = dense_greedy_generate(model, [prompt], 8)[0]
    assert llm.generate([prompt], params)[0].token_ids == want


def test_generate_cli_loads_the_checkpoint_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvblocks generate --model DIR`` on a saved tiny Llama 4: one full and three
    chunked groups, the dense model's tokens; blocks larger than the chunk are refused
    by name."""
    from kvblocks.cli import main

    model = build_tiny_model(tiny_config("llama4_text"))
    save_checkpoint(model, tmp_path)
    prompt = [(7 * i) % 250 + 1 for i in range(40)]  # three 16-token chunks
    argv = ["generate", "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt))]
    argv += ["--max-tokens", "6", "--device", "cpu"]
    assert main([*argv, "--block-size", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_cache_groups"] == 4
    assert (
        doc["outputs"][0]["completions"][0]["token_ids"]
        == (dense_greedy_generate(model, [prompt], 6)[0])
    )
    assert main([*argv, "--block-size", "32"]) == 1
    assert "attention_chunk_size (16) must be a multiple of block_size (32)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_host_tier_reloads_the_chunks(policy: str) -> None:
    """The tiny model with 32-token chunks (full + three chunked groups) over a host tier:
    a 50-token prompt pushed out of a small pool by others comes back by loads of each
    group's own blocks (the full group's three, each chunked group's block of positions
    32..47, the chunk of the hit point 48), and its tokens are the dense reference's."""
    model = build_tiny_model(tiny_config("llama4_text", attention_chunk_size=CHUNK))
    gen = torch.Generator().manual_seed(21)
    target, *others = (torch.randint(1, 256, (50,), generator=gen).tolist() for _ in range(4))
    expected = dense_greedy_generate(model, [target], 4)[0]
    llm = LLM(
        model,
        num_blocks=20,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=64,
        host_offload=policy,  # type: ignore[arg-type]
        device="cpu",
    )
    assert len(llm.manager.groups) == 4 and len(llm.runner.kv_caches) == 1
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert llm.generate([target], params)[0].token_ids == expected
    for prompt in others:
        llm.generate([prompt], params)
    again = llm.generate([target], params)[0]
    assert again.token_ids == expected
    cache = llm.stats()["cache"]
    assert again.num_cached_tokens == 48, cache
    assert cache["host_loads"] == 3 + 3 * 1, cache
    llm.manager.check_invariants()


def test_beam_search_forks_the_chunked_groups() -> None:
    """Beams forked on shared, copy-on-write blocks of every group (the chunked groups'
    current chunk, past chunks freed) over three 16-token chunks in blocks of 8: the
    beams of a dense beam search."""
    from .test_llm import _dense_beam_search

    model = build_tiny_model(tiny_config("llama4_text"))
    prompt = random_ids(1, 21, 256, 90)[0].tolist()
    llm = LLM(model, num_blocks=64, block_size=8, device="cpu")
    out = llm.generate([prompt], SamplingParams(max_tokens=20, beam_width=3, n=3))[0]
    expected = _dense_beam_search(model, prompt, 3, 20)  # type: ignore[arg-type]
    assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in expected]
    llm.manager.check_invariants()


def test_every_layer_chunked_is_one_chunked_group() -> None:
    """Without NoPE layers every layer is chunked: one chunked group of all four layers
    (so the past chunks are still freed), and the dense model's tokens."""
    model = build_tiny_model(tiny_config("llama4_text", llama4=_options(no_rope_layers=(1,) * 4)))
    llm = LLM(model, num_blocks=32, block_size=8, device="cpu")
    assert llm.manager.groups == [GroupSpec.chunked_local_attention(16)]
    assert len(llm.runner.kv_caches) == 4
    prompt = random_ids(1, 45, 256, 7)[0].tolist()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    held = []
    for rec in llm.stream([prompt], params):
        tokens = rec.outputs[0].token_ids
        if rec.outputs[0].finish_reason is None:
            computed = len(prompt) + len(tokens) - 1
            held.append((computed, llm.manager.group_stats()["num_used_blocks"][0]))
    assert tokens == dense_greedy_generate(model, [prompt], 20)[0]
    assert all(n == _held(computed, 16, 8) for computed, n in held)
    assert (59, 2) in held  # positions 48..58: two blocks, not eight
