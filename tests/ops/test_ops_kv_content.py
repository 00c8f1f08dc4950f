"""Level (c) of the KV-content oracle: the kernels driven the way an engine drives them.

An engine keeps a block pool (block 0 is the null block), a block table per sequence and
writes every token's K/V through a ``slot_mapping`` built from those tables; prefixes are
shared between sequences, forks share blocks until copy-on-write (``copy_blocks``), and
sliding-window sequences release old blocks (their table entries become the null block)
for others to reuse. Here every write, copy and attention is an emulated CUDA kernel.

The K/V of a token is a pure function of the token prefix it ends (``kv(tokens[:p+1])``),
so after every step the test checks, slot by slot, that each live sequence's position
``p`` holds exactly that (released window positions excepted), that the null block was
never written, and that attention over the paged cache equals dense attention over the
sequence's own K/V computed from the prefixes alone, never from the cache.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import pytest
import torch
from emu_runtime import emu_launch
from ops_cases import tolerance

import kvblocks.ops as ops
from kvblocks.ops import kernel_driver

NULL_FILL = 777.0  # block 0's content; any write or read of it shows


@dataclass
class Seq:
    """One sequence as the engine sees it."""

    tokens: list[int]
    table: list[int] = field(default_factory=list)
    window: int | None = None
    computed: int = 0  # positions whose K/V is in the cache


class Engine:
    """Block pool, block tables and KV writes through slot mappings; no kvblocks manager."""

    def __init__(self, *, num_blocks, block_size, num_kv_heads, group, head_size, dtype, seed):
        self.bs, self.kvh, self.group, self.head = block_size, num_kv_heads, group, head_size
        self.dtype = dtype
        ((self.kc, self.vc),) = ops.allocate_kv_cache(
            1, num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu"
        )
        self.kc[0] = NULL_FILL
        self.vc[0] = NULL_FILL
        self.free = list(range(num_blocks - 1, 0, -1))
        self.refs = [0] * num_blocks
        self.seqs: dict[int, Seq] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self._kv: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- the K/V a prefix must have: a pure function of the tokens ------------------
    def kv(self, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self._kv:
            seed = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=7).digest())
            g = torch.Generator().manual_seed(seed)
            rows = torch.randn((2, self.kvh, self.head), generator=g).to(self.dtype)
            self._kv[prefix] = (rows[0], rows[1])
        return self._kv[prefix]

    # ---- block bookkeeping -----------------------------------------------------------
    def alloc(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def add(self, sid: int, tokens: list[int], *, share_from: int | None = None,
            shared_blocks: int = 0, window: int | None = None) -> None:  # fmt: skip
        seq = Seq(list(tokens), window=window)
        if share_from is not None:  # prefix-cache hit: the first blocks are the other's
            donor = self.seqs[share_from]
            assert donor.tokens[: shared_blocks * self.bs] == tokens[: shared_blocks * self.bs]
            seq.table = donor.table[:shared_blocks]
            for block in seq.table:
                self.refs[block] += 1
            seq.computed = shared_blocks * self.bs
        self.seqs[sid] = seq

    def fork(self, parent: int, child: int) -> None:
        src = self.seqs[parent]
        self.seqs[child] = Seq(list(src.tokens), list(src.table), src.window, src.computed)
        for block in src.table:
            self.refs[block] += 1

    def free_seq(self, sid: int) -> None:
        for block in self.seqs.pop(sid).table:
            if block:
                self.release(block)

    def slots_for(self, sid: int, start: int, end: int, cow: list[list[int]]) -> list[int]:
        """Slots of positions [start, end), allocating blocks and un-sharing (copy-on-write)
        any shared block a write would land in; copies are queued in ``cow``."""
        seq = self.seqs[sid]
        slots = []
        for pos in range(start, end):
            idx = pos // self.bs
            while len(seq.table) <= idx:
                seq.table.append(self.alloc())
            block = seq.table[idx]
            assert block != 0, "a write into a released window block"
            if self.refs[block] > 1:
                new = self.alloc()
                cow.append([block, new])
                self.release(block)
                seq.table[idx] = new
                block = new
            slots.append(block * self.bs + pos % self.bs)
        return slots

    def release_window(self, sid: int) -> None:
        """Blocks wholly before the window of the next query go back to the pool."""
        seq = self.seqs[sid]
        if seq.window is None:
            return
        first_visible = max(0, len(seq.tokens) - seq.window)
        for idx in range(first_visible // self.bs):
            if seq.table[idx]:
                self.release(seq.table[idx])
                seq.table[idx] = 0  # the null block, as an engine pads released entries

    # ---- one engine step: write the new tokens' K/V, then attend ----------------------
    def step(self, chunks: dict[int, list[int]], *, decode: bool, split: bool = False):
        """Append ``chunks[sid]`` tokens to each listed sequence (or just compute its
        uncached positions when the list is empty) and run attention for them."""
        order = sorted(self.seqs)
        cow: list[list[int]] = []
        slot_mapping, keys, values, q_lens = [], [], [], []
        for sid in order:
            seq = self.seqs[sid]
            if sid not in chunks:
                q_lens.append(0)
                slot_mapping.append(-1)  # a padding row: the kernel must skip it
                keys.append(torch.zeros(self.kvh, self.head, dtype=self.dtype))
                values.append(torch.zeros(self.kvh, self.head, dtype=self.dtype))
                continue
            seq.tokens += chunks[sid]
            start, end = seq.computed, len(seq.tokens)
            slot_mapping += self.slots_for(sid, start, end, cow)
            for pos in range(start, end):
                k, v = self.kv(tuple(seq.tokens[: pos + 1]))
                keys.append(k)
                values.append(v)
            q_lens.append(end - start)
            seq.computed = end
        if cow:  # copy-on-write before the step's writes, as the scheduler orders them
            kernel_driver.run_copy_blocks(emu_launch, [(self.kc, self.vc)], torch.tensor(cow))
        kernel_driver.run_reshape_and_cache(
            emu_launch, torch.stack(keys), torch.stack(values), self.kc, self.vc,
            torch.tensor(slot_mapping, dtype=torch.int64),
        )  # fmt: skip
        self.check_contents()
        return self.attend(order, q_lens, decode=decode, split=split)

    def tables(self, order: list[int]) -> torch.Tensor:
        width = max(len(self.seqs[s].table) for s in order) + 1  # padded with null blocks
        tables = torch.zeros((len(order), width), dtype=torch.int32)
        for row, sid in enumerate(order):
            tables[row, : len(self.seqs[sid].table)] = torch.tensor(self.seqs[sid].table)
        return tables

    def attend(self, order: list[int], q_lens: list[int], *, decode: bool, split: bool):
        window = {self.seqs[s].window for s in order if q_lens[order.index(s)]}
        assert len(window) <= 1, "one sliding window per launch"
        window = window.pop() if window else None
        heads = self.kvh * self.group
        query = torch.randn((sum(q_lens), heads, self.head), generator=self.gen).to(self.dtype)
        seq_lens = torch.tensor([len(self.seqs[s].tokens) for s in order], dtype=torch.int32)
        if decode:
            assert all(n == 1 for n in q_lens if n), "decode is one token per sequence"
            padded = torch.zeros((len(order), heads, self.head), dtype=self.dtype)
            padded[[i for i, n in enumerate(q_lens) if n]] = query
            seq_lens = torch.where(torch.tensor(q_lens) > 0, seq_lens, 0).to(torch.int32)
            out = kernel_driver.run_split_k_attention(
                emu_launch, padded, self.kc, self.vc, self.tables(order), seq_lens, None,
                scale=None, sliding_window=window, soft_cap=None, max_query_len=1,
                max_seq_len=None, target_ctas=10_000 if split else 1, partition_tokens=32,
            )  # fmt: skip
            assert not out[[i for i, n in enumerate(q_lens) if not n]].any()
            out = out[[i for i, n in enumerate(q_lens) if n]]
            if self.dtype != torch.float32:
                # fp16/bf16: also the tensor-core kernel through the length-aware planner.
                planned = self.planned_decode(padded, seq_lens, order, window, split)
                assert not planned[[i for i, n in enumerate(q_lens) if not n]].any()
                planned_out = planned[[i for i, n in enumerate(q_lens) if n]]
        else:
            qsl = torch.zeros(len(order) + 1, dtype=torch.int32)
            qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
            out = kernel_driver.run_split_k_attention(
                emu_launch, query, self.kc, self.vc, self.tables(order), seq_lens, qsl,
                scale=None, sliding_window=window, soft_cap=None, max_query_len=max(q_lens),
                max_seq_len=None, target_ctas=1,
            )  # fmt: skip
        want, offset = [], 0
        for sid, n in zip(order, q_lens, strict=True):
            if n:
                want.append(self.dense(sid, query[offset : offset + n], window))
                offset += n
        got = out.float()
        torch.testing.assert_close(
            got, torch.cat(want).to(self.dtype).float(), **tolerance(self.dtype)
        )
        if decode and self.dtype != torch.float32:
            torch.testing.assert_close(
                planned_out.float(), torch.cat(want).to(self.dtype).float(),
                **tolerance(self.dtype),
            )  # fmt: skip
        return got

    def planned_decode(self, query, seq_lens, order, window, split) -> torch.Tensor:
        """Decode through ``DecodeAttention`` (plan from host lengths, run on the emulator);
        ``split`` plans 32-key chunks on a wide device so sequences are cut and merged."""
        dec = ops.DecodeAttention(
            num_heads=self.kvh * self.group, num_kv_heads=self.kvh, head_size=self.head,
            block_size=self.kc.shape[2], dtype=self.dtype, device="cpu", max_seqs=len(order),
            sliding_window=window, target_ctas=10_000 if split else 1, launcher=emu_launch,
            granularity=32, min_chunk_tokens=32,
        )  # fmt: skip
        plan = dec.plan(seq_lens.numpy(), self.tables(order))
        if split and int(seq_lens.max()) > 64:
            assert plan.num_slots > 0, "the split step really splits"
        return dec.run(query, self.kc, self.vc)

    def dense(self, sid: int, query: torch.Tensor, window: int | None) -> torch.Tensor:
        """Attention of the sequence's last ``len(query)`` positions over its own K/V, from
        the prefixes alone (the cache is not read)."""
        seq = self.seqs[sid]
        n, q_len = len(seq.tokens), query.shape[0]
        keys = torch.stack([self.kv(tuple(seq.tokens[: p + 1]))[0] for p in range(n)]).double()
        vals = torch.stack([self.kv(tuple(seq.tokens[: p + 1]))[1] for p in range(n)]).double()
        query = query.double()
        keys = keys.repeat_interleave(self.group, dim=1)  # [n, heads, d]
        vals = vals.repeat_interleave(self.group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) / math.sqrt(self.head)
        pos = torch.arange(n - q_len, n)[:, None]
        j = torch.arange(n)[None, :]
        visible = j <= pos
        if window is not None:
            visible &= j > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, vals).float()

    def check_contents(self) -> None:
        """Slot by slot: every live position holds the K/V of its own prefix."""
        assert (self.kc[0] == NULL_FILL).all() and (self.vc[0] == NULL_FILL).all()
        owners: dict[int, tuple[int, ...]] = {}
        for sid, seq in self.seqs.items():
            n = seq.computed
            first_kept = 0 if seq.window is None else max(0, len(seq.tokens) - seq.window)
            for p in range(n):
                block = seq.table[p // self.bs]
                if block == 0:
                    assert p < first_kept // self.bs * self.bs, (sid, p)
                    continue
                prefix = tuple(seq.tokens[: p + 1])
                slot = block * self.bs + p % self.bs
                # Two sequences may map one slot only when they share that prefix.
                assert owners.setdefault(slot, prefix) == prefix, (sid, p, slot)
                k, v = self.kv(prefix)
                off = p % self.bs
                assert torch.equal(self.kc[block, :, off], k), (sid, p, block)
                assert torch.equal(self.vc[block, :, off], v), (sid, p, block)


def run_scenario(dtype: torch.dtype, *, block_size: int, group: int, seed: int,
                 decode_steps: int, prompt: int) -> Engine:  # fmt: skip
    engine = Engine(num_blocks=64, block_size=block_size, num_kv_heads=2, group=group,
                    head_size=64, dtype=dtype, seed=seed)  # fmt: skip
    rng = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, 1000, (n,), generator=rng).tolist()

    a = tokens(prompt)
    engine.add(1, a)
    engine.step({1: []}, decode=False)  # prefill A
    # B hits A's first two full blocks in the prefix cache and prefills only its suffix.
    engine.add(2, a[: 2 * block_size] + tokens(block_size + 5), share_from=1, shared_blocks=2)
    engine.step({2: []}, decode=False)
    # C forks A with A's last block partly filled: the next writes must copy-on-write.
    engine.fork(1, 3)
    for step in range(decode_steps):
        chunk = {1: tokens(1), 2: tokens(1), 3: tokens(1)}
        if step == 1:
            chunk.pop(2)  # B idles one step: a padding row in slot_mapping and the batch
        engine.step(chunk, decode=True, split=step % 2 == 1)
    # A finishes; its blocks (some still shared with B/C) return only when unreferenced.
    engine.free_seq(1)
    engine.step({2: tokens(1), 3: tokens(1)}, decode=True)
    engine.step({2: tokens(3), 3: tokens(2)}, decode=False)  # extend chunks
    return engine


def run_window_scenario(dtype: torch.dtype, *, block_size: int, seed: int, steps: int) -> None:
    engine = Engine(num_blocks=24, block_size=block_size, num_kv_heads=1, group=4,
                    head_size=64, dtype=dtype, seed=seed)  # fmt: skip
    rng = torch.Generator().manual_seed(seed)
    window = block_size + 3
    engine.add(1, torch.randint(0, 1000, (2 * block_size + 1,), generator=rng).tolist(),
               window=window)  # fmt: skip
    engine.step({1: []}, decode=False)
    for step in range(steps):
        engine.release_window(1)
        # A newcomer takes whatever the pool hands out, released window blocks included,
        # and overwrites them: the windowed sequence must never read them again.
        engine.add(100 + step, torch.randint(0, 1000, (block_size,), generator=rng).tolist(),
                   window=window)  # fmt: skip
        engine.step({100 + step: []}, decode=False)
        if step % 2:
            engine.free_seq(100 + step)
        engine.step({1: torch.randint(0, 1000, (block_size // 2,), generator=rng).tolist()},
                    decode=False)  # fmt: skip
        engine.step({1: [int(torch.randint(0, 1000, (1,), generator=rng))]}, decode=True,
                    split=step % 2 == 0)  # fmt: skip
    assert 0 in engine.seqs[1].table  # the window really released blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_scenario_cache_holds_each_prefix_and_attention_is_dense(dtype):
    run_scenario(dtype, block_size=16, group=2, seed=1, decode_steps=4, prompt=45)


def test_window_released_blocks_are_null_and_never_read():
    run_window_scenario(torch.float16, block_size=8, seed=2, steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("block_size", "group"), [(8, 8), (32, 1)])
def test_engine_scenario_longer_runs(dtype, block_size, group):
    run_scenario(dtype, block_size=block_size, group=group, seed=block_size + group,
                 decode_steps=12, prompt=3 * block_size + 7)  # fmt: skip
    run_window_scenario(dtype, block_size=block_size, seed=group, steps=8)
