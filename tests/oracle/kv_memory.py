"""An emulated KV memory: what an engine's GPU and CPU caches hold, slot by slot.

The content oracle of the test suite. A block manager is correct when every sequence's
attention reads exactly the KV of its own tokens; a model of the manager's rules cannot
show that (it repeats the rules' mistakes), so this module keeps what the memory *holds*
and the tests drive it exactly as an engine does:

- a token's KV is written through the slot mapping the manager returns;
- copy-on-write pairs, swap rows and ``SchedulerOutput.memory_ops`` are applied in the
  order the API documents, as the block copies they are;
- lookahead (draft) slots are written with :data:`GARBAGE`, as a rejected draft would;
- host-tier ``offload``/``load`` ops are asynchronous on the tier side: an offload's
  slot holds its KV only once the engine confirms the op (:meth:`KVMemory.confirm`), and
  a load's source slot must not be overwritten before then.

What a slot holds is an integer naming a token prefix: the KV of position ``p`` of a
sequence depends exactly on ``tokens[:p + 1]`` (and on the extra keys — cache salt, LoRA
id — which change the model's K/V), so :class:`PrefixIds` interns ``(namespace,
tokens[:p + 1])`` to one id. Two positions hold equal KV iff their ids are equal.

A manager with several KV cache groups (layers of different attention kinds: full,
sliding window, chunked local) keeps one block table per group over one pool, and a
block id names the same bytes in every group (see ``docs/hybrid-groups.md``): a block
belongs to one group at a time, and its slots hold that group's layers' KV. The tests
intern ``(namespace, group)`` as the namespace, so a group reading another group's KV
reads a wrong id. Which positions a group's query may attend to is :class:`Attention`'s
rule, the oracle's own.

A recurrent-state group's block holds one state: "the state after tokens ``[0, p)``",
which depends exactly on ``tokens[:p]``, so it is the prefix id of position ``p - 1`` (in
the group's namespace), written into every slot of the block (:meth:`KVMemory.write_state`
and :meth:`KVMemory.check_state`; the oracle's rule: table entry ``ceil(p / block_size) -
1`` holds the state after ``p`` computed tokens, see :func:`state_writes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

#: A slot that was never written.
UNWRITTEN = -2
#: A slot written with the KV of a lookahead/draft token (never valid context).
GARBAGE = -1

NULL_BLOCK = 0


@dataclass(frozen=True)
class Attention:
    """Which past positions a query of a layer group attends to: the oracle's own rule.

    Full attention (neither field): every position up to the query's. ``window=W``: the
    last ``W`` positions, ``[p - W + 1, p]``. ``chunk=C``: the query's own chunk of ``C``
    positions, ``[p // C * C, p]``.
    """

    window: int | None = None
    chunk: int | None = None

    def first_visible(self, position: int) -> int:
        """The first position a query at ``position`` (or later: it never decreases)
        attends to."""
        if self.window is not None:
            return max(0, position - self.window + 1)
        if self.chunk is not None:
            return position // self.chunk * self.chunk
        return 0


#: Full attention: every earlier position is visible.
FULL = Attention()


@dataclass
class PrefixIds:
    """Interns ``(namespace, token prefix)`` to small integers (``>= 0``)."""

    _ids: dict[tuple[object, int, int], int] = field(default_factory=dict)
    # The answers so far, by (namespace, tokens): the oracles ask for every live
    # sequence's ids after every operation, and most sequences have not changed since.
    _memo: dict[tuple[object, tuple[int, ...]], list[int]] = field(default_factory=dict)

    def ids(self, tokens: Sequence[int], namespace: object = None) -> list[int]:
        """The id of every prefix ``tokens[:p + 1]``, for ``p`` in ``range(len(tokens))``
        (a new list: the caller may change it)."""
        key = (namespace, tuple(tokens))
        known = self._memo.get(key)
        if known is None:
            # A decode step asks for the ids of a sequence one token longer than last time.
            shorter = self._memo.get((namespace, key[1][:-1])) if key[1] else None
            if shorter is None:
                known = self._intern(key[1], namespace, [])
            else:
                known = self._intern(key[1][len(shorter) :], namespace, list(shorter))
            self._memo[key] = known
        return list(known)

    def _intern(self, tokens: tuple[int, ...], namespace: object, out: list[int]) -> list[int]:
        """``out`` (the ids of a prefix) extended by the ids of ``tokens`` after it."""
        parent = out[-1] if out else -1
        for t in tokens:
            key = (namespace, parent, int(t))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


class ContentError(AssertionError):
    """What the memory holds is not what a sequence must read."""


def _listed_twice(values: np.ndarray) -> np.ndarray:
    """The values listed more than once, ascending (what ``np.unique`` with counts finds,
    at a fraction of its cost on the few slots of one step)."""
    ordered = np.sort(values)
    same = ordered[1:] == ordered[:-1]
    return np.unique(ordered[1:][same]) if same.any() else ordered[:0]


def assert_array_equal(actual: npt.ArrayLike, desired: npt.ArrayLike) -> None:
    """``np.testing.assert_array_equal``, its report included, with the common case (equal)
    decided by ``np.array_equal``: the oracles compare whole tables after every step."""
    if not np.array_equal(actual, desired):
        np.testing.assert_array_equal(actual, desired)


def state_entry(position: int, block_size: int) -> int | None:
    """The table entry holding a recurrent group's state after ``position`` tokens: the
    block whose tokens end there (``None`` for the initial state)."""
    return None if position == 0 else -(-position // block_size) - 1


def state_writes(computed: int, end: int, block_size: int, every: int) -> list[int]:
    """The states (as tokens covered) a step computing ``[computed, end)`` must save: each
    boundary of ``every`` blocks it crosses, and ``end``."""
    if end <= computed:
        return []
    stride = every * block_size
    out = list(range((computed // stride + 1) * stride, end + 1, stride))
    if not out or out[-1] != end:
        out.append(end)
    return out


class KVMemory:
    """GPU and CPU KV memory of ``block_size`` slots per block, holding prefix ids."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        num_tier_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.gpu = np.full((num_gpu_blocks, block_size), UNWRITTEN, dtype=np.int64)
        self.cpu = np.full((max(num_cpu_blocks, 0), block_size), UNWRITTEN, dtype=np.int64)
        #: The host tier's slots (written only when an offload is confirmed).
        self.tier = np.full((max(num_tier_blocks, 0), block_size), UNWRITTEN, dtype=np.int64)
        # Offloads in flight: slot -> the KV it will hold once confirmed.
        self._tier_writes: dict[int, np.ndarray] = {}
        # Tier slots some unconfirmed load may still be reading.
        self._tier_reads: set[int] = set()

    # -- writes --------------------------------------------------------------------------

    def write(self, slots: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Write ``values`` at GPU ``slots`` (``block * block_size + offset``), as the
        model step's ``reshape_and_cache`` does.

        Raises ContentError if a slot is out of range, in the null block, or listed twice
        (two tokens of one step writing one slot is a race on a GPU).
        """
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        values = np.asarray(values, dtype=np.int64).reshape(-1)
        if slots.shape != values.shape:
            raise ValueError(f"{slots.shape[0]} slots for {values.shape[0]} values")
        if slots.size == 0:
            return
        flat = self.gpu.reshape(-1)
        if slots.min() < 0 or slots.max() >= flat.size:
            raise ContentError(f"slot out of range: {slots.min()}..{slots.max()}")
        if (slots < self.block_size).any():
            raise ContentError(
                f"a write lands in the null block: slots {slots[slots < self.block_size].tolist()}"
            )
        twice = _listed_twice(slots)
        if twice.size:
            raise ContentError(f"slots written twice in one step: {twice.tolist()}")
        flat[slots] = values

    def write_step(self, writes: Iterable[tuple[object, npt.ArrayLike, npt.ArrayLike]]) -> None:
        """One model step's writes ``(owner, slots, values)`` for several sequences.

        Raises ContentError naming both owners when two sequences write the same slot
        (one sequence writing a slot twice is named too): in one step that is a race;
        across live sequences it is the corruption a block manager must never allow.
        """
        writes = list(writes)
        if not writes:
            return
        slots = [np.asarray(w[1], dtype=np.int64).reshape(-1) for w in writes]
        values = [np.asarray(w[2], dtype=np.int64).reshape(-1) for w in writes]
        flat = np.concatenate(slots)
        twice = _listed_twice(flat)
        if twice.size:
            slot = int(twice[0])
            owners = [w[0] for w, s in zip(writes, slots, strict=True) if slot in s]
            what = f"sequences {owners[0]} and {owners[1]}" if len(owners) > 1 else owners[0]
            raise ContentError(
                f"{what} write slot {slot} (block {slot // self.block_size}) twice in one step"
            )
        self.write(flat, np.concatenate(values))

    def state_slots(self, block: int) -> np.ndarray:
        """Every slot of ``block``: where a recurrent state is written (one per block)."""
        return np.arange(block * self.block_size, (block + 1) * self.block_size)

    # -- block moves ---------------------------------------------------------------------

    @staticmethod
    def _pairs(pairs: npt.ArrayLike) -> np.ndarray:
        return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)

    def copy(self, pairs: npt.ArrayLike) -> None:
        """Copy-on-write ``(src, dst)`` GPU block copies, as one ``copy_blocks`` launch.

        The pairs of one launch run in parallel, so every source is read before any
        destination is written; a destination that is also a source (or listed twice), or
        the null block as a destination, is a ContentError.
        """
        p = self._pairs(pairs)
        if p.size == 0:
            return
        src, dst = p[:, 0], p[:, 1]
        if (dst == NULL_BLOCK).any():
            raise ContentError(f"copy into the null block: {p.tolist()}")
        if len(np.unique(dst)) != len(dst) or np.intersect1d(src, dst).size:
            raise ContentError(f"copy pairs overlap within one launch: {p.tolist()}")
        self.gpu[dst] = self.gpu[src]

    def swap_out(self, rows: npt.ArrayLike) -> None:
        """``(gpu, cpu)`` block copies."""
        p = self._pairs(rows)
        if p.size:
            self.cpu[p[:, 1]] = self.gpu[p[:, 0]]

    def swap_in(self, rows: npt.ArrayLike) -> None:
        """``(cpu, gpu)`` block copies."""
        p = self._pairs(rows)
        if p.size == 0:
            return
        if (p[:, 1] == NULL_BLOCK).any():
            raise ContentError(f"swap-in into the null block: {p.tolist()}")
        self.gpu[p[:, 1]] = self.cpu[p[:, 0]]

    def offload(self, pairs: npt.ArrayLike) -> None:
        """``(gpu block, tier slot)`` copies, asynchronous: the GPU block is read now (the
        ops precede the step), the slot holds it only after :meth:`confirm`.

        Raises ContentError when the slot is the source of an unconfirmed load or the
        destination of an unconfirmed offload (overwritten while a copy is in flight).
        """
        for g, t in self._pairs(pairs).tolist():
            if t in self._tier_reads or t in self._tier_writes:
                raise ContentError(f"tier slot {t} overwritten while a copy of it is in flight")
            if g == NULL_BLOCK:
                raise ContentError("offload of the null block")
            self._tier_writes[t] = self.gpu[g].copy()
            # The slot's old block is gone (evicted); the new one is not there yet.
            self.tier[t] = UNWRITTEN

    def load(self, pairs: npt.ArrayLike) -> None:
        """``(tier slot, gpu block)`` copies; the slot stays a source in flight until
        :meth:`confirm`. Loading a slot whose offload is unconfirmed is a ContentError
        (read before written)."""
        for t, g in self._pairs(pairs).tolist():
            if t in self._tier_writes:
                raise ContentError(f"tier slot {t} loaded before its offload was confirmed")
            if g == NULL_BLOCK:
                raise ContentError("load into the null block")
            self.gpu[g] = self.tier[t]
            self._tier_reads.add(t)

    def import_blocks(self, slots: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """The engine writes fetched blocks (``values [n, block_size]`` prefix ids) into
        reserved tier slots (``KVCacheManager.import_tier_blocks``): like an offload's
        destination, a slot holds its block only after :meth:`confirm`, and overwriting a
        slot with a copy in flight is a ContentError."""
        rows = np.asarray(values, dtype=np.int64).reshape(-1, self.block_size)
        for t, row in zip(
            np.asarray(slots, dtype=np.int64).reshape(-1).tolist(), rows, strict=True
        ):
            if t in self._tier_reads or t in self._tier_writes:
                raise ContentError(f"tier slot {t} imported while a copy of it is in flight")
            self._tier_writes[t] = row.copy()
            self.tier[t] = UNWRITTEN

    def confirm(self) -> None:
        """The engine finished every tier copy applied so far."""
        for t, values in self._tier_writes.items():
            self.tier[t] = values
        self._tier_writes.clear()
        self._tier_reads.clear()

    def apply_memory_ops(self, ops: Iterable[tuple[str, npt.ArrayLike]]) -> None:
        """Every group of ``SchedulerOutput.memory_ops``, in order.

        As the interface document specifies, the pairs of a ``"copy"`` group also mean
        "in this order" (an engine splits conflicting pairs into consecutive launches),
        unlike the pairs of one :meth:`copy` launch, which run in parallel.
        """
        for kind, pairs in ops:
            p = self._pairs(pairs)
            if kind == "copy":
                for pair in p:
                    self.copy(pair[None, :])
            elif kind == "swap_out":
                self.swap_out(p)
            elif kind == "swap_in":
                self.swap_in(p)
            elif kind == "offload":
                self.offload(p)
            elif kind == "load":
                self.load(p)
            else:
                raise ValueError(f"unknown memory op {kind!r}")

    # -- reads ---------------------------------------------------------------------------

    def read(self, block_table: npt.ArrayLike, num_tokens: int) -> np.ndarray:
        """What attention reads for positions ``0 .. num_tokens - 1`` through a table."""
        table = np.asarray(block_table, dtype=np.int64).reshape(-1)
        pos = np.arange(num_tokens)
        if num_tokens and pos[-1] // self.block_size >= table.size:
            raise ContentError(
                f"{num_tokens} tokens need {pos[-1] // self.block_size + 1} blocks, "
                f"the table has {table.size}"
            )
        return self.gpu[table[pos // self.block_size], pos % self.block_size]

    def read_state(self, block: int) -> int:
        """The state a block holds (:data:`UNWRITTEN` or :data:`GARBAGE` if its slots do
        not all hold one value)."""
        values = self.gpu[block]
        return int(values[0]) if (values == values[0]).all() else GARBAGE

    def check_state(
        self,
        name: object,
        block_table: npt.ArrayLike,
        expected: Sequence[int],
        num_computed: int,
        *,
        held_exactly: bool,
    ) -> None:
        """A recurrent group's table: entry ``ceil(num_computed / block_size) - 1`` holds
        the state after ``num_computed`` tokens (``expected[num_computed - 1]``). With
        ``held_exactly`` (no step pending) no other entry holds a block: the group keeps
        one state."""
        table = np.asarray(block_table, dtype=np.int64).reshape(-1)
        entry = state_entry(num_computed, self.block_size)
        held = np.flatnonzero(table != NULL_BLOCK).tolist()
        if entry is not None:
            if entry >= table.size or table[entry] == NULL_BLOCK:
                raise ContentError(
                    f"sequence {name}: no block holds its state after {num_computed} tokens "
                    f"(entry {entry})"
                )
            got = self.read_state(int(table[entry]))
            if got != expected[num_computed - 1]:
                raise ContentError(
                    f"sequence {name}: block {table[entry]} (entry {entry}) holds state {got}, "
                    f"expected the state after {num_computed} tokens, "
                    f"{expected[num_computed - 1]}"
                )
        if held_exactly and held != ([] if entry is None else [entry]):
            raise ContentError(
                f"sequence {name}: entries {held} hold blocks, but at {num_computed} tokens "
                f"only entry {entry} holds a state"
            )

    def check(
        self,
        name: object,
        block_table: npt.ArrayLike,
        expected: Sequence[int],
        num_computed: int,
        window: int | None = None,
        *,
        attention: Attention | None = None,
        released_exactly: bool = False,
    ) -> None:
        """Positions ``p < num_computed`` must hold ``expected[p]``.

        Positions no future query can see (before ``attention.first_visible(
        num_computed)``; ``window`` is short for ``Attention(window=window)``) may have
        been released: their table entry must be the null block, and they are not read.
        With ``released_exactly``, every block wholly before that position must be
        released (the group holds nothing a query cannot see), and no other block may be
        the null block.
        """
        if attention is None:
            attention = FULL if window is None else Attention(window=window)
        table = np.asarray(block_table, dtype=np.int64).reshape(-1)
        got = self.read(table, num_computed)
        want = np.asarray(expected[:num_computed], dtype=np.int64)
        ok = got == want
        visible = attention.first_visible(num_computed)
        if released_exactly:
            gone = visible // self.block_size
            held = table[gone : -(-num_computed // self.block_size)]
            if (table[:gone] != NULL_BLOCK).any():
                b = int(np.flatnonzero(table[:gone] != NULL_BLOCK)[0])
                raise ContentError(
                    f"sequence {name}: block {b} (entry {b}) is held, but no query at "
                    f"{num_computed} or later sees its positions (first visible: {visible})"
                )
            if (held == NULL_BLOCK).any():
                b = gone + int(np.flatnonzero(held == NULL_BLOCK)[0])
                raise ContentError(
                    f"sequence {name}: entry {b} is the null block, but a future query "
                    f"sees its positions (first visible: {visible} at {num_computed})"
                )
        released = table[np.arange(num_computed) // self.block_size] == NULL_BLOCK
        if released.any():
            last = int(np.flatnonzero(released).max())
            # Released blocks are a leading run no future query (at num_computed or
            # later) can attend to.
            if last >= visible:
                raise ContentError(
                    f"sequence {name}: position {last} released but still visible "
                    f"(first visible: {visible}) at {num_computed} computed tokens"
                )
            ok |= released
        if not ok.all():
            p = int(np.flatnonzero(~ok)[0])
            raise ContentError(
                f"sequence {name}: position {p} (block {table[p // self.block_size]}, "
                f"offset {p % self.block_size}) holds {got[p]}, expected {want[p]} "
                f"({int((~ok).sum())} of {num_computed} positions wrong)"
            )
