"""Token sampling for a batch of logit rows: greedy, temperature, top-k, top-p, beams.

All rows are processed together on the logits' device. Random draws use the
exponential-race form of categorical sampling (``argmax(p / E)`` with ``E ~ Exp(1)``),
so the randomness of a row is a vector of noise that can come from any generator: rows
of a seeded request draw their noise from that request's own ``torch.Generator``, which
makes its output independent of whatever else shares the batch; the other rows share
the engine's generator (itself seeded, so a whole run is reproducible).

Log-probabilities reported back (``sampled_logprobs``, ``topk_logprobs``) are the raw
model distribution's (log-softmax of the logits, temperature and truncation ignored),
which is what beam search ranks by and what a client expects as the model's log-prob.
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
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = torch.device(device)
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
        if row_of.size == 0:
            return ModelStepResult(
                sampled_token_ids=np.zeros(0, dtype=np.int64),
                sampled_logprobs=np.zeros(0, dtype=np.float32),
                topk_token_ids=topk_ids,
                topk_logprobs=topk_lp,
            )
        tokens = self._draw(logits, out, row_of)
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
        noise = self._noise(out, rows, vocab)
        choice = torch.argmax(probs / noise, dim=-1)
        tokens[s_idx] = order.gather(1, choice[:, None])[:, 0]
        return tokens

    def _noise(self, out: SchedulerOutput, rows: np.ndarray, vocab: int) -> Tensor:
        """Exp(1) noise ``[len(rows), vocab]``: per-request generators for seeded rows."""
        noise = torch.empty(rows.size, vocab, device=self.device)
        seeds = np.asarray(out.seeds, dtype=np.int64)[rows]
        unseeded = np.flatnonzero(seeds < 0)
        if unseeded.size:
            part = torch.empty(unseeded.size, vocab, device=self.device)
            part.exponential_(generator=self._global)
            noise[torch.from_numpy(unseeded).to(self.device)] = part
        seeded = np.flatnonzero(seeds >= 0)
        if seeded.size:
            request_ids = out.sample_request_ids
            # Group a request's rows so its generator advances once per step, in row order.
            groups: dict[str, list[int]] = {}
            for i in seeded.tolist():
                groups.setdefault(request_ids[int(rows[i])], []).append(i)
            for rid, members in groups.items():
                gen = self._generator(rid, int(seeds[members[0]]))
                part = torch.empty(len(members), vocab, device=self.device)
                part.exponential_(generator=gen)
                noise[torch.tensor(members, device=self.device)] = part
        # Exp(1) can round to 0; keep the division finite.
        return noise.clamp_(min=1e-20)
