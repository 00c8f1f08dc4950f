"""Token sampling for a batch of logit rows: greedy, temperature, top-k, top-p, beams.

All rows are processed together on the logits' device. Random draws use the
exponential-race form of categorical sampling (``argmax(p / E)`` with ``E ~ Exp(1)``),
so the randomness of a row is a vector of noise that can come from any generator.
Unseeded rows share the engine's generator (itself seeded, so a whole run is
reproducible). A seeded request's noise is a pure function of ``(seed, completion index,
position)`` when the scheduler reports each row's completion index
(``SchedulerOutput.sample_seq_index``): its output then does not depend on what shares
the batch, on preemption, or on the order in which its sequences are stepped. Without
that field, a seeded request draws from its own generator, advanced in row order, which
is independent of other requests but not of how its own sequences are scheduled.

Log-probabilities reported back (``sampled_logprobs``, ``topk_logprobs``) are the raw
model distribution's (log-softmax of the logits, temperature and truncation ignored),
which is what beam search ranks by and what a client expects as the model's log-prob.
With :attr:`Sampler.num_logprobs` set, the top-N of the same distribution is kept for
every drawn token (:attr:`Sampler.last_top_logprobs`), for ``SamplingParams.logprobs``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler.output import ModelStepResult, SchedulerOutput

__all__ = ["Sampler"]


class Sampler:
    """Samples tokens for the rows of a :class:`~kvblocks.scheduler.SchedulerOutput`.

    Args:
        device: where logits live (generators are created there).
        seed: seed of the generator shared by unseeded rows.

    Attributes:
        num_logprobs: ``N > 0``: each ``sample`` also keeps the ``N`` most likely tokens
            of every drawn token's row in :attr:`last_top_logprobs`; ``0``: off.
        last_top_logprobs: ``(token_ids int64 [D, N], logprobs float32 [D, N])`` of the
            last ``sample`` call, aligned with its ``sampled_token_ids``; ``None`` when
            ``num_logprobs`` was 0.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.num_logprobs = 0
        self.last_top_logprobs: tuple[np.ndarray, np.ndarray] | None = None
        self._global = torch.Generator(device=self.device)
        self._global.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the generators of finished requests."""
        for rid in request_ids:
            self._per_request.pop(rid, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._per_request[request_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: Tensor, out: SchedulerOutput) -> ModelStepResult:
        """Draw ``out.sample_counts[r]`` tokens from row ``r`` of ``logits`` ``[R, vocab]``."""
        rows = out.num_sample_rows
        if logits.dim() != 2 or logits.shape[0] != rows:
            raise InvalidArgumentError(
                f"logits must be [num_sample_rows={rows}, vocab], got {tuple(logits.shape)}"
            )
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        topk_ids = topk_lp = None
        if out.beam_topk > 0:
            k = min(int(out.beam_topk), logits.shape[1])
            values, indices = torch.topk(logprobs, k, dim=-1)
            topk_ids = indices.cpu().numpy().astype(np.int64)
            topk_lp = values.cpu().numpy().astype(np.float32)

        counts = np.asarray(out.sample_counts, dtype=np.int64)
        row_of = np.repeat(np.arange(rows, dtype=np.int64), counts)
        self.last_top_logprobs = None
        if self.num_logprobs > 0:
            k = min(int(self.num_logprobs), logprobs.shape[1])
            values, indices = torch.topk(logprobs, k, dim=-1)
            self.last_top_logprobs = (
                indices.cpu().numpy().astype(np.int64)[row_of],
                values.cpu().numpy().astype(np.float32)[row_of],
            )
        if row_of.size == 0:
            return ModelStepResult(
                sampled_token_ids=np.zeros(0, dtype=np.int64),
                sampled_logprobs=np.zeros(0, dtype=np.float32),
                topk_token_ids=topk_ids,
                topk_logprobs=topk_lp,
            )
        tokens = self._draw(_suppress(logits, out), out, row_of)
        row_idx = torch.from_numpy(row_of).to(self.device)
        drawn_lp = logprobs[row_idx, tokens]
        return ModelStepResult(
            sampled_token_ids=tokens.cpu().numpy().astype(np.int64),
            sampled_logprobs=drawn_lp.cpu().numpy().astype(np.float32),
            topk_token_ids=topk_ids,
            topk_logprobs=topk_lp,
        )

    def _draw(self, logits: Tensor, out: SchedulerOutput, row_of: np.ndarray) -> Tensor:
        """One token per expanded row (rows repeated by their sample count)."""
        temperature = np.asarray(out.temperature, dtype=np.float32)[row_of]
        greedy = temperature <= 0.0
        tokens = torch.empty(row_of.size, dtype=torch.long, device=self.device)
        row_idx = torch.from_numpy(row_of).to(self.device)
        if greedy.any():
            g = torch.from_numpy(np.flatnonzero(greedy)).to(self.device)
            tokens[g] = logits[row_idx[g]].argmax(dim=-1)
        if greedy.all():
            return tokens
        sampled = np.flatnonzero(~greedy)
        rows = row_of[sampled]
        s_idx = torch.from_numpy(sampled).to(self.device)
        scaled = (
            logits[torch.from_numpy(rows).to(self.device)]
            / torch.from_numpy(temperature[sampled]).to(self.device)[:, None]
        )
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        vocab = scaled.shape[1]
        top_k = np.asarray(out.top_k, dtype=np.int64)[rows]
        top_k = np.where(top_k <= 0, vocab, np.minimum(top_k, vocab))
        rank = torch.arange(vocab, device=self.device)[None, :]
        drop = rank >= torch.from_numpy(top_k).to(self.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        top_p = torch.from_numpy(np.asarray(out.top_p, dtype=np.float32)[rows]).to(self.device)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token always survives.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        counts = np.asarray(out.sample_counts, dtype=np.int64)
        draw_no = np.arange(row_of.size) - np.repeat(np.cumsum(counts) - counts, counts)
        noise = self._noise(out, rows, draw_no[sampled], vocab)
        choice = torch.argmax(probs / noise, dim=-1)
        tokens[s_idx] = order.gather(1, choice[:, None])[:, 0]
        return tokens

    def _noise(
        self, out: SchedulerOutput, rows: np.ndarray, draw_no: np.ndarray, vocab: int
    ) -> Tensor:
        """Exp(1) noise ``[len(rows), vocab]``; ``draw_no`` numbers the draws of a row."""
        noise = torch.empty(rows.size, vocab, device=self.device)
        seeds = np.asarray(out.seeds, dtype=np.int64)[rows]
        unseeded = np.flatnonzero(seeds < 0)
        if unseeded.size:
            part = torch.empty(unseeded.size, vocab, device=self.device)
            part.exponential_(generator=self._global)
            noise[torch.from_numpy(unseeded).to(self.device)] = part
        seeded = np.flatnonzero(seeds >= 0)
        if seeded.size:
            seq_index = out.sample_seq_index
            if seq_index is not None:
                self._counter_noise(out, noise, seeded, rows, draw_no, seq_index)
            else:
                self._request_noise(out, noise, seeded, rows, seeds)
        # Exp(1) can round to 0; keep the division finite.
        return noise.clamp_(min=1e-20)

    def _counter_noise(
        self,
        out: SchedulerOutput,
        noise: Tensor,
        seeded: np.ndarray,
        rows: np.ndarray,
        draw_no: np.ndarray,
        seq_index: np.ndarray,
    ) -> None:
        """Noise keyed by (seed, completion index, position): independent of scheduling."""
        seq_ids = np.asarray(out.seq_ids, dtype=np.int64)
        order = np.argsort(seq_ids, kind="stable")
        where = order[np.searchsorted(seq_ids[order], np.asarray(out.sample_seq_ids)[rows])]
        # The token drawn now lands at position seq_len (the context after this step).
        positions = np.asarray(out.seq_lens, dtype=np.int64)[where]
        index = np.asarray(seq_index, dtype=np.int64)[rows] + draw_no
        seeds = np.asarray(out.seeds, dtype=np.int64)[rows]
        gen = torch.Generator(device=self.device)
        for i in seeded.tolist():
            gen.manual_seed(_mix(int(seeds[i]), int(index[i]), int(positions[i])))
            noise[i].exponential_(generator=gen)

    def _request_noise(
        self,
        out: SchedulerOutput,
        noise: Tensor,
        seeded: np.ndarray,
        rows: np.ndarray,
        seeds: np.ndarray,
    ) -> None:
        """Noise from one generator per seeded request, advanced in row order."""
        request_ids = out.sample_request_ids
        groups: dict[str, list[int]] = {}
        for i in seeded.tolist():
            groups.setdefault(request_ids[int(rows[i])], []).append(i)
        for rid, members in groups.items():
            gen = self._generator(rid, int(seeds[members[0]]))
            part = torch.empty(len(members), noise.shape[1], device=self.device)
            part.exponential_(generator=gen)
            noise[torch.tensor(members, device=self.device)] = part


_MASK64 = (1 << 64) - 1


def _mix(seed: int, index: int, position: int) -> int:
    """A 63-bit generator seed from three integers (splitmix64-style finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _suppress(logits: Tensor, out: SchedulerOutput) -> Tensor:
    """``logits`` with the tokens ``out.suppressed_*`` bans set to ``-inf`` (a copy; the
    reported log-probs stay the model's). A row whose every token is banned is left as is:
    there is nothing else to draw."""
    indptr, banned = out.suppressed_indptr, out.suppressed_token_ids
    if indptr is None or banned is None or len(banned) == 0:
        return logits
    indptr = np.asarray(indptr, dtype=np.int64)
    banned = np.asarray(banned, dtype=np.int64)
    if (
        indptr.shape != (logits.shape[0] + 1,)
        or int(indptr[0]) != 0
        or int(indptr[-1]) != banned.shape[0]
        or bool((np.diff(indptr) < 0).any())
    ):
        raise InvalidArgumentError(
            f"suppressed_indptr must be [num_sample_rows + 1 = {logits.shape[0] + 1}] offsets "
            f"ending at len(suppressed_token_ids) = {banned.shape[0]}"
        )
    rows = np.repeat(np.arange(logits.shape[0], dtype=np.int64), np.diff(indptr))
    keep = (banned >= 0) & (banned < logits.shape[1])
    masked = logits.clone()
    r = torch.from_numpy(rows[keep]).to(logits.device)
    masked[r, torch.from_numpy(banned[keep]).to(logits.device)] = float("-inf")
    dead = torch.isinf(masked).all(dim=-1) & ~torch.isinf(logits).all(dim=-1)
    if bool(dead.any()):
        masked[dead] = logits[dead]
    return masked
