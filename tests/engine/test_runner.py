"""The model runner on hand-built steps: paged forward == dense forward, swap and CoW copies.

These steps are built here without the scheduler or the block manager, so a failure
points at the runner, the model or the ops, not at scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvblocks.engine.dense import dense_logits
from kvblocks.engine.model import LlamaForCausalLM
from kvblocks.engine.runner import ModelRunner
from kvblocks.scheduler.output import SchedulerOutput

BS = 8


@dataclass
class Seq:
    """A sequence as a test-side block manager sees it."""

    tokens: list[int]
    blocks: list[int]
    computed: int = 0
    history: list[int] = field(default_factory=list)


def step(seqs: list[tuple[Seq, int]], *, num_blocks_cols: int = 16) -> SchedulerOutput:
    """A SchedulerOutput computing ``n`` more tokens of each ``(seq, n)``; every seq samples."""
    ids, pos, slots, qsl, lens, tables, counts = [], [], [], [0], [], [], []
    for seq, n in seqs:
        for p in range(seq.computed, seq.computed + n):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + n)
        lens.append(seq.computed + n)
        tables.append(seq.blocks + [0] * (num_blocks_cols - len(seq.blocks)))
        counts.append(n)
        seq.computed += n
    r = len(seqs)
    decodes = 0
    while decodes < r and counts[decodes] == 1 and seqs[decodes][0].computed > 1:
        decodes += 1
    out = SchedulerOutput.empty()
    out.seq_ids = np.arange(r, dtype=np.int64)
    out.num_scheduled_tokens = np.asarray(counts, dtype=np.int32)
    out.input_token_ids = np.asarray(ids, dtype=np.int64)
    out.positions = np.asarray(pos, dtype=np.int64)
    out.slot_mapping = np.asarray(slots, dtype=np.int64)
    out.query_start_loc = np.asarray(qsl, dtype=np.int32)
    out.seq_lens = np.asarray(lens, dtype=np.int32)
    out.block_tables = np.asarray(tables, dtype=np.int32)
    out.logits_indices = np.asarray(qsl[1:], dtype=np.int64) - 1
    out.sample_seq_ids = out.seq_ids.copy()
    out.sample_request_ids = [str(i) for i in range(r)]
    out.sample_counts = np.ones(r, dtype=np.int32)
    out.temperature = np.zeros(r, dtype=np.float32)
    out.top_p = np.ones(r, dtype=np.float32)
    out.top_k = np.zeros(r, dtype=np.int32)
    out.seeds = np.full(r, -1, dtype=np.int64)
    out.num_decode_seqs = decodes
    return out


def check_against_dense(model: LlamaForCausalLM, logits: torch.Tensor, seqs: list[Seq]) -> None:
    for row, seq in enumerate(seqs):
        ids = torch.tensor([seq.tokens[: seq.computed]])
        expected = dense_logits(model, ids)[0, -1]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def decode(runner: ModelRunner, model: LlamaForCausalLM, seqs: list[Seq], steps: int) -> None:
    """Greedy decode steps; every step's logits are checked against the dense forward."""
    for _ in range(steps):
        out = step([(s, 1) for s in seqs])
        assert out.num_decode_seqs == len(seqs)
        logits = runner.forward_logits(out)
        assert logits is not None
        check_against_dense(model, logits, seqs)
        for row, s in enumerate(seqs):
            s.tokens.append(int(logits[row].argmax()))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def test_chunked_prefill_then_decode_matches_dense(family: str, request) -> None:
    model: LlamaForCausalLM = request.getfixturevalue(family)
    runner = ModelRunner(model, num_blocks=32, block_size=BS)
    a = Seq(_prompt(37, 1), blocks=[7, 3, 12, 5, 9, 20, 21])
    b = Seq(_prompt(20, 2), blocks=[1, 30, 14, 2, 16])
    # Step 1: a's first chunk (no useful sample) next to b's whole prompt.
    logits = runner.forward_logits(step([(a, 16), (b, 20)]))
    assert logits is not None
    check_against_dense(model, logits[1:], [b])
    b.tokens.append(int(logits[1].argmax()))
    # Step 2: b decodes first, then a's last chunk.
    logits = runner.forward_logits(step([(b, 1), (a, 21)]))
    assert logits is not None
    check_against_dense(model, logits, [b, a])
    b.tokens.append(int(logits[0].argmax()))
    a.tokens.append(int(logits[1].argmax()))
    decode(runner, model, [a, b], 12)


def test_swap_out_and_in_to_other_blocks(tiny_llama: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, num_blocks=16, block_size=BS, num_cpu_blocks=8)
    a = Seq(_prompt(21, 3), blocks=[4, 5, 6, 1])
    logits = runner.forward_logits(step([(a, 21)]))
    assert logits is not None
    a.tokens.append(int(logits[0].argmax()))
    out = SchedulerOutput.empty()
    out.memory_ops = [("swap_out", np.array([[4, 2], [5, 0], [6, 7]], dtype=np.int64))]
    runner.apply_memory_ops(out)
    # Another sequence reuses the freed device blocks, overwriting a's K/V there.
    other = Seq(_prompt(24, 4), blocks=[6, 4, 5])
    assert runner.forward_logits(step([(other, 24)])) is not None
    out = SchedulerOutput.empty()
    out.memory_ops = [("swap_in", np.array([[2, 10], [0, 11], [7, 12]], dtype=np.int64))]
    runner.apply_memory_ops(out)
    a.blocks = [10, 11, 12, 13]
    decode(runner, tiny_llama, [a], 6)


