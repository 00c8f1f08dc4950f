"""KV memory of a model's mix of sliding-window and full-attention layers (an accounting model).

A hybrid model (Gemma 2/3, gpt-oss, Ministral, OLMo 3) mixes layers that attend to every
earlier token with layers that attend to a window of the last ``W``. Uniform allocation
(what the block manager does today) keeps every token of every layer; per-layer-kind
allocation (the KV cache groups the core is growing) keeps for a window layer only the
blocks its queries can still see. This module counts both for the sequences of each
scheduled step, in *layer-blocks* (one block of ``block_size`` tokens of one layer).

The formula, for a sequence of ``L`` tokens after a step that computed its last ``q``
(the step's chunk, ``q = 1`` when decoding), with blocks of ``B`` tokens:

- a full-attention layer holds every token: ``ceil(L / B)`` blocks;
- a window-``W`` layer holds the blocks that cover the keys the step's queries see,
  positions ``max(0, L - q - (W - 1))`` to ``L - 1``:
  ``ceil(L / B) - floor(max(0, L - q - W + 1) / B)`` blocks, i.e. ``min(L, W - 1 + q)``
  tokens rounded out to whole blocks (at most ``ceil((W - 1 + q) / B) + 1``);
- uniform allocation holds ``num_layers * ceil(L / B)``.

The grouped total is the sum over the layer kinds of ``count * blocks``. It is an
accounting model of what a per-group manager would hold, not a run of one: prefix
sharing, cached free blocks and preemption are those of the uniform run that produced
the trace (the core's groups will make the number exact).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks.errors import InvalidArgumentError
from kvblocks.validation import INT32_MAX, check_int, check_optional_int

__all__ = ["LayerGroup", "LayerMix", "LayerMixTotals"]

_GROUP = re.compile(r"^(?:(sliding):(\d+)(?:x(\d+))?|(full)(?::(\d+)|x(\d+))?)$")


@dataclass(frozen=True)
class LayerGroup:
    """``count`` layers of one kind: full attention (``window`` None) or a window of ``W``."""

    window: int | None
    count: int

    @property
    def name(self) -> str:
        """``"full"`` or ``"sliding:W"``."""
        return "full" if self.window is None else f"sliding:{self.window}"


def _int_array(values: npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64)


@dataclass(frozen=True)
class LayerMix:
    """A model's layers by kind, e.g. Gemma 3: 5 window-1024 layers per full one."""

    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise InvalidArgumentError("a layer mix needs at least one layer group")
        # int32 bounds: the step accounting runs in int64 arrays (a window or count past
        # them was an OverflowError there).
        for g in self.groups:
            check_int(g.count, "layer count", minimum=1, maximum=INT32_MAX)
            check_optional_int(g.window, "window", minimum=1, maximum=INT32_MAX)
        check_int(sum(g.count for g in self.groups), "layers in all", maximum=INT32_MAX)

    @classmethod
    def parse(cls, text: str) -> LayerMix:
        """Parse ``"sliding:1024x5,full:1"``: comma-separated ``sliding:W[xN]`` (``N``
        window-``W`` layers, default 1) and ``full[:N]`` (``N`` full layers, default 1).
        Groups of the same kind and window are merged."""
        counts: dict[int | None, int] = {}
        for part in str(text).replace(" ", "").split(","):
            m = _GROUP.match(part)
            if m is None:
                raise InvalidArgumentError(
                    f"layer group {part!r} is not sliding:W[xN] or full[:N] "
                    "(e.g. --layers sliding:1024x5,full:1)"
                )
            if m.group(1):
                window: int | None = int(m.group(2))
                count = int(m.group(3) or 1)
            else:
                window, count = None, int(m.group(5) or m.group(6) or 1)
            if count < 1 or (window is not None and window < 1):
                raise InvalidArgumentError(f"layer group {part!r} needs positive numbers")
            counts[window] = counts.get(window, 0) + count
        return cls(tuple(LayerGroup(w, n) for w, n in counts.items()))

    def __str__(self) -> str:
        return ",".join(
            f"{g.name}x{g.count}" if g.window is not None else f"full:{g.count}"
            for g in self.groups
        )

    @property
    def num_layers(self) -> int:
        """Layers in all."""
        return sum(g.count for g in self.groups)

    def group_blocks(
        self, seq_lens: npt.ArrayLike, step_tokens: npt.ArrayLike, block_size: int
    ) -> list[npt.NDArray[np.int64]]:
        """Blocks one layer of each group holds, per sequence (see the module formula)."""
        lens, q = _int_array(seq_lens), _int_array(step_tokens)
        total = -(-lens // block_size)
        out = []
        for g in self.groups:
            if g.window is None:
                out.append(total)
            else:
                first = np.maximum(lens - q - (g.window - 1), 0)
                out.append(total - first // block_size)
        return out

    def grouped_blocks(
        self, seq_lens: npt.ArrayLike, step_tokens: npt.ArrayLike, block_size: int
    ) -> npt.NDArray[np.int64]:
        """Layer-blocks per sequence with one block table per layer kind."""
        per_group = self.group_blocks(seq_lens, step_tokens, block_size)
        return sum(
            (g.count * b for g, b in zip(self.groups, per_group, strict=True)),
            start=np.zeros(len(_int_array(seq_lens)), dtype=np.int64),
        )

    def uniform_blocks(self, seq_lens: npt.ArrayLike, block_size: int) -> npt.NDArray[np.int64]:
        """Layer-blocks per sequence when every layer keeps every token (today)."""
        return self.num_layers * (-(-_int_array(seq_lens) // block_size))

    def per_sequence(self, seq_len: int, block_size: int, step_tokens: int = 1) -> dict[str, Any]:
        """One sequence of ``seq_len`` tokens in a step of ``step_tokens``: blocks per layer
        of each kind, the grouped and uniform totals and their ratio."""
        per_group = [int(b[0]) for b in self.group_blocks([seq_len], [step_tokens], block_size)]
        grouped = int(self.grouped_blocks([seq_len], [step_tokens], block_size)[0])
        uniform = int(self.uniform_blocks([seq_len], block_size)[0])
        return {
            "seq_len": seq_len,
            "blocks_per_layer": {g.name: b for g, b in zip(self.groups, per_group, strict=True)},
            "grouped_layer_blocks": grouped,
            "uniform_layer_blocks": uniform,
            "grouped_over_uniform": grouped / uniform if uniform else 0.0,
        }


@dataclass
class LayerMixTotals:
    """Grouped and uniform layer-blocks of the sequences of every step of a run.

    ``add`` counts one step's batch; the means are over steps with a batch, so the ratio
    of the sums is the trace's token-weighted KV fraction under grouped allocation.
    """

    mix: LayerMix
    block_size: int
    steps: int = 0
    grouped_sum: float = 0.0
    uniform_sum: float = 0.0
    grouped_peak: int = 0
    uniform_peak: int = 0
    max_seq_len: int = 0
    seq_len_sum: float = 0.0
    seqs: int = 0

    def add(self, seq_lens: npt.ArrayLike, step_tokens: npt.ArrayLike) -> None:
        """Count one step: each scheduled sequence's length after it and its chunk."""
        lens = _int_array(seq_lens)
        if not len(lens):
            return
        grouped = int(self.mix.grouped_blocks(lens, step_tokens, self.block_size).sum())
        uniform = int(self.mix.uniform_blocks(lens, self.block_size).sum())
        self.steps += 1
        self.grouped_sum += grouped
        self.uniform_sum += uniform
        self.grouped_peak = max(self.grouped_peak, grouped)
        self.uniform_peak = max(self.uniform_peak, uniform)
        self.max_seq_len = max(self.max_seq_len, int(lens.max()))
        self.seq_len_sum += float(lens.sum())
        self.seqs += len(lens)

    @property
    def ratio(self) -> float:
        """Grouped over uniform KV, over the whole trace (1.0 before any step)."""
        return self.grouped_sum / self.uniform_sum if self.uniform_sum else 1.0

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers: means and peaks per step, the ratio, and per-sequence rows."""
        steps = max(self.steps, 1)
        mean_len = max(1, round(self.seq_len_sum / max(self.seqs, 1)))
        lengths = {"mean": mean_len, "longest": max(mean_len, self.max_seq_len)}
        return {
            "layers": str(self.mix),
            "num_layers": self.mix.num_layers,
            "mean_grouped_layer_blocks": self.grouped_sum / steps,
            "mean_uniform_layer_blocks": self.uniform_sum / steps,
            "peak_grouped_layer_blocks": self.grouped_peak,
            "peak_uniform_layer_blocks": self.uniform_peak,
            "grouped_over_uniform": self.ratio,
            "sequences_in_same_memory": 1.0 / self.ratio if self.ratio else math.inf,
            # One decoding sequence at the batches' mean and longest context.
            "per_sequence": [
                {"context": name, **self.mix.per_sequence(n, self.block_size)}
                for name, n in lengths.items()
            ],
        }
