"""The Mamba 2 mixer (Bamba's recurrent layer) and the protocol that keeps its state.

A mixer projects each token to a gate ``z``, the channels ``xBC`` it convolves and a time
step per head; convolves ``xBC`` causally over ``d_conv`` positions (then SiLU); runs the
selective scan ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``
per head (``h`` is ``[d_head, d_state]``); normalises ``y * silu(z)`` by groups and
projects back. Its state after a token is the convolution's last ``d_conv - 1`` inputs
and the scan's ``h``: "the state after tokens ``[0, p)``".

The state lives where a :class:`StateBackend` keeps it: the paged engine's backend
(:class:`kvblocks.engine.state_cache.PagedStates`) reads each sequence's state from its
block and saves the states the block manager asks for (each checkpoint boundary a step
crosses, then its end), so a step's tokens are scanned in segments that end at those
positions; the dense reference (:class:`ZeroStates`) starts every sequence from zeros and
keeps nothing. Within a segment the scan is the SSD form: a masked, decay-weighted
``C B^T`` product over chunks of at most :data:`SCAN_CHUNK` tokens, with the state carried
from chunk to chunk, in float32.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvblocks.engine.mamba_config import MambaConfig
from kvblocks.engine.models.layers import Linear

__all__ = ["SCAN_CHUNK", "Mamba2Mixer", "SeqSegments", "StateBackend", "ZeroStates"]

#: Tokens per chunk of the quadratic scan (memory grows with its square).
SCAN_CHUNK = 128


@dataclass(frozen=True)
class SeqSegments:
    """One sequence's tokens in a step: rows ``[start, end)`` of the flattened batch, and
    the offsets (from ``start``, ascending, the last one ``end - start``) after which its
    state is saved; empty when nothing is saved."""

    start: int
    end: int
    cuts: tuple[int, ...]


class StateBackend(Protocol):
    """Where a step's mixers read and save each sequence's state."""

    def segments(self) -> list[SeqSegments]:
        """The step's sequences, in batch order."""
        ...

    def load(self, layer: int) -> tuple[Tensor, Tensor]:
        """Every sequence's state of mixer ``layer`` before the step: conv ``[S, conv_dim,
        d_conv - 1]`` and scan ``[S, n_heads, d_head, d_state]`` (float32, zeros for a
        sequence with no computed token)."""
        ...

    def save(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        """The states of mixer ``layer`` at every cut of every sequence, in order
        (sequence by sequence, cut by cut): conv ``[W, conv_dim, d_conv - 1]``, scan ``[W,
        n_heads, d_head, d_state]``."""
        ...


class ZeroStates:
    """The cache-free reference's backend: every run of positions starting at 0 is a whole
    sequence, computed from the zero state; nothing is saved."""

    def __init__(self, positions: Tensor, conv_shape: tuple[int, int], ssm_shape: tuple[int, ...]):
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), int(positions.shape[0])]
        self._segments = [SeqSegments(a, b, ()) for a, b in itertools.pairwise(starts)]
        self._conv_shape = conv_shape
        self._ssm_shape = ssm_shape
        self._device = positions.device

    def segments(self) -> list[SeqSegments]:
        """One segment per sequence, no cut."""
        return self._segments

    def load(self, layer: int) -> tuple[Tensor, Tensor]:
        """Zeros."""
        n = len(self._segments)
        zeros = partial(torch.zeros, dtype=torch.float32, device=self._device)
        return zeros((n, *self._conv_shape)), zeros((n, *self._ssm_shape))

    def save(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        """Nothing is kept."""


def _scan(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h: Tensor
) -> tuple[Tensor, Tensor]:
    """The selective scan over one segment from state ``h``: outputs ``[n, heads, d_head]``
    (without the ``D x`` skip) and the state after it.

    ``x`` ``[n, heads, d_head]``, ``dt`` ``[n, heads]`` (discretised), ``a`` ``[heads]``
    (negative), ``b``/``c`` ``[n, heads, d_state]``, ``h`` ``[heads, d_head, d_state]``.
    """
    outs = []
    for lo in range(0, x.shape[0], SCAN_CHUNK):
        xs, dts = x[lo : lo + SCAN_CHUNK], dt[lo : lo + SCAN_CHUNK]
        bs, cs = b[lo : lo + SCAN_CHUNK], c[lo : lo + SCAN_CHUNK]
        # Log-decay from the chunk's start to each token, per head.
        cum = torch.cumsum(dts * a, dim=0)
        n = xs.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        # decay[t, s] = exp(cum[t] - cum[s]) for s <= t: how much token s's input is left at t.
        decay = torch.exp(
            (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[..., None], -torch.inf)
        )
        scores = torch.einsum("thn,shn->tsh", cs, bs) * decay * dts[None, :, :]
        y = torch.einsum("tsh,shp->thp", scores, xs)
        y = y + torch.exp(cum)[..., None] * torch.einsum("thn,hpn->thp", cs, h)
        to_end = torch.exp(cum[-1][None, :] - cum) * dts
        h = torch.exp(cum[-1])[:, None, None] * h + torch.einsum("sh,shp,shn->hpn", to_end, xs, bs)
        outs.append(y)
    return torch.cat(outs), h


class Mamba2Mixer(nn.Module):
    """Bamba's Mamba 2 mixer over the flattened tokens of a step (HF ``BambaMixer``'s
    parameters: ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
    ``out_proj``).

    Args:
        layer: which mixer this is among the model's mixers (its state's index).
    """

    def __init__(
        self,
        config: MambaConfig,
        hidden_size: int,
        eps: float,
        layer: int,
        *,
        device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.cfg = config
        self.inner = config.inner_size(hidden_size)
        self.conv_dim = config.conv_dim(hidden_size)
        self.eps = eps
        heads = config.n_heads
        linear = partial(Linear, bias=config.proj_bias, device=device, dtype=dtype)
        self.in_proj = linear(hidden_size, self.inner + self.conv_dim + heads)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            config.d_conv,
            groups=self.conv_dim,
            bias=config.conv_bias,
            padding=config.d_conv - 1,
            device=device,
            dtype=dtype,
        )
        self.dt_bias = nn.Parameter(torch.empty(heads, device=device, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(heads, device=device, dtype=dtype))
        self.D = nn.Parameter(torch.empty(heads, device=device, dtype=dtype))
        self.norm = _GatedNorm(self.inner, config.n_groups, eps, device=device, dtype=dtype)
        self.out_proj = linear(self.inner, hidden_size)

    @property
    def conv_shape(self) -> tuple[int, int]:
        """One sequence's convolution state: its last ``d_conv - 1`` inputs per channel."""
        return self.conv_dim, self.cfg.d_conv - 1

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """One sequence's scan state."""
        return self.cfg.n_heads, self.cfg.d_head, self.cfg.d_state

    def forward(self, hidden: Tensor, states: StateBackend) -> Tensor:
        """The mixer over ``hidden`` ``[num_tokens, hidden_size]``."""
        proj = self.in_proj(hidden)
        gate, xbc, dt = torch.split(proj, [self.inner, self.conv_dim, self.cfg.n_heads], dim=-1)
        conv, ssm = states.load(self.layer)
        segments = states.segments()
        y = torch.empty(hidden.shape[0], self.inner, dtype=torch.float32, device=hidden.device)
        saved_conv, saved_ssm = [], []
        for i, seg in enumerate(segments):
            out, convs, hs = self._sequence(xbc[seg.start : seg.end], dt[seg.start : seg.end],
                                            conv[i], ssm[i], seg.cuts)  # fmt: skip
            y[seg.start : seg.end] = out
            saved_conv.extend(convs)
            saved_ssm.extend(hs)
        if saved_conv:
            states.save(self.layer, torch.stack(saved_conv), torch.stack(saved_ssm))
        projected: Tensor = self.out_proj(self.norm(y, gate).to(hidden.dtype))
        return projected

    def _sequence(
        self, xbc: Tensor, dt: Tensor, conv: Tensor, h: Tensor, cuts: tuple[int, ...]
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """One sequence's outputs ``[n, inner]`` from its state, and its states at ``cuts``."""
        cfg = self.cfg
        k = cfg.d_conv - 1
        # The convolution sees the state's inputs, then the step's.
        window = torch.cat([conv.to(xbc.dtype), xbc.transpose(0, 1)], dim=1)
        mixed = F.silu(
            F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0]
        ).transpose(0, 1)
        groups = cfg.n_groups * cfg.d_state
        x, b, c = torch.split(mixed.float(), [self.inner, groups, groups], dim=-1)
        n, heads, per_group = x.shape[0], cfg.n_heads, cfg.n_heads // cfg.n_groups
        x = x.view(n, heads, cfg.d_head)
        b = b.view(n, cfg.n_groups, cfg.d_state).repeat_interleave(per_group, dim=1)
        c = c.view(n, cfg.n_groups, cfg.d_state).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        a = -torch.exp(self.A_log.float())
        ys, convs, hs = [], [], []
        lo = 0
        for cut in cuts or (n,):
            y, h = _scan(x[lo:cut], dt[lo:cut], a, b[lo:cut], c[lo:cut], h)
            ys.append(y)
            if cuts:
                convs.append(window[:, cut : cut + k].float())
                hs.append(h)
            lo = cut
        y = torch.cat(ys) + self.D.float()[None, :, None] * x
        return y.reshape(n, self.inner), convs, hs


class _GatedNorm(nn.Module):
    """RMSNorm of ``y * silu(gate)`` over each of ``groups`` equal parts, in float32."""

    def __init__(
        self, size: int, groups: int, eps: float, *, device: torch.device | None,
        dtype: torch.dtype | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.groups = groups
        self.eps = eps

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        """Normalise ``y`` ``[n, size]`` gated by ``gate``."""
        g = (y.float() * F.silu(gate.float())).view(y.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(y.shape).to(y.dtype)
