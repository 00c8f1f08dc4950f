"""The cache-free dense reference: full causal attention over every token, every step.

This is the ground truth the paged engine is tested against and the baseline its
benchmark is measured against: no KV cache at all, each decoding step recomputes the
whole sequence. Attention is plain masked softmax in float32 over explicitly materialised
scores, deliberately independent of :mod:`kvblocks.ops`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from kvblocks.engine.config import AttentionSpec
from kvblocks.engine.models import CausalLM
from kvblocks.errors import InvalidArgumentError

__all__ = ["DenseAttention", "dense_greedy_generate", "dense_logits"]


class DenseAttention:
    """Causal attention over ``batch`` sequences of equal length, per each layer's spec.

    The flattened tokens are ``batch`` consecutive runs of ``seq_len`` tokens, each run a
    whole sequence from position 0. Windows, chunks, soft-caps and sinks are applied as
    transformers writes them: the sink logit is one more score column, dropped after
    the softmax.
    """

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch = batch
        self.seq_len = seq_len

    def _mask(self, window: int | None, chunk: int | None, device: torch.device) -> Tensor:
        pos = torch.arange(self.seq_len, device=device)
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            # Key j is visible from query p iff p - W < j <= p (the ops' convention).
            visible &= pos[None, :] > pos[:, None] - window
        if chunk is not None:
            # Chunked local attention: only the keys of the query's own chunk.
            visible &= pos[None, :] // chunk == pos[:, None] // chunk
        return visible

    def __call__(
        self,
        layer_idx: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        spec: AttentionSpec,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Attention of one layer (see :class:`~kvblocks.engine.models.AttentionBackend`)."""
        b, n = self.batch, self.seq_len
        heads, dim = query.shape[1], query.shape[2]
        group = heads // key.shape[1]
        q = query.float().view(b, n, heads, dim).transpose(1, 2)
        k = key.float().view(b, n, -1, dim).transpose(1, 2).repeat_interleave(group, dim=1)
        v = value.float().view(b, n, -1, dim).transpose(1, 2).repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
        if spec.soft_cap is not None:
            scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
        mask = self._mask(spec.sliding_window, spec.chunk_size, query.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            column = sinks.float().view(1, heads, 1, 1).expand(b, heads, n, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        out = torch.matmul(probs, v)
        return out.transpose(1, 2).reshape(b * n, heads, dim).to(query.dtype)


@torch.inference_mode()
def dense_logits(model: CausalLM, token_ids: Tensor) -> Tensor:
    """Float32 logits ``[batch, seq_len, vocab]`` of equal-length sequences ``[batch, seq_len]``."""
    if token_ids.dim() != 2 or token_ids.shape[1] == 0:
        raise InvalidArgumentError(
            "token_ids must be a non-empty [batch, seq_len] tensor, "
            f"got shape {tuple(token_ids.shape)}"
        )
    b, n = token_ids.shape
    device = next(model.parameters()).device
    ids = token_ids.to(device=device, dtype=torch.long).reshape(-1)
    positions = torch.arange(n, device=device).repeat(b)
    attention = DenseAttention(b, n)
    hidden = model(ids, positions, attention)
    return model.compute_logits(hidden).view(b, n, -1)


@torch.inference_mode()
def dense_greedy_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy continuation of each prompt by recomputing the full sequence every step.

    Prompts of equal length run as one batch. Generation of a prompt stops after
    ``max_tokens`` tokens or right after emitting one of ``stop_token_ids``.
    """
    if max_tokens < 0:
        raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise InvalidArgumentError("every prompt needs at least one token")
    stops = set(stop_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        groups[len(prompt)].append(i)
    for members in groups.values():
        seqs = torch.tensor([list(prompts[i]) for i in members], dtype=torch.long)
        alive = list(members)
        for _ in range(max_tokens):
            if not alive:
                break
            next_ids = dense_logits(model, seqs)[:, -1, :].argmax(dim=-1).cpu()
            seqs = torch.cat([seqs, next_ids[:, None]], dim=1)
            keep = []
            for row, req in enumerate(alive):
                token = int(next_ids[row])
                outputs[req].append(token)
                if token not in stops:
                    keep.append(row)
            if len(keep) != len(alive):
                seqs = seqs[keep]
                alive = [alive[r] for r in keep]
    return outputs
