"""The sampler: greedy, temperature, top-k, top-p, seeded generators, n > 1, beam top-K."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvblocks.engine.sampler import Sampler
from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler.output import SchedulerOutput

VOCAB = 32


def _rows(
    *,
    temperature: Sequence[float],
    counts: Sequence[int] | None = None,
    top_p: Sequence[float] | None = None,
    top_k: Sequence[int] | None = None,
    seeds: Sequence[int] | None = None,
    request_ids: Sequence[str] | None = None,
    beam_topk: int = 0,
) -> SchedulerOutput:
    r = len(temperature)
    out = SchedulerOutput.empty()
    out.logits_indices = np.arange(r, dtype=np.int64)
    out.sample_seq_ids = np.arange(r, dtype=np.int64)
    out.sample_request_ids = list(request_ids or [f"r{i}" for i in range(r)])
    out.sample_counts = np.asarray(counts or [1] * r, dtype=np.int32)
    out.temperature = np.asarray(temperature, dtype=np.float32)
    out.top_p = np.asarray(top_p or [1.0] * r, dtype=np.float32)
    out.top_k = np.asarray(top_k or [0] * r, dtype=np.int32)
    out.seeds = np.asarray(seeds or [-1] * r, dtype=np.int64)
    out.beam_topk = beam_topk
    return out


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 2.0 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = _logits(5)
    res = Sampler(torch.device("cpu")).sample(logits, _rows(temperature=[0.0] * 5))
    np.testing.assert_array_equal(res.sampled_token_ids, logits.argmax(-1).numpy())
    expected = torch.log_softmax(logits, -1).max(-1).values.numpy()
    assert res.sampled_logprobs is not None
    np.testing.assert_allclose(res.sampled_logprobs, expected, rtol=1e-6)
    assert res.topk_token_ids is None and res.topk_logprobs is None


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(6)
    s = Sampler(torch.device("cpu"), seed=3)
    res = s.sample(
        logits, _rows(temperature=[1.5] * 6, top_k=[1] * 3 + [0] * 3, top_p=[1.0] * 3 + [1e-6] * 3)
    )
    np.testing.assert_array_equal(res.sampled_token_ids, logits.argmax(-1).numpy())


def test_counts_expand_rows_and_zero_counts_draw_nothing() -> None:
    logits = _logits(3)
    res = Sampler(torch.device("cpu")).sample(
        logits, _rows(temperature=[0.0, 1.0, 0.0], counts=[2, 3, 0])
    )
    assert res.sampled_token_ids.shape == (5,)
    am = logits.argmax(-1).numpy()
    assert list(res.sampled_token_ids[:2]) == [am[0], am[0]]


def test_beam_topk_is_sorted_raw_logprobs() -> None:
    logits = _logits(4)
    res = Sampler(torch.device("cpu")).sample(
        logits, _rows(temperature=[0.0] * 4, counts=[0] * 4, beam_topk=6)
    )
    assert res.sampled_token_ids.shape == (0,)
    assert res.topk_token_ids is not None and res.topk_logprobs is not None
    assert res.topk_token_ids.shape == (4, 6) and res.topk_token_ids.dtype == np.int64
    lp = torch.log_softmax(logits, -1)
    values, ids = lp.topk(6, -1)
    np.testing.assert_array_equal(res.topk_token_ids, ids.numpy())
    np.testing.assert_allclose(res.topk_logprobs, values.numpy(), rtol=1e-6)


def test_samples_follow_the_tempered_distribution() -> None:
    """Empirical frequencies of 20k draws match softmax(logits / T) (and top-k support)."""
    base = _logits(1, seed=7)
    rows = 20_000
    logits = base.expand(rows, VOCAB).contiguous()
    s = Sampler(torch.device("cpu"), seed=11)
    res = s.sample(logits, _rows(temperature=[0.7] * rows))
    freq = np.bincount(res.sampled_token_ids, minlength=VOCAB) / rows
    probs = torch.softmax(base[0] / 0.7, -1).numpy()
    assert np.abs(freq - probs).max() < 0.015
    res = s.sample(logits, _rows(temperature=[1.0] * rows, top_k=[4] * rows))
    assert set(res.sampled_token_ids.tolist()) == set(base[0].topk(4).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    rows = 4000
    s = Sampler(torch.device("cpu"), seed=5)
    res = s.sample(
        logits.expand(rows, VOCAB).contiguous(), _rows(temperature=[1.0] * rows, top_p=[0.8] * rows)
    )
    # 0.5 + 0.3 reaches 0.8: only tokens 0 and 1 remain, renormalised to 5/8 and 3/8.
    freq = np.bincount(res.sampled_token_ids, minlength=VOCAB) / rows
    assert set(np.flatnonzero(freq)) == {0, 1}
    assert abs(freq[0] - 0.625) < 0.03


def test_seeded_rows_ignore_batch_composition() -> None:
    """A seeded request draws the same tokens alone or next to other requests."""
    logits = _logits(1, seed=2)
    alone_sampler = Sampler(torch.device("cpu"), seed=0)
    alone = [
        int(
            alone_sampler.sample(
                logits, _rows(temperature=[1.0], seeds=[42], request_ids=["a"])
            ).sampled_token_ids[0]
        )
        for _ in range(20)
    ]
    mixed_sampler = Sampler(torch.device("cpu"), seed=99)
    mixed = []
    for step in range(20):
        batch = torch.cat([_logits(2, seed=100 + step), logits])
        res = mixed_sampler.sample(
            batch, _rows(temperature=[1.0] * 3, seeds=[-1, 7, 42], request_ids=["x", "y", "a"])
        )
        mixed.append(int(res.sampled_token_ids[2]))
    assert alone == mixed
    assert len(set(alone)) > 1  # it really samples


def test_forget_restarts_a_request_generator() -> None:
    logits = _logits(1)
    s = Sampler(torch.device("cpu"))
    rows = _rows(temperature=[1.0], seeds=[5], request_ids=["q"])
    first = [int(s.sample(logits, rows).sampled_token_ids[0]) for _ in range(8)]
    s.forget(["q"])
    again = [int(s.sample(logits, rows).sampled_token_ids[0]) for _ in range(8)]
    assert first == again


def test_bad_logits_shape_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="num_sample_rows=2"):
        Sampler(torch.device("cpu")).sample(_logits(3), _rows(temperature=[0.0, 0.0]))


def _with_positions(
    out: SchedulerOutput, seq_ids: list[int], seq_lens: list[int], seq_index: list[int]
) -> SchedulerOutput:
    out.seq_ids = np.asarray(seq_ids, dtype=np.int64)
    out.sample_seq_ids = out.seq_ids.copy()
    out.seq_lens = np.asarray(seq_lens, dtype=np.int32)
    out.sample_seq_index = np.asarray(seq_index, dtype=np.int64)  # type: ignore[attr-defined]
    return out


def test_counter_noise_depends_only_on_seed_index_and_position() -> None:
    """With completion indices, a seeded draw is a function of (seed, index, position).

    So a prompt row drawing n tokens equals n separate rows of indices 0..n-1 at the same
    position, in any row order and next to anything else.
    """
    logits = _logits(1, seed=8)
    s = Sampler(torch.device("cpu"), seed=0)
    prompt_row = _with_positions(
        _rows(temperature=[1.0], counts=[4], seeds=[42], request_ids=["a"]), [3], [10], [0]
    )
    together = s.sample(logits, prompt_row).sampled_token_ids.tolist()
    assert len(set(together)) > 1
    split = _with_positions(
        _rows(
            temperature=[1.0] * 5,
            seeds=[42, -1, 42, 42, 42],
            request_ids=["a", "x", "a", "a", "a"],
        ),
        [9, 1, 4, 7, 2],
        [10, 30, 10, 10, 10],
        [2, 0, 0, 3, 1],
    )
    batch = torch.cat([logits, _logits(1, seed=9), logits, logits, logits])
    got = Sampler(torch.device("cpu"), seed=5).sample(batch, split).sampled_token_ids
    assert [got[2], got[4], got[0], got[3]] == together
    # Another position gives other draws.
    moved = _with_positions(
        _rows(temperature=[1.0], counts=[4], seeds=[42], request_ids=["a"]), [3], [11], [0]
    )
    draws = [s.sample(logits, moved).sampled_token_ids.tolist() for _ in range(2)]
    assert draws[0] == draws[1] != together


def test_suppressed_tokens_are_never_drawn_but_logprobs_stay_the_models() -> None:
    logits = _logits(3, seed=5)
    best = logits.argmax(-1)
    out = _rows(temperature=[0.0, 0.0, 1.0])
    # Row 0 bans its argmax, row 1 nothing, row 2 everything but token 3.
    banned = [[int(best[0])], [], [t for t in range(VOCAB) if t != 3]]
    out.suppressed_indptr = np.cumsum([0] + [len(b) for b in banned]).astype(np.int64)
    out.suppressed_token_ids = np.array([t for b in banned for t in b], dtype=np.int64)
    res = Sampler(torch.device("cpu"), seed=1).sample(logits, out)
    tokens = res.sampled_token_ids.tolist()
    second = logits[0].clone()
    second[best[0]] = float("-inf")
    assert tokens == [int(second.argmax()), int(best[1]), 3]
    lp = torch.log_softmax(logits, -1)
    assert res.sampled_logprobs is not None
    np.testing.assert_allclose(
        res.sampled_logprobs, [float(lp[r, t]) for r, t in enumerate(tokens)], rtol=1e-6
    )


def test_a_row_that_bans_every_token_draws_as_if_nothing_were_banned() -> None:
    logits = _logits(1, seed=2)
    out = _rows(temperature=[0.0])
    out.suppressed_indptr = np.array([0, VOCAB], dtype=np.int64)
    out.suppressed_token_ids = np.arange(VOCAB, dtype=np.int64)
    res = Sampler(torch.device("cpu")).sample(logits, out)
    assert res.sampled_token_ids.tolist() == [int(logits.argmax())]


@pytest.mark.parametrize("indptr", [[0], [0, 2, 1], [1, 1, 2], [0, 1, 3], [0, -1, 2]], ids=str)
def test_malformed_suppression_is_an_invalid_argument(indptr: list[int]) -> None:
    out = _rows(temperature=[0.0, 0.0])
    out.suppressed_indptr = np.array(indptr, dtype=np.int64)
    out.suppressed_token_ids = np.array([1, 2], dtype=np.int64)
    with pytest.raises(InvalidArgumentError):
        Sampler(torch.device("cpu")).sample(_logits(2), out)
