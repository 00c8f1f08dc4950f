"""Block moves in the reference block manager (:mod:`oracle.reference_manager`): the
journal of copies and swaps drained in issue order, and swapping sequences out to the CPU
pool and back (shared blocks moved once, sharing kept)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvblocks.errors import OutOfBlocksError, SequenceStateError
from oracle.reference_args import _MAX_SEQ_ID, _int_list
from oracle.reference_pool import ReferencePool
from oracle.reference_records import _Sequence


class ReferenceSwap(ReferencePool):
    """The journal drains and ``[can_]swap_out``/``[can_]swap_in`` of
    :class:`oracle.reference_manager.ReferenceKVCacheManager`."""

    def take_copy_on_writes(self) -> npt.NDArray[np.int64]:
        """Drain the journal as copy-on-write ``(src, dst)`` pairs, shape ``[n, 2]`` (swap
        rows dropped: ``swap_out``/``swap_in`` returned them)."""
        out = np.array([(s, d) for k, s, d in self._ops if k == "copy"], dtype=np.int64)
        self._ops.clear()
        return out.reshape(-1, 2)

    def take_memory_ops(self) -> list[tuple[str, npt.NDArray[np.int64]]]:
        """Drain every queued block move in issue order, as runs of one kind."""
        runs: list[tuple[str, list[tuple[int, int]]]] = []
        for kind, src, dst in self._ops:
            if not runs or runs[-1][0] != kind:
                runs.append((kind, []))
            runs[-1][1].append((src, dst))
        self._ops.clear()
        return [(kind, np.array(pairs, dtype=np.int64).reshape(-1, 2)) for kind, pairs in runs]

    def confirm_memory_ops(self) -> None:
        """No host tier: nothing to confirm."""

    def discard_memory_ops(self) -> None:
        """No host tier: nothing to discard."""

    # -- swap ------------------------------------------------------------------------
    def _swap_group(self, seq_ids: object, want_swapped: bool) -> list[_Sequence]:
        group = self._batch_seqs(_int_list(seq_ids, "seq_ids", 0, _MAX_SEQ_ID))
        for seq in group:
            if want_swapped and not seq.swapped:
                raise SequenceStateError(f"swap_in: sequence {seq.seq_id} is not swapped out")
            if not want_swapped:
                if seq.swapped:
                    raise SequenceStateError(
                        f"swap_out: sequence {seq.seq_id} is already swapped out"
                    )
                if seq.reserved is not None:
                    raise SequenceStateError(
                        f"swap_out: sequence {seq.seq_id} has allocated but uncommitted slots"
                    )
        return group

    @staticmethod
    def _distinct_blocks(group: list[_Sequence]) -> list[int]:
        """Live blocks of the group in order of first appearance (released entries skipped)."""
        seen: dict[int, None] = {}
        for seq in group:
            for block in seq.block_table[seq.num_released :]:
                seen.setdefault(block)
        return list(seen)

    def can_swap_out(self, seq_ids: object) -> bool:
        """Enough free CPU blocks for the sequences' distinct blocks."""
        group = self._swap_group(seq_ids, want_swapped=False)
        return len(self._distinct_blocks(group)) <= len(self._cpu_free)

    def can_swap_in(self, seq_ids: object) -> bool:
        """Enough free GPU blocks for the sequences' distinct blocks, keeping the watermark."""
        group = self._swap_group(seq_ids, want_swapped=True)
        needed = len(self._distinct_blocks(group))
        return len(self._free) - needed >= self._watermark_blocks

    def swap_out(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """Move the sequences' blocks to the CPU pool; return ``(gpu, cpu)`` rows."""
        group = self._swap_group(seq_ids, want_swapped=False)
        blocks = self._distinct_blocks(group)
        if len(blocks) > len(self._cpu_free):
            raise OutOfBlocksError(
                f"swap_out needs {len(blocks)} CPU blocks, only {len(self._cpu_free)} are free"
            )
        mapping = {gpu: self._cpu_free.pop_front() for gpu in blocks}
        for seq in group:
            live = seq.block_table[seq.num_released :]
            for gpu in live:
                self._cpu_refcount[mapping[gpu]] += 1
            self._release_table(live)
            seq.block_table[seq.num_released :] = [mapping[gpu] for gpu in live]
            seq.swapped = True
        self._swapped_out += len(blocks)
        self._ops.extend(("swap_out", gpu, cpu) for gpu, cpu in mapping.items())
        return np.array(list(mapping.items()), dtype=np.int64).reshape(-1, 2)

    def swap_in(self, seq_ids: object) -> npt.NDArray[np.int64]:
        """Move swapped sequences back; return ``(cpu, gpu)`` rows, sharing kept."""
        group = self._swap_group(seq_ids, want_swapped=True)
        blocks = self._distinct_blocks(group)
        if len(blocks) > len(self._free):
            raise OutOfBlocksError(
                f"swap_in needs {len(blocks)} GPU blocks, only {len(self._free)} are free"
            )
        mapping = {cpu: self._pop_free() for cpu in blocks}
        for seq in group:
            live = seq.block_table[seq.num_released :]
            for cpu in live:
                self._refcount[mapping[cpu]] += 1
            for cpu in reversed(live):
                self._release_cpu(cpu)
            seq.block_table[seq.num_released :] = [mapping[cpu] for cpu in live]
            seq.swapped = False
        self._swapped_in += len(blocks)
        self._ops.extend(("swap_in", cpu, gpu) for cpu, gpu in mapping.items())
        return np.array(list(mapping.items()), dtype=np.int64).reshape(-1, 2)
