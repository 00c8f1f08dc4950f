"""Llama 4's chunked local attention: the virtual batches that split a step at chunk
boundaries, the paged attention that attends each query's chunk only (past chunks'
blocks freed and poisoned), and the engine's chunked groups over a host tier, under beam
search, and with every layer chunked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblocks import GroupSpec
from kvblocks.engine import LLM
from kvblocks.engine.chunked_attention import chunked_batch
from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.runner import PagedAttention
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams

from .hf_families import random_ids
from .llama4_cases import BLOCK, CHUNK, _held, _options

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


# -- chunked groups in the engine ---------------------------------------------------------


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
