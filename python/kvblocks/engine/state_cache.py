"""The recurrent states of a hybrid model's mixers, kept in the block pool's blocks.

The block manager's state groups give each sequence one state block per group (the state
after its computed tokens) and name, for every step, where each sequence's state is read
and where the states it crosses are saved (``KVCacheManager.state_mapping``, one per state
group in ``SchedulerOutput.state_mappings``). A block of a state group holds the states of
its ``L`` layer slots (:mod:`kvblocks.engine.layer_groups`); the engine keeps, per layer
slot, a convolution tensor ``[num_blocks, conv_dim, d_conv - 1]`` and a scan tensor
``[num_blocks, n_heads, d_head, d_state]`` (float32), indexed by the pool's block ids, next
to the attention layers' KV caches. Copies and swaps move a block in both.

A host-tier row of a state group's block (:meth:`StateCache.gather_rows`,
:meth:`StateCache.scatter_rows`) holds that block's states, not KV: every slot's
convolution state, then every slot's scan state, as float32 bytes (``row_nbytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvblocks.engine.layer_groups import HybridLayout
from kvblocks.engine.models.mamba2 import Mamba2Mixer, SeqSegments
from kvblocks.errors import InvalidArgumentError

__all__ = ["PagedStates", "StateCache", "state_block_bytes"]


def state_block_bytes(mixer: Mamba2Mixer, layout: HybridLayout) -> int:
    """Bytes of one block's states across its ``L`` layer slots (float32)."""
    conv = int(np.prod(mixer.conv_shape))
    ssm = int(np.prod(mixer.ssm_shape))
    return 4 * layout.layers_per_group * (conv + ssm)


