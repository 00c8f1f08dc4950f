"""Attention through the FlashInfer / FlashAttention exports reads the right K/V.

A real :class:`KVCacheManager` + :class:`Scheduler` run a few mixed prefill/decode steps
(chunked prefill, prefix-cache hits); each computed token's K/V, a pure function of
(token, position), is written through ``slot_mapping`` into a cache that starts as noise.
Every step, the two reference attentions below, written only from the libraries' documented
semantics of their page-table arguments, must gather exactly the dense K/V of every
sequence and agree with :func:`kvblocks.ops.reference.paged_prefill_attention` and with
dense causal attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvblocks import KVCacheManager  # noqa: E402
from kvblocks.ops import reference  # noqa: E402
from kvblocks.page_tables import (  # noqa: E402
    FlashAttentionPageTable,
    FlashInferPageTable,
    flash_attention_page_table,
    flashinfer_page_table,
)
from kvblocks.scheduler import (  # noqa: E402
    ModelStepResult,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

BS = 4
NUM_BLOCKS = 96
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 8
VOCAB, MAX_POS = 64, 128
COMMON = list(range(40, 50))  # 10-token shared prefix: two full blocks to share

Tensor = Any


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of ``q`` [n, H, D], the last ``n`` positions of ``k``/``v`` [L, Hkv, D]."""
    n, length = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) / HEAD_SIZE**0.5
    q_pos = torch.arange(length - n, length).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(length) > q_pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


def flashinfer_gather(
    cache: Tensor, pt: FlashInferPageTable, seq: int
) -> Tensor:  # cache: HND pages [num_pages, Hkv, page_size, D]
    """Sequence ``seq``'s K (or V) [kv_len, Hkv, D] as FlashInfer reads the CSR table.

    Pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; length ``(num_pages - 1) *
    page_size + kv_last_page_len[i]``, 0 for an empty page range.
    """
    start, end = int(pt.kv_indptr[seq]), int(pt.kv_indptr[seq + 1])
    pages = torch.from_numpy(pt.kv_indices[start:end]).long()
    num_pages = end - start
    kv_len = 0 if num_pages == 0 else (num_pages - 1) * pt.page_size + int(pt.kv_last_page_len[seq])
    tokens = cache[pages].permute(0, 2, 1, 3).reshape(num_pages * pt.page_size, KV_HEADS, -1)
    return tokens[:kv_len]


def flash_attention_gather(cache_nhd: Tensor, pt: FlashAttentionPageTable, seq: int) -> Tensor:
    """Sequence ``seq``'s K (or V) [L, Hkv, D] as FlashAttention reads ``block_table``.

    ``cache_nhd`` is ``[num_blocks, page_block_size, Hkv, D]``; token ``t <
    cache_seqlens[i]`` is at block ``block_table[i, t // page_block_size]``, offset
    ``t % page_block_size``.
    """
    page = cache_nhd.shape[1]
    t = torch.arange(int(pt.cache_seqlens[seq]))
    blocks = torch.from_numpy(pt.block_table[seq]).long()[t // page]
    return cache_nhd[blocks, t % page]


def flashinfer_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, pt: FlashInferPageTable
) -> Tensor:
    """``BatchPrefillWithPagedKVCacheWrapper`` semantics (causal), HND cache layout."""
    assert pt.qo_indptr is not None
    out = torch.zeros_like(q)
    for seq in range(pt.num_seqs):
        lo, hi = int(pt.qo_indptr[seq]), int(pt.qo_indptr[seq + 1])
        if hi > lo:
            k = flashinfer_gather(k_cache, pt, seq)
            out[lo:hi] = _attend(q[lo:hi], k, flashinfer_gather(v_cache, pt, seq))
    return out


def flash_attention_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, pt: FlashAttentionPageTable
) -> Tensor:
    """``flash_attn_varlen_func(..., block_table=...)`` semantics (causal)."""
    assert pt.cu_seqlens_q is not None
    # FlashAttention's paged cache is [num_blocks, page_block_size, Hkv, D].
    k_nhd, v_nhd = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
    out = torch.zeros_like(q)
    for seq in range(pt.num_seqs):
        lo, hi = int(pt.cu_seqlens_q[seq]), int(pt.cu_seqlens_q[seq + 1])
        assert hi - lo <= pt.max_seqlen_q
        if hi > lo:
            k = flash_attention_gather(k_nhd, pt, seq)
            out[lo:hi] = _attend(q[lo:hi], k, flash_attention_gather(v_nhd, pt, seq))
    return out


