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

from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.errors import InvalidArgumentError

__all__ = ["DenseAttention", "dense_greedy_generate", "dense_logits"]


class DenseAttention:
    """Causal (optionally windowed) attention over ``batch`` sequences of equal length.

    The flattened tokens are ``batch`` consecutive runs of ``seq_len`` tokens, each run a
    whole sequence from position 0.
    """

    def __init__(
        self, batch: int, seq_len: int, sliding_windows: Sequence[int | None], scale: float
    ) -> None:
        self.batch = batch
        self.seq_len = seq_len
        self.sliding_windows = list(sliding_windows)
        self.scale = scale

    def _mask(self, window: int | None, device: torch.device) -> Tensor:
        pos = torch.arange(self.seq_len, device=device)
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            # Key j is visible from query p iff p - W < j <= p (the ops' convention).
            visible &= pos[None, :] > pos[:, None] - window
        return visible

    def __call__(self, layer_idx: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Attention of one layer (see :class:`~kvblocks.engine.model.AttentionBackend`)."""
        b, n = self.batch, self.seq_len
        heads, dim = query.shape[1], query.shape[2]
        group = heads // key.shape[1]
        q = query.float().view(b, n, heads, dim).transpose(1, 2)
        k = key.float().view(b, n, -1, dim).transpose(1, 2).repeat_interleave(group, dim=1)
        v = value.float().view(b, n, -1, dim).transpose(1, 2).repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        mask = self._mask(self.sliding_windows[layer_idx], query.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.transpose(1, 2).reshape(b * n, heads, dim).to(query.dtype)


@torch.inference_mode()
def dense_logits(model: LlamaForCausalLM, token_ids: Tensor) -> Tensor:
    """Float32 logits ``[batch, seq_len, vocab]`` of equal-length sequences ``[batch, seq_len]``."""
    if token_ids.dim() != 2 or token_ids.shape[1] == 0:
        raise InvalidArgumentError(
            "token_ids must be a non-empty [batch, seq_len] tensor, "
            f"got shape {tuple(token_ids.shape)}"
        )
    config = model.config
    b, n = token_ids.shape
    device = next(model.parameters()).device
    ids = token_ids.to(device=device, dtype=torch.long).reshape(-1)
    positions = torch.arange(n, device=device).repeat(b)
    attention = DenseAttention(b, n, config.layer_sliding_windows(), config.default_scale)
    hidden = model(ids, positions, attention)
    return model.compute_logits(hidden).view(b, n, -1)


@torch.inference_mode()
def dense_greedy_generate(
    model: LlamaForCausalLM,
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
