"""Chunked local attention (Llama 4) as ordinary causal attention: "virtual batches".

A query at position ``p`` of a chunked layer sees only the keys of its own chunk,
``[p // C * C, p]``. No kernel needs to know that: split each sequence's query rows
where they cross a chunk boundary into *pieces*; a piece is causal attention over a
virtual sequence that starts at its chunk's first token, whose block table is the real
table from the chunk's first block on (``C`` must be a multiple of the block size, so a
chunk starts on a block boundary) and whose length is its last position + 1 minus the
chunk's start. The pieces keep the rows' order, so the output of the virtual batch is
the output of the real one, row for row. This is vLLM's ``make_local_attention_virtual_batches``
idea; the CPU reference, the native CPU decode and the CUDA kernels run it unchanged.

A piece's table holds exactly the blocks of its chunk up to its last position, all
computed or written this step; the blocks of past chunks, which the block manager's
``chunked_local_attention`` group has freed (their entries are the null block), are
never in it. Entries past a piece's length are the null block, never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvblocks.errors import InvalidArgumentError

__all__ = ["ChunkedBatch", "check_chunk_size", "chunked_batch", "gather_tables"]


def check_chunk_size(chunk: int, block_size: int) -> None:
    """Refuse a chunk that does not start on block boundaries.

    Raises:
        InvalidArgumentError: ``chunk % block_size != 0``, naming both.
    """
    if chunk % block_size:
        raise InvalidArgumentError(
            f"attention_chunk_size ({chunk}) must be a multiple of block_size ({block_size}): "
            "chunked attention reads each chunk from its first block"
        )


@dataclass(frozen=True)
class ChunkedBatch:
    """The pieces of one step's batch for a chunk size (host arrays, see the module doc).

    ``rows[i]`` is the real sequence of piece ``i`` and ``first_block[i]`` the column of
    its chunk's first block in that sequence's table; ``query_start_loc`` (``[P + 1]``)
    and ``seq_lens`` (``[P]``) describe the pieces as a varlen batch, ``num_blocks[i]``
    the blocks piece ``i`` reads.
    """

    rows: np.ndarray
    first_block: np.ndarray
    num_blocks: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray

    @property
    def max_seq_len(self) -> int:
        """The longest piece's length (0 for an empty batch)."""
        return int(self.seq_lens.max(initial=0))

    @property
    def max_query_len(self) -> int:
        """The most query rows of a piece."""
        return int(np.diff(self.query_start_loc).max(initial=0))

    def table_index(self, num_cols: int) -> np.ndarray:
        """Flat indices ``[P, width]`` into a ``[S, num_cols]`` block table: each piece's
        chunk blocks up to its length, ``-1`` after (see :func:`gather_tables`)."""
        width = max(1, int(self.num_blocks.max(initial=0)))
        span = np.arange(width, dtype=np.int64)
        valid = span[None, :] < self.num_blocks[:, None]
        flat = (self.rows * num_cols + self.first_block)[:, None] + span[None, :]
        return np.where(valid, flat, -1)

    def to_device(self, device: torch.device, num_cols: int) -> tuple[Tensor, Tensor, Tensor]:
        """``query_start_loc``, ``seq_lens`` and :meth:`table_index` on ``device``."""

        def upload(array: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return (
            upload(self.query_start_loc),
            upload(self.seq_lens),
            upload(self.table_index(num_cols)),
        )

    def block_tables(self, tables: Tensor) -> Tensor:
        """The pieces' ``[P, width]`` int32 tables from the real ``[S, B]`` ones (on their
        device): each piece's chunk blocks up to its length, the null block 0 after."""
        index = torch.from_numpy(self.table_index(tables.shape[1])).to(tables.device)
        return gather_tables(tables, index)


def gather_tables(tables: Tensor, index: Tensor) -> Tensor:
    """The int32 entries of ``tables`` ``[S, B]`` at the flat ``index`` (the null block 0
    where it is ``-1``): one gather on the tables' device."""
    gathered = tables.reshape(-1)[index.clamp(min=0)]
    return torch.where(index >= 0, gathered, torch.zeros_like(gathered)).to(torch.int32)


def chunked_batch(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    chunk: int,
    block_size: int,
    *,
    decode_only: bool,
) -> ChunkedBatch:
    """Split a step's batch at chunk boundaries (host arrays: ``query_start_loc``
    ``[S + 1]``, ``seq_lens`` ``[S]``, each length including the step's tokens).

    A decode batch keeps one piece per sequence (a padding sequence of length 0 keeps
    its empty piece, so the rows stay one per sequence); a varlen batch gets one piece
    per chunk each sequence's query rows touch (none for a sequence without rows).

    Raises:
        InvalidArgumentError: ``chunk`` is not a multiple of ``block_size``.
    """
    check_chunk_size(chunk, block_size)
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_seqs = lens.size
    if decode_only:
        # The query is the last position; its chunk starts at (len - 1) // C * C.
        starts = np.where(lens > 0, (lens - 1) // chunk * chunk, 0)
        piece_lens = lens - starts
        return ChunkedBatch(
            rows=np.arange(num_seqs, dtype=np.int64),
            first_block=starts // block_size,
            num_blocks=-(-piece_lens // block_size),
            query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
            seq_lens=piece_lens.astype(np.int32),
        )
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    first_pos = lens - q_lens
    first_chunk = first_pos // chunk
    counts = np.where(q_lens > 0, (lens - 1) // chunk - first_chunk + 1, 0)
    rows = np.repeat(np.arange(num_seqs, dtype=np.int64), counts)
    # The k-th piece of a sequence is its first chunk + k.
    before = np.repeat(np.cumsum(counts) - counts, counts)
    chunk_start = (first_chunk[rows] + np.arange(rows.size) - before) * chunk
    piece_start = np.maximum(first_pos[rows], chunk_start)
    piece_end = np.minimum(lens[rows], chunk_start + chunk)
    piece_lens = piece_end - chunk_start
    return ChunkedBatch(
        rows=rows,
        first_block=chunk_start // block_size,
        num_blocks=-(-piece_lens // block_size),
        query_start_loc=(qsl[0] + np.concatenate(([0], np.cumsum(piece_end - piece_start)))).astype(
            np.int32
        ),
        seq_lens=piece_lens.astype(np.int32),
    )