class _Model:
    """K/V of a token = table lookups by (token, position); the cache starts as noise."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        shape = (KV_HEADS, HEAD_SIZE)
        self.k_tok, self.v_tok = (torch.randn(VOCAB, *shape, generator=self.gen) for _ in "kv")
        self.k_pos, self.v_pos = (torch.randn(MAX_POS, *shape, generator=self.gen) for _ in "kv")
        cache_shape = (NUM_BLOCKS, KV_HEADS, BS, HEAD_SIZE)
        self.k_cache = torch.randn(cache_shape, generator=self.gen) * 100
        self.v_cache = torch.randn(cache_shape, generator=self.gen) * 100
        self.tokens: dict[int, dict[int, int]] = {}  # seq id -> position -> token

    def kv(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.k_tok[tokens] + self.k_pos[positions], self.v_tok[tokens] + self.v_pos[
            positions
        ]

    def write(self, out: SchedulerOutput) -> None:
        tokens = torch.from_numpy(out.input_token_ids)
        positions = torch.from_numpy(out.positions)
        k, v = self.kv(tokens, positions)
        slots = torch.from_numpy(out.slot_mapping)
        reference.reshape_and_cache(k, v, self.k_cache, self.v_cache, slots)
        seq_of_token = np.repeat(out.seq_ids, out.num_scheduled_tokens)
        for seq, pos, tok in zip(
            seq_of_token.tolist(), out.positions.tolist(), out.input_token_ids.tolist(), strict=True
        ):
            self.tokens.setdefault(seq, {})[pos] = tok

    def dense(self, seq: int, length: int) -> tuple[Tensor, Tensor]:
        """The K/V the sequence's first ``length`` positions must hold."""
        known = self.tokens[seq]
        # Positions this sequence never computed came from the prefix cache: the shared prefix.
        toks = torch.tensor(
            [known.get(p, COMMON[p] if p < len(COMMON) else -1) for p in range(length)]
        )
        assert bool((toks >= 0).all())
        return self.kv(toks, torch.arange(length))