class StateCache:
    """The state tensors of every layer slot, on the device and in CPU swap space."""

    def __init__(
        self,
        mixers: Sequence[Mamba2Mixer],
        layout: HybridLayout,
        *,
        num_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        if len(mixers) != layout.num_mixers:
            raise InvalidArgumentError(
                f"the model has {len(mixers)} mixers but the layout {layout.num_mixers}"
            )
        self.layout = layout
        conv, ssm = mixers[0].conv_shape, mixers[0].ssm_shape
        slots = layout.layers_per_group
        f32 = torch.float32
        self.conv = torch.zeros((slots, num_blocks, *conv), dtype=f32, device=device)
        self.ssm = torch.zeros((slots, num_blocks, *ssm), dtype=f32, device=device)
        self.cpu_conv = torch.zeros(
            (slots, num_cpu_blocks, *conv), dtype=f32, pin_memory=pin_memory
        )
        self.cpu_ssm = torch.zeros((slots, num_cpu_blocks, *ssm), dtype=f32, pin_memory=pin_memory)

    def copy(self, pairs: np.ndarray) -> None:
        """``(src, dst)`` block copies whose pairs may run together (no dst is a src)."""
        src, dst = self._index(pairs[:, 0]), self._index(pairs[:, 1])
        for t in (self.conv, self.ssm):
            t[:, dst] = t[:, src]

    def swap(self, kind: str, pairs: np.ndarray) -> None:
        """``"swap_out"`` ``(gpu, cpu)`` or ``"swap_in"`` ``(cpu, gpu)`` block copies."""
        for gpu, cpu in ((self.conv, self.cpu_conv), (self.ssm, self.cpu_ssm)):
            if kind == "swap_out":
                cpu[:, torch.from_numpy(pairs[:, 1])] = gpu[:, self._index(pairs[:, 0])].cpu()
            else:
                gpu[:, self._index(pairs[:, 1])] = cpu[:, torch.from_numpy(pairs[:, 0])].to(
                    gpu.device
                )

    @property
    def row_nbytes(self) -> int:
        """Bytes of one block's states as a host-tier row (every slot's conv, then scan)."""
        return 4 * (self.conv[:, 0].numel() + self.ssm[:, 0].numel())

    def gather_rows(self, block_ids: np.ndarray) -> Tensor:
        """The states of ``block_ids`` as uint8 ``[n, row_nbytes]`` rows on the CPU."""
        ids = self._index(block_ids)
        n = ids.numel()
        pieces = [
            t.index_select(1, ids).transpose(0, 1).reshape(n, -1).view(torch.uint8)
            for t in (self.conv, self.ssm)
        ]
        return torch.cat(pieces, dim=1).cpu()

    def scatter_rows(self, rows: Tensor, block_ids: np.ndarray) -> None:
        """Write uint8 ``[n, row_nbytes]`` rows (from :meth:`gather_rows`) into
        ``block_ids``' states."""
        ids = self._index(block_ids)
        n = ids.numel()
        if tuple(rows.shape) != (n, self.row_nbytes) or rows.dtype != torch.uint8:
            raise InvalidArgumentError(
                f"state rows must be uint8 [{n}, {self.row_nbytes}], got {rows.dtype} "
                f"{tuple(rows.shape)}"
            )
        source = rows.to(self.conv.device)
        column = 0
        for t in (self.conv, self.ssm):
            width = 4 * t[:, 0].numel()
            piece = source[:, column : column + width].contiguous().view(torch.float32)
            t.index_copy_(1, ids, piece.view(n, *t[:, 0].shape).transpose(0, 1))
            column += width

    def _index(self, ids: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.conv.device)

    def step(self, out: Any) -> PagedStates:
        """The step's backend, from its ``state_mappings`` (one per state group)."""
        mappings = list(getattr(out, "state_mappings", []))
        if len(mappings) != self.layout.num_state_groups:
            raise InvalidArgumentError(
                f"the step carries {len(mappings)} state mappings; the model has "
                f"{self.layout.num_state_groups} state groups (is the manager built with "
                "the model's groups?)"
            )
        return PagedStates(self, mappings, out)


class PagedStates:
    """One step's :class:`~kvblocks.engine.models.mamba2.StateBackend` over a
    :class:`StateCache`: every state group names the same positions (one checkpoint
    interval), each its own blocks."""

    def __init__(self, cache: StateCache, mappings: list[Any], out: Any) -> None:
        self._cache = cache
        self._mappings = mappings
        qsl = np.asarray(out.query_start_loc, dtype=np.int64)
        computed = np.asarray(out.seq_lens, dtype=np.int64) - np.diff(qsl)
        self._segments: list[SeqSegments] = []
        if not mappings:
            return
        first = mappings[0]
        for m in mappings[1:]:
            if not np.array_equal(m.write_positions, first.write_positions):
                raise InvalidArgumentError("state groups name different state positions")
        indptr = np.asarray(first.write_indptr)
        positions = np.asarray(first.write_positions)
        for i in range(len(qsl) - 1):
            cuts = positions[indptr[i] : indptr[i + 1]] - computed[i]
            self._segments.append(SeqSegments(int(qsl[i]), int(qsl[i + 1]), tuple(cuts.tolist())))
        self._reads = [cache._index(np.asarray(m.read_blocks)) for m in mappings]
        self._writes = [cache._index(np.asarray(m.write_blocks)) for m in mappings]

    def segments(self) -> list[SeqSegments]:
        """The step's sequences and where each saves its states."""
        return self._segments

    def load(self, layer: int) -> tuple[Tensor, Tensor]:
        """Mixer ``layer``'s states before the step (zeros where none is computed)."""
        g, slot = self._where(layer)
        reads = self._reads[g]
        fresh = reads < 0
        conv = self._cache.conv[slot, reads.clamp(min=0)]
        ssm = self._cache.ssm[slot, reads.clamp(min=0)]
        if bool(fresh.any()):
            conv[fresh] = 0.0
            ssm[fresh] = 0.0
        return conv, ssm

    def save(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        """Mixer ``layer``'s states at the named positions, into the named blocks."""
        g, slot = self._where(layer)
        self._cache.conv[slot, self._writes[g]] = conv
        self._cache.ssm[slot, self._writes[g]] = ssm

    def _where(self, layer: int) -> tuple[int, int]:
        layout = self._cache.layout
        return layout.state_group(layer) - 1, layout.state_slot(layer)