def test_copy_on_write_fork_diverges_correctly(tiny_llama: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, num_blocks=16, block_size=BS)
    parent = Seq(_prompt(13, 5), blocks=[3, 8, 10])
    logits = runner.forward_logits(step([(parent, 13)]))
    assert logits is not None
    # Fork: the child shares the full block 3 and gets a copy of the partial block 8.
    child = Seq(list(parent.tokens), blocks=[3, 9, 11], computed=parent.computed)
    out = SchedulerOutput.empty()
    out.memory_ops = [("copy", np.array([[8, 9]], dtype=np.int64))]
    runner.apply_memory_ops(out)
    top2 = logits[0].topk(2).indices.tolist()
    parent.tokens.append(top2[0])
    child.tokens.append(top2[1])  # the two sequences diverge from here
    decode(runner, tiny_llama, [parent, child], 8)


def test_sliding_window_tolerates_released_blocks(tiny_mistral: LlamaForCausalLM) -> None:
    """Blocks wholly outside the window may be swapped for the null block (the manager does)."""
    window = tiny_mistral.config.sliding_window
    assert window is not None
    runner = ModelRunner(tiny_mistral, num_blocks=32, block_size=BS)
    a = Seq(_prompt(40, 6), blocks=[1, 2, 3, 4, 5, 6, 7, 8])
    logits = runner.forward_logits(step([(a, 40)]))
    assert logits is not None
    a.tokens.append(int(logits[0].argmax()))
    # The next query sits at position 40 and sees keys > 40 - window = 16: blocks 0, 1 are out.
    runner.kv_caches[0][0][1:3].fill_(1e4)  # poison them, then release them
    a.blocks[0] = a.blocks[1] = 0
    decode(runner, tiny_mistral, [a], 4)


def test_memory_ops_run_in_issue_order(tiny_llama: LlamaForCausalLM) -> None:
    """Swap out a, reuse its block as a copy destination, swap that out too: order matters."""
    runner = ModelRunner(tiny_llama, num_blocks=16, block_size=BS, num_cpu_blocks=8)
    a = Seq(_prompt(12, 7), blocks=[2, 3])
    b = Seq(_prompt(12, 8), blocks=[4, 5])
    logits = runner.forward_logits(step([(a, 12), (b, 12)]))
    assert logits is not None
    a.tokens.append(int(logits[0].argmax()))
    b.tokens.append(int(logits[1].argmax()))
    # a is swapped out (block 3 freed), b's partial block 5 is copied into block 3
    # (copy-on-write), then b is swapped out with its new block 3.
    out = SchedulerOutput.empty()
    out.memory_ops = [
        ("swap_out", np.array([[2, 0], [3, 1]], dtype=np.int64)),
        ("copy", np.array([[5, 3]], dtype=np.int64)),
        ("swap_out", np.array([[4, 2], [3, 3]], dtype=np.int64)),
    ]
    runner.apply_memory_ops(out)
    out = SchedulerOutput.empty()
    out.memory_ops = [("swap_in", np.array([[0, 6], [1, 7], [2, 8], [3, 9]], dtype=np.int64))]
    runner.apply_memory_ops(out)
    a.blocks = [6, 7, 10]
    b.blocks = [8, 9, 11]
    decode(runner, tiny_llama, [a, b], 3)


def test_conflicting_copies_are_split_into_sequential_launches() -> None:
    from kvblocks.engine.runner import _conflict_free_batches

    independent = np.array([[1, 9], [2, 8], [3, 7]], dtype=np.int64)
    assert [b.tolist() for b in _conflict_free_batches(independent)] == [independent.tolist()]
    # Pair 3 writes block 9, which pair 1 wrote; pair 4 writes block 2, which pair 2 read.
    pairs = np.array([[1, 9], [2, 8], [3, 9], [4, 2], [5, 6]], dtype=np.int64)
    assert [b.tolist() for b in _conflict_free_batches(pairs)] == [
        [[1, 9], [2, 8]],
        [[3, 9], [4, 2], [5, 6]],
    ]
    chained = np.array([[1, 2], [2, 3], [3, 4]], dtype=np.int64)
    assert [b.tolist() for b in _conflict_free_batches(chained)] == [
        [[1, 2]],
        [[2, 3]],
        [[3, 4]],
    ]


def test_copy_groups_follow_sequential_semantics(tiny_llama: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, num_blocks=8, block_size=BS)
    key = runner.kv_caches[0][0]
    for block in range(8):
        key[block].fill_(float(block))
    out = SchedulerOutput.empty()
    out.memory_ops = [("copy", np.array([[1, 2], [2, 3], [4, 2]], dtype=np.int64))]
    runner.apply_memory_ops(out)
    assert [float(key[b, 0, 0, 0]) for b in range(5)] == [0.0, 1.0, 4.0, 1.0, 4.0]