def _run_steps(check: Any, seed: int = 0, steps: int = 14) -> int:
    """Drive a real scheduler; call ``check(model, out, query)`` on every non-empty step."""
    rng = np.random.default_rng(seed)
    manager = KVCacheManager(NUM_BLOCKS, BS)
    sched = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))
    for i, extra in enumerate([1, 0, 7, 22, 3, 13]):
        # Distinct first suffix token: only blocks inside COMMON can be shared.
        prompt = [*COMMON[: 4 + 3 * i], 1 + i, *rng.integers(0, VOCAB, extra).tolist()]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=6)))
    model = _Model(seed)
    checked = 0
    for _ in range(steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert not out.memory_ops, "no preemption or copy-on-write expected here"
        if not out.is_empty:
            model.write(out)
            query = torch.randn(out.num_tokens, HEADS, HEAD_SIZE, generator=model.gen)
            check(model, out, query)
            checked += 1
        sampled = rng.integers(0, VOCAB, int(out.sample_counts.sum()))
        sched.update(out, ModelStepResult(sampled.astype(np.int64)))
    return checked


def _mixed_steps_seen() -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    _run_steps(lambda m, out, q: seen.append((out.num_decode_seqs, out.num_seqs)))
    return seen


def test_run_covers_mixed_batches() -> None:
    seen = _mixed_steps_seen()
    assert any(0 < decodes < seqs for decodes, seqs in seen), seen


def _persistent(
    out: SchedulerOutput, rng: np.random.Generator
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The step's table scattered into a wider persistent table full of wrong block ids."""
    max_seqs, max_blocks = out.num_seqs + 5, out.block_tables.shape[1] + 3
    table = rng.integers(1, NUM_BLOCKS, (max_seqs, max_blocks)).astype(np.int32)
    rows = rng.permutation(max_seqs)[: out.num_seqs].astype(np.int32)
    table[rows, : out.block_tables.shape[1]] = out.block_tables
    used = (out.seq_lens + BS - 1) // BS
    # Stale ids past each row's used blocks: an export must not read them.
    for r, n in zip(rows.tolist(), used.tolist(), strict=True):
        table[r, n:] = rng.integers(1, NUM_BLOCKS, max_blocks - n)
    return table, rows


@pytest.mark.parametrize("persistent", [False, True])
def test_gather_reads_exactly_the_written_kv(persistent: bool) -> None:
    rng = np.random.default_rng(1)

    def check(model: _Model, out: SchedulerOutput, query: Tensor) -> None:
        if persistent:
            table, rows = _persistent(out, rng)
            fi = flashinfer_page_table(table, out.seq_lens, BS, out.query_start_loc, rows=rows)
            fa = flash_attention_page_table(table, out.seq_lens, BS, out.query_start_loc, rows=rows)
        else:
            fi, fa = out.flashinfer_page_table(BS), out.flash_attention_page_table(BS)
        k_nhd = model.k_cache.permute(0, 2, 1, 3)
        for seq, (seq_id, length) in enumerate(
            zip(out.seq_ids.tolist(), out.seq_lens.tolist(), strict=True)
        ):
            dense_k, _ = model.dense(seq_id, length)
            assert torch.equal(flashinfer_gather(model.k_cache, fi, seq), dense_k)
            assert torch.equal(flash_attention_gather(k_nhd, fa, seq), dense_k)

    assert _run_steps(check) >= 8


def test_attention_matches_ops_reference_and_dense() -> None:
    def check(model: _Model, out: SchedulerOutput, query: Tensor) -> None:
        fi, fa = out.flashinfer_page_table(BS), out.flash_attention_page_table(BS)
        via_fi = flashinfer_attention(query, model.k_cache, model.v_cache, fi)
        via_fa = flash_attention_attention(query, model.k_cache, model.v_cache, fa)
        via_ops = reference.paged_prefill_attention(
            query,
            model.k_cache,
            model.v_cache,
            torch.from_numpy(out.block_tables),
            torch.from_numpy(out.query_start_loc),
            torch.from_numpy(out.seq_lens),
        )
        dense = torch.zeros_like(query)
        qsl = out.query_start_loc.tolist()
        for seq, (seq_id, length) in enumerate(
            zip(out.seq_ids.tolist(), out.seq_lens.tolist(), strict=True)
        ):
            k, v = model.dense(seq_id, length)
            dense[qsl[seq] : qsl[seq + 1]] = _attend(query[qsl[seq] : qsl[seq + 1]], k, v)
        for got in (via_fi, via_fa, via_ops):
            torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)

    assert _run_steps(check) >= 8


def _off_by_one_variants(
    fi: FlashInferPageTable, fa: FlashAttentionPageTable
) -> list[tuple[str, Any, Any]]:
    def fi_with(**kw: Any) -> FlashInferPageTable:
        return FlashInferPageTable(**{**fi.__dict__, **kw})

    def fa_with(**kw: Any) -> FlashAttentionPageTable:
        return FlashAttentionPageTable(**{**fa.__dict__, **kw})

    last = fi.kv_last_page_len
    return [
        ("last_page_len - 1", fi_with(kv_last_page_len=np.maximum(last - 1, 1)), fa),
        ("last_page_len + 1", fi_with(kv_last_page_len=np.minimum(last + 1, BS)), fa),
        (
            "last_page_len = len % page",
            fi_with(kv_last_page_len=(fa.cache_seqlens % BS).astype(np.int32)),
            fa,
        ),
        ("cache_seqlens - 1", fi, fa_with(cache_seqlens=np.maximum(fa.cache_seqlens - 1, 1))),
        (
            "cache_seqlens + 1",
            fi,
            fa_with(cache_seqlens=np.minimum(fa.cache_seqlens + 1, fa.block_table.shape[1] * BS)),
        ),
    ]


def test_off_by_one_exports_are_caught() -> None:
    """The comparison above is sharp: each off-by-one export changes some step's output."""
    caught: dict[str, bool] = {}

    def check(model: _Model, out: SchedulerOutput, query: Tensor) -> None:
        fi, fa = out.flashinfer_page_table(BS), out.flash_attention_page_table(BS)
        good_fi = flashinfer_attention(query, model.k_cache, model.v_cache, fi)
        good_fa = flash_attention_attention(query, model.k_cache, model.v_cache, fa)
        for name, bad_fi, bad_fa in _off_by_one_variants(fi, fa):
            got_fi = flashinfer_attention(query, model.k_cache, model.v_cache, bad_fi)
            got_fa = flash_attention_attention(query, model.k_cache, model.v_cache, bad_fa)
            differs = not torch.allclose(got_fi, good_fi, atol=1e-5) or not torch.allclose(
                got_fa, good_fa, atol=1e-5
            )
            caught[name] = caught.get(name, False) or differs

    _run_steps(check)
    assert caught and all(caught.values()), caught
