"""A window group's attention through its exports equals dense sliding-window attention.

A real scheduler runs a full + sliding-window model (window not a multiple of the block
size) through chunked prefills and decodes; each token's K/V, a pure function of (token,
position, group), is written through each group's slot mapping into a cache that starts
as noise. For the window group, FlashInfer's semantics over the pages exported with
``skip_released`` (queries at the end of the ``seq_len - kv_start`` tokens it sees, masked
by ``window_left`` on the query-key distance) and FlashAttention's over ``block_table``
with the null entries in place (absolute positions, ``window_size``) must both give dense
sliding-window attention over the sequence's own K/V; the full group's exports, dense
causal attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvblocks import GroupSpec, KVCacheManager  # noqa: E402
from kvblocks.scheduler import (  # noqa: E402
    ModelStepResult,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

BS, WINDOW, NUM_BLOCKS = 4, 7, 96
HEADS, HEAD_SIZE, VOCAB, MAX_POS = 2, 8, 64, 128
Tensor = Any


def _attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, window: int | None) -> Tensor:
    """Queries at ``q_pos`` over keys at positions ``0..len(k)``: causal, and within
    ``window`` (the last ``window`` positions, the query's own included) when given."""
    scores = torch.einsum("qhd,lhd->hql", q, k) / HEAD_SIZE**0.5
    dist = q_pos.unsqueeze(1) - torch.arange(k.shape[0]).unsqueeze(0)
    masked = dist < 0
    if window is not None:
        masked |= dist >= window
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


class _Model:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.gen = gen
        self.k = torch.randn(2, VOCAB, MAX_POS, HEADS, HEAD_SIZE, generator=gen)
        self.v = torch.randn(2, VOCAB, MAX_POS, HEADS, HEAD_SIZE, generator=gen)
        # [num_blocks, block_size, heads, head_size] (FlashAttention's layout), noise.
        self.k_cache = torch.randn(NUM_BLOCKS, BS, HEADS, HEAD_SIZE, generator=gen) * 100
        self.v_cache = torch.randn(NUM_BLOCKS, BS, HEADS, HEAD_SIZE, generator=gen) * 100

    def write(self, out: SchedulerOutput) -> None:
        tokens = torch.from_numpy(out.input_token_ids)
        pos = torch.from_numpy(out.positions)
        for g in range(out.num_groups):
            slots = torch.from_numpy(out.group_slot_mappings[g])
            self.k_cache.view(-1, HEADS, HEAD_SIZE)[slots] = self.k[g, tokens, pos]
            self.v_cache.view(-1, HEADS, HEAD_SIZE)[slots] = self.v[g, tokens, pos]


def _check_step(model: _Model, mgr: KVCacheManager, out: SchedulerOutput) -> int:
    """Both exports of both groups against dense attention; the window pages skipped."""
    q = torch.randn(out.num_tokens, HEADS, HEAD_SIZE, generator=model.gen)
    skipped = 0
    for g, window in ((0, None), (1, WINDOW)):
        fi = out.flashinfer_page_table(BS, g, skip_released=True)
        fa = out.flash_attention_page_table(BS, g)
        assert fi.kv_start is not None
        for i, seq in enumerate(out.seq_ids.tolist()):
            lo, hi = int(out.query_start_loc[i]), int(out.query_start_loc[i + 1])
            seq_len = int(out.seq_lens[i])
            toks = torch.from_numpy(mgr.token_ids(seq)[:seq_len].astype(np.int64))
            all_pos = torch.arange(seq_len)
            want = _attend(
                q[lo:hi], model.k[g, toks, all_pos], model.v[g, toks, all_pos],
                torch.arange(seq_len - (hi - lo), seq_len), window,
            )  # fmt: skip
            # FlashInfer: the pages it is given, positions relative to the first one.
            a, b = int(fi.kv_indptr[i]), int(fi.kv_indptr[i + 1])
            kv_len = (b - a - 1) * BS + int(fi.kv_last_page_len[i])
            pages = torch.from_numpy(fi.kv_indices[a:b]).long()
            k = model.k_cache[pages].reshape(-1, HEADS, HEAD_SIZE)[:kv_len]
            v = model.v_cache[pages].reshape(-1, HEADS, HEAD_SIZE)[:kv_len]
            rel = torch.arange(kv_len - (hi - lo), kv_len)
            torch.testing.assert_close(_attend(q[lo:hi], k, v, rel, window), want)
            skipped += int(fi.kv_start[i]) > 0
            # FlashAttention: block_table in place, absolute positions.
            t = torch.arange(int(fa.cache_seqlens[i]))
            blocks = torch.from_numpy(fa.block_table[i]).long()[t // BS]
            k, v = model.k_cache[blocks, t % BS], model.v_cache[blocks, t % BS]
            got = _attend(q[lo:hi], k, v, torch.arange(seq_len - (hi - lo), seq_len), window)
            torch.testing.assert_close(got, want)
    return skipped


def test_window_group_attention_through_both_exports_is_dense_window_attention() -> None:
    mgr = KVCacheManager(
        NUM_BLOCKS, BS, groups=[GroupSpec.full_attention(), GroupSpec.sliding_window(WINDOW)]
    )
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6))
    rng = np.random.default_rng(0)
    for i, n in enumerate([5, 19, 33, 12]):
        prompt = rng.integers(0, VOCAB, n).tolist()
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=9)))
    model = _Model()
    steps = skipped = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not out.memory_ops
        if not out.is_empty:
            model.write(out)
            skipped += _check_step(model, mgr, out)
            steps += 1
        sampled = rng.integers(0, VOCAB, int(out.sample_counts.sum()))
        sched.update(out, ModelStepResult(sampled.astype(np.int64)))
    assert steps > 5 and skipped > 10
