"""The scheduler with a manager built with KV cache groups (docs/hybrid-groups.md).

Admission, the watermark and preemption count every group's real need: a sliding-window
group holds only its window and the step's tokens, so a hybrid model admits more
sequences than a full-attention one in the same pool, and a prompt longer than full
attention's arithmetic allows still runs. ``SchedulerOutput`` carries every group's
tables and slot mappings (group 0 under the single-group names). What each group reads is
checked by content in ``test_content_oracle.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from sched_fake_model import fake_step

from kvblocks import AllocStatus, GroupSpec, InvalidArgumentError, KVCacheManager
from kvblocks.scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

FULL = GroupSpec.full_attention()


def _run(sched: Scheduler, max_steps: int = 2000) -> tuple[int, dict[str, list[int]]]:
    """Run to the end; the most sequences decoding at once and each request's tokens."""
    most = 0
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return most, done
        out = sched.schedule()
        most = max(most, out.num_decode_seqs)
        for result in sched.update(out, fake_step(out)).finished:
            done[result.request_id] = result.outputs[0].token_ids
    raise AssertionError("no progress")


def _requests(num: int, prompt_len: int, max_tokens: int) -> list[Request]:
    rng = np.random.default_rng(0)
    return [
        Request(
            f"r{i}",
            rng.integers(10, 97, prompt_len).tolist(),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        for i in range(num)
    ]


def test_a_window_model_runs_more_sequences_than_a_full_one_in_the_same_pool() -> None:
    """Two groups of equal layer counts: full + full against full + a 4-token window.
    A 100-token prompt decoding 20 tokens holds up to 30 + 30 blocks in the first and
    30 + 2 in the second, so the same 130-block pool decodes twice as many at once.
    Admission counts the window group's real need per step (a 32-token chunk: 8 + 8
    blocks); counting every block of every group (50 a prompt) decoded only 3."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16)
    most = {}
    for name, second in (("full", FULL), ("window", GroupSpec.sliding_window(4))):
        mgr = KVCacheManager(130, 4, groups=[FULL, second], enable_prefix_caching=False)
        sched = Scheduler(mgr, config)
        for request in _requests(6, 100, 20):
            sched.add_request(request)
        most[name], done = _run(sched)
        assert sorted(done) == [f"r{i}" for i in range(6)]
        assert all(len(tokens) == 20 for tokens in done.values())
    assert most["full"] == 2, most
    assert most["window"] == 4, most


def test_a_prompt_over_full_attention_arithmetic_is_admitted_when_the_window_fits() -> None:
    """A 100-token prompt with full + window groups needs 25 + 25 blocks if every group
    kept every token (more than the 39 usable), but 25 + at most 2 + the chunk's when the
    window group releases what its queries no longer see: it is accepted and computed in
    chunks, and generates all its tokens."""
    mgr = KVCacheManager(40, 4, groups=[FULL, GroupSpec.sliding_window(4)])
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=16))
    sched.add_request(Request("long", list(range(1, 101)), SamplingParams(max_tokens=8)))
    _, done = _run(sched)
    assert len(done["long"]) == 8
    # The same prompt with two full groups can never fit: rejected at add_request.
    full = Scheduler(KVCacheManager(40, 4, groups=[FULL, FULL]), SchedulerConfig())
    with pytest.raises(InvalidArgumentError, match="can ever give"):
        full.add_request(Request("long", list(range(1, 101)), SamplingParams(max_tokens=8)))


@pytest.mark.parametrize("budget", [16, 128])
def test_a_pure_window_model_runs_a_prompt_longer_than_the_pool(budget: int) -> None:
    """One sliding-window group of 8 tokens: a 200-token prompt (50 blocks) in a pool of
    19 usable blocks holds at most the window and a chunk. A 128-token chunk (32 blocks
    until it commits) can never be held: the step is halved until it fits, at admission
    and for the next chunks."""
    mgr = KVCacheManager(20, 4, groups=[GroupSpec.sliding_window(8)])
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=budget))
    sched.add_request(Request("long", list(range(1, 201)), SamplingParams(max_tokens=5)))
    _, done = _run(sched)
    assert len(done["long"]) == 5


def test_a_prompt_whose_worst_window_never_fits_is_refused() -> None:
    """46 tokens in blocks of 8, a 28-token window and a full group: the last token's step
    holds 4 + 6 = 10 blocks (the whole pool), but the query at position 40 sees blocks
    1..5 while the full group holds 6: 11. The request is refused at ``add_request``
    instead of being admitted and cut short."""
    groups = [GroupSpec.sliding_window(28), FULL]
    sched = Scheduler(KVCacheManager(11, 8, groups=groups, watermark=0.0), SchedulerConfig())
    with pytest.raises(InvalidArgumentError, match="can ever give"):
        sched.add_request(Request("r", list(range(1, 47)), SamplingParams(max_tokens=2)))
    # 40 tokens never pass position 40 and fit: 5 + 5 blocks at most.
    sched.add_request(Request("ok", list(range(1, 40)), SamplingParams(max_tokens=1)))
    _, done = _run(sched)
    assert len(done["ok"]) == 1


def test_a_prompt_peaking_outside_the_larger_chunks_period_is_refused() -> None:
    """A window of 12 and chunks of 12 and 8 over blocks of 1: the query at position 23
    holds 12 + 12 + 8 = 32 blocks, more than the 30 usable. The admission check read only
    the last 12 positions (the larger chunk's period, peak 28) and admitted the 38-token
    prompt, which then could not pass position 23 with the pool to itself."""
    groups = [
        GroupSpec.sliding_window(12),
        GroupSpec.chunked_local_attention(12),
        GroupSpec.chunked_local_attention(8),
    ]
    sched = Scheduler(KVCacheManager(31, 1, groups=groups, watermark=0.0), SchedulerConfig())
    with pytest.raises(InvalidArgumentError, match="can ever give"):
        sched.add_request(Request("r", list(range(1, 39)), SamplingParams(max_tokens=2)))
    roomy = Scheduler(KVCacheManager(33, 1, groups=groups, watermark=0.0), SchedulerConfig())
    roomy.add_request(Request("r", list(range(1, 39)), SamplingParams(max_tokens=2)))
    _, done = _run(roomy)
    assert len(done["r"]) == 2


def test_a_prompt_that_fits_only_in_one_step_from_position_0_is_admitted() -> None:
    """A chunk of 3 and two recurrent groups over 6 blocks of 1: the 2-token prompt computed
    in one step holds 2 + 2 + 1 = 5 blocks (a step from position 0 reads no state), one
    token a step would hold 2 + 2 + 2 at the second token. ``add_request`` judged the
    prompt by one token a step and refused it; it now tries the steps admission tries."""
    groups = [
        GroupSpec.chunked_local_attention(3),
        GroupSpec.recurrent(1),
        GroupSpec.recurrent(2),
    ]
    sched = Scheduler(KVCacheManager(6, 1, groups=groups, watermark=0.0), SchedulerConfig())
    sched.add_request(Request("r", [11, 12], SamplingParams(max_tokens=1)))
    out = sched.schedule()
    assert out.num_prefill_tokens == 2
    for result in sched.update(out, fake_step(out)).finished:
        assert result.request_id == "r" and len(result.outputs[0].token_ids) == 1
    assert not sched.has_unfinished_requests()
    # Three tokens cannot: the step holds 3 + 3 + 2 (or 2 + 2 + 2 one a step).
    with pytest.raises(InvalidArgumentError, match="can ever give"):
        sched.add_request(Request("long", [11, 12, 13], SamplingParams(max_tokens=1)))


def test_can_allocate_counts_the_steps_real_need_per_group() -> None:
    """``can_allocate(num_new_tokens=n)``: the blocks the step's ``allocate_slots`` takes
    in every group, against the whole-sequence form that counts every group's every
    block."""
    mgr = KVCacheManager(40, 4, groups=[FULL, GroupSpec.sliding_window(4)], watermark=0.0)
    mgr.add_sequence(1, list(range(1, 101)))
    assert mgr.can_allocate(1) == AllocStatus.NEVER  # 25 + 25 > 39
    assert mgr.can_allocate(1, num_new_tokens=16) == AllocStatus.OK  # 4 + 4
    # A step of the whole prompt holds every block in both groups until it commits.
    assert mgr.can_allocate(1, num_new_tokens=100) == AllocStatus.NEVER
    taken = mgr.allocate_slots(1, 16)
    assert taken is not None and len(taken) == 8
    with pytest.raises(Exception, match="already has slots"):
        mgr.can_allocate(1, num_new_tokens=4)
    mgr.add_sequence(2, list(range(200, 300)))
    # 31 free: a 64-token step needs 16 + 16, a 60-token one 15 + 15.
    assert mgr.can_allocate(2, num_new_tokens=64) == AllocStatus.LATER
    assert mgr.can_allocate(2, num_new_tokens=60) == AllocStatus.OK
    with pytest.raises(InvalidArgumentError):
        mgr.can_allocate(2, num_new_tokens=101)


def test_preemption_under_groups_frees_every_groups_blocks() -> None:
    """Sequences that grow past the pool preempt others (recompute); every request still
    generates all its tokens, and the pool is whole at the end."""
    mgr = KVCacheManager(
        24, 2, groups=[FULL, GroupSpec.chunked_local_attention(6)], enable_prefix_caching=True
    )
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))
    for request in _requests(5, 6, 12):
        sched.add_request(request)
    _, done = _run(sched)
    assert sched.counters.num_preemptions_recompute > 0
    assert all(len(tokens) == 12 for tokens in done.values()) and len(done) == 5
    assert len(mgr) == 0 and mgr.num_free_blocks() == 23


def test_the_output_carries_every_groups_tables_and_slots() -> None:
    """``group_block_tables`` ``[G, S, B]`` and ``group_slot_mappings`` ``[G, T]`` are
    the manager's own per-group tables and slots; group 0 is the single-group fields."""
    groups = [FULL, GroupSpec.sliding_window(5), GroupSpec.chunked_local_attention(8)]
    mgr = KVCacheManager(64, 4, groups=groups)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=64))
    sched.add_request(Request("a", list(range(1, 23)), SamplingParams(max_tokens=3)))
    sched.add_request(Request("b", list(range(30, 41)), SamplingParams(max_tokens=3)))
    for _ in range(3):
        out = sched.schedule()
        assert out.num_groups == 3
        tables = mgr.group_block_tables(out.seq_ids)
        got = out.group_block_tables
        assert got.shape == (3, out.num_seqs, tables.shape[2])
        np.testing.assert_array_equal(got, tables)
        np.testing.assert_array_equal(got[0], out.block_tables)
        slots = mgr.group_slot_mappings(out.seq_ids, out.num_scheduled_tokens)
        np.testing.assert_array_equal(out.group_slot_mappings, slots)
        np.testing.assert_array_equal(out.group_slot_mappings[0], out.slot_mapping)
        assert out.group_block_table is not None
        assert out.group_block_table.shape[0] == 3
        assert np.shares_memory(out.group_block_table[0], out.block_table)
        assert out.group_block_table_deltas is not None
        assert out.group_block_table_deltas[0] is out.block_table_delta
        sched.update(out, fake_step(out))


