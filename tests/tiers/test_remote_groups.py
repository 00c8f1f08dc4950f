"""What a remote tier reads and imports per KV cache group: the core's hit rule over what
the store returned, and store keys that name the group."""

from __future__ import annotations

from kvblocks import GroupSpec
from kvblocks.tiers.remote_groups import group_tags, plan_fetch

B = 4
HASHES = [bytes([i]) * 8 for i in range(8)]
FULL, WINDOW = GroupSpec.full_attention(), GroupSpec.sliding_window(6)


def test_one_group_keys_by_hash_alone() -> None:
    """A single-group engine keeps the keys every single-group store already holds."""
    assert group_tags([FULL]) == [b""]
    plan = plan_fetch([FULL], [b""], B, HASHES, 2, 4)
    assert plan.keys == tuple(HASHES[2:6]) and plan.limit == 6
    # The leading run of hits.
    assert plan.hit([True, True, False, True]) == 4
    assert plan.hit([False, True, True, True]) == 2


def test_groups_have_distinct_keys_naming_index_and_spec() -> None:
    tags = group_tags([FULL, WINDOW, WINDOW])
    assert len(set(tags)) == 3 and all(len(t) == 8 for t in tags)
    # Another spec at the same index is another key.
    assert group_tags([FULL, GroupSpec.sliding_window(8)])[1] != tags[1]
    plan = plan_fetch([FULL, WINDOW], tags[:2], B, HASHES, 0, 100)
    assert set(plan.keys) == {tags[g] + HASHES[j] for g, j in plan.entries}
    assert len(set(plan.keys)) == len(plan.keys) == 16


def test_the_hit_follows_the_rule_of_every_group() -> None:
    """Full attention needs every block past the local hit, a window of 6 tokens (blocks
    of 4) only the blocks of its last 5 tokens before the hit point, a recurrent group
    block ``k - 1`` at a checkpoint."""
    tags = group_tags([FULL, WINDOW])
    plan = plan_fetch([FULL, WINDOW], tags, B, HASHES, 2, 100)
    # Blocks below the local hit of 2 are held in every group that needs them.
    assert plan.entries[:2] == ((0, 2), (1, 2)) and all(j >= 2 for _, j in plan.entries)
    found = {e: True for e in plan.entries}
    found[(1, 3)] = False  # a block no window past it needs: the hit is still 8
    assert plan.hit([found[e] for e in plan.entries]) == 8
    imports = plan.imports(8)
    assert [plan.entries[i][1] for i in imports[0]] == list(range(2, 8))
    assert [plan.entries[i][1] for i in imports[1]] == [6, 7]
    found[(1, 7)] = False  # the window of a hit of 8 misses: 7 (blocks 5 and 6)
    assert plan.hit([found[e] for e in plan.entries]) == 7
    assert [plan.entries[i][1] for i in plan.imports(7)[1]] == [5, 6]
    # Without the full group's block 2 nothing past the local hit is served.
    found[(0, 2)] = False
    assert plan.hit([found[e] for e in plan.entries]) == 2

    state = GroupSpec.recurrent(2)
    tags = group_tags([FULL, state])
    plan = plan_fetch([FULL, state], tags, B, HASHES, 0, 100)
    # Only checkpoints' states are read (blocks 1, 3, 5, 7).
    assert [j for g, j in plan.entries if g == 1] == [1, 3, 5, 7]
    flags = [not (g == 1 and j == 5) for g, j in plan.entries]
    assert plan.hit(flags) == 8
    flags = [not (g == 1 and j == 7) for g, j in plan.entries]
    assert plan.hit(flags) == 6  # the last checkpoint with a state
    assert [plan.entries[i][1] for i in plan.imports(6)[1]] == [5]


def test_the_cap_cuts_at_the_end_of_a_run() -> None:
    tags = group_tags([FULL, WINDOW])
    plan = plan_fetch([FULL, WINDOW], tags, B, HASHES, 0, 5)
    assert len(plan.keys) == 5 and plan.limit == 3
    assert plan.hit([True] * 5) == 2  # block 2 of the window group was cut


def test_a_layout_with_states_is_another_layout() -> None:
    """A recurrent hybrid's records are as wide as the wider of a block's KV and its
    states, and its fingerprint names the states (other layouts' fingerprints stay)."""
    import torch

    from kvblocks.tiers import KVLayout

    kv = KVLayout(2, 1, 8, 64, torch.float32, weights_digest="0" * 64)
    assert kv.payload_nbytes == kv.kv_nbytes == 2 * 2 * 8 * 64 * 4
    wide = KVLayout(2, 1, 8, 64, torch.float32, weights_digest="0" * 64, state_nbytes=50_000)
    assert wide.payload_nbytes == 50_000 and wide.kv_nbytes == kv.kv_nbytes
    narrow = KVLayout(2, 1, 8, 64, torch.float32, weights_digest="0" * 64, state_nbytes=100)
    assert narrow.payload_nbytes == kv.payload_nbytes
    assert len({kv.fingerprint, wide.fingerprint, narrow.fingerprint}) == 3
