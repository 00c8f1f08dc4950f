"""The full decode step through the Python API with the block tables kept incrementally.

Run with ``pytest benches/block_table --benchmark-only``. One step for 1,024 running
sequences: ``allocate_slots_batch`` + ``slot_mapping`` + block tables + ``commit_batch``,
where the block tables are either

* ``incremental``: ``update_block_table`` writes only the changed entries into a
  persistent ``[1024, max_blocks]`` int32 table (what the scheduler does), or
* ``rebuild``: ``block_tables`` builds the ``[1024, B]`` matrix anew (the old way),

at 32k tokens per sequence (the issue's case: an 8 MB matrix) and at 128 tokens. The
session ends with the two side by side (best round of each, same run) and the issue's
target (incremental step at 1,024 x 32k <= 100 us).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvblocks

NUM_SEQS = 1024
BLOCK_SIZE = 16
ROUNDS = 200
SHAPES = {"1024 x 32k": 32_768, "1024 x 128": 128}


def _running(length: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """1,024 sequences of ``length`` computed tokens, room for ``ROUNDS`` + warm-up more;
    returns the manager, the ids, their rows and a synced persistent table."""
    cols = -(-(length + 2 * ROUNDS + 8) // BLOCK_SIZE)
    m = kvblocks.KVCacheManager(
        NUM_SEQS * cols + 1, BLOCK_SIZE, enable_prefix_caching=False, watermark=0.0
    )
    prompt = np.arange(length, dtype=np.int64) % 50_000
    ids = np.arange(NUM_SEQS, dtype=np.int64)
    for sid in ids.tolist():
        m.add_sequence(sid, prompt)
    assert m.allocate_slots_batch(ids, length).num_served == NUM_SEQS
    m.commit_batch(ids, length, np.ones(NUM_SEQS, dtype=np.int64))
    rows = np.arange(NUM_SEQS, dtype=np.int32)
    table = np.zeros((NUM_SEQS, cols), dtype=np.int32)
    m.update_block_table(table, ids, rows)  # the first sync writes rows whole
    return m, ids, rows, table


@pytest.mark.parametrize("way", ["incremental", "rebuild"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_step_block_table(benchmark: Any, record: Any, shape: str, way: str) -> None:
    m, ids, rows, table = _running(SHAPES[shape])
    sampled = np.full(NUM_SEQS, 7, dtype=np.int64)

    def step() -> None:
        assert m.allocate_slots_batch(ids, 1).num_served == NUM_SEQS
        m.slot_mapping(ids)
        if way == "incremental":
            m.update_block_table(table, ids, rows)
        else:
            m.block_tables(ids)
        m.commit_batch(ids, 1, sampled)

    benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=5)
    record(shape, way)
    # The kept table is the real thing: every row equals the sequence's table.
    if way == "incremental":
        for sid in (0, 511, 1023):
            want = m.block_table(sid)
            assert (table[sid, : len(want)] == want).all() and not table[sid, len(want) :].any()
    m.check_invariants()