def test_a_single_group_output_has_one_group() -> None:
    """Without groups the per-group fields are the single-group ones with a leading 1."""
    sched = Scheduler(KVCacheManager(32, 4), SchedulerConfig())
    sched.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.num_groups == 1
    np.testing.assert_array_equal(out.group_slot_mappings, out.slot_mapping[None])
    np.testing.assert_array_equal(out.group_block_tables, out.block_tables[None])
    assert out.group_block_table is not None
    assert np.shares_memory(out.group_block_table, out.block_table)


@pytest.mark.parametrize(
    "group", [FULL, GroupSpec.sliding_window(5), GroupSpec.recurrent(2)], ids=str
)
def test_a_lone_groups_slots_are_the_managers_on_decode_steps(group: GroupSpec) -> None:
    """A decode-only step of a one-group manager reads its slots in the fused decode
    call: they must be the manager's ``slot_mapping`` (all -1 for a recurrent state
    group, which keeps no per-token KV; the fused call gave slots inside the state
    block), as on the prefill step."""
    mgr = KVCacheManager(32, 4, groups=[group])
    sched = Scheduler(mgr, SchedulerConfig())
    for i in range(2):
        sched.add_request(
            Request(
                f"r{i}",
                list(range(10 * i, 10 * i + 6)),
                SamplingParams(max_tokens=6, ignore_eos=True),
            )
        )
    decodes = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        want = mgr.slot_mapping(out.seq_ids, out.num_scheduled_tokens)
        np.testing.assert_array_equal(out.slot_mapping, want)
        if group.kind == "mamba":
            assert (out.slot_mapping == -1).all()
        decodes += out.num_prefill_tokens == 0
        sched.update(out, fake_step(out))
    assert decodes >= 4
