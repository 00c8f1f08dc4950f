"""KV-content oracle, level (b), with recurrent-state groups: the scheduler driven like an
engine that runs a hybrid recurrent model.

The random configurations of ``test_content_oracle.py`` (policies, both preemption modes,
chunked prefill, prefix caching, CPU pools, host tiers, ``n > 1``, beam search, aborts)
run over a manager with a full-attention group and one or two
``GroupSpec.recurrent(k)`` groups (``k`` of 1 to 3 blocks; no lookahead, which a state
group refuses), or, in a fifth of them, the state groups alone (no attention group: a
lone state group's decode-only steps take the scheduler's one-table fused decode call).
Besides every attention read of the base harness, each step is checked as a recurrent
engine runs it, from ``SchedulerOutput.state_mappings`` alone, after the step's
``memory_ops``:

1. each sequence reads, for every state group, the block ``read_blocks[i]`` names, and
   that block must hold exactly the state after the sequence's computed tokens (``-1``,
   the zero state, only before any token is computed): a prefix hit must have restored a
   cached checkpoint, a fork's copy-on-write copy, a swap or a tier load must have brought
   the state there; the group's row of ``group_slot_mappings`` is all ``-1`` (it keeps no
   per-token KV);
2. the step saves the states at ``write_positions`` (each checkpoint boundary it crosses,
   then its end, as the oracle's own rule :func:`oracle.kv_memory.state_writes` says) into
   ``write_blocks``, which no other sequence of the step reads or writes;
3. after ``update`` every sequence of the step still on the GPU holds exactly one state
   block per group, the one with its own state.

The state of ``[0, p)`` is the prefix id of position ``p - 1`` in the group's own
namespace (see ``tests/oracle/kv_memory.py``), so a state of another sequence, another
group, or a stale one reads a wrong id.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
import test_content_oracle as base

from kvblocks import GroupSpec
from kvblocks.scheduler import Request
from oracle.kv_memory import Attention, ContentError, state_writes

NUM_BATCHES = 4
CONFIGS_PER_BATCH = 25 * base.SCALE


class StateConfig(base.Config):
    """A base configuration with state groups beside the attention group."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        rng = np.random.default_rng(seed + 5_000_003)
        # One full-attention group (group 0, the only one with KV), then the state groups.
        self.window = None
        self.sched = dataclasses.replace(self.sched, num_lookahead_tokens=0)
        self.every = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(1, 3)))]
        self.rules = [Attention()]
        self.groups = [GroupSpec.full_attention()] + [GroupSpec.recurrent(k) for k in self.every]
        # A fifth of the configurations keep the state groups only (their own generator:
        # the draws above stay what they were).
        if np.random.default_rng(seed + 6_000_003).random() < 0.2:
            self.rules = []
            self.groups = self.groups[1:]

    @property
    def state_groups(self) -> range:
        """The state groups' indices: after the attention group, if there is one."""
        return range(len(self.rules), len(self.rules) + len(self.every))


class StateHarness(base.Harness):
    """The base harness plus the state reads and writes of every step."""

    cfg: StateConfig

    def __init__(self, cfg: StateConfig) -> None:
        super().__init__(cfg)
        self.reached: Counter[str] = Counter()
        self.scheduled: list[int] = []

    def _state_ids(self, request: Request, group: int, tokens: list[int]) -> list[int]:
        # ids[p - 1] is the state after [0, p): the state group's own namespace.
        return self.prefix_ids.ids(tokens, (base._namespace(request), "state", group))

    def sync_table(self, out: Any) -> np.ndarray:
        """The base check of every group's table (state groups included); attention then
        reads group 0's only (``cfg.rules``)."""
        rules = self.cfg.rules
        self.cfg.rules = rules + [Attention()] * len(self.cfg.every)
        try:
            return super().sync_table(out)
        finally:
            self.cfg.rules = rules

    def apply_memory_ops(self, out: Any) -> None:
        super().apply_memory_ops(out)
        self.run_states(out)
        self.scheduled = out.seq_ids.tolist()

    def run_states(self, out: Any) -> None:
        cfg, mgr, mem = self.cfg, self.mgr, self.mem
        groups = list(cfg.state_groups)
        assert len(out.state_mappings) == (len(groups) if out.num_seqs else 0)
        if not out.num_seqs:
            return
        seqs = out.seq_ids.tolist()
        for g, mapping in zip(groups, out.state_mappings, strict=True):
            every = cfg.every[g - groups[0]]
            assert len(mapping) == len(seqs)
            if (out.group_slot_mappings[g] != -1).any():
                raise ContentError(
                    f"state group {g} maps KV slots: {out.group_slot_mappings[g].tolist()}"
                )
            reads = mapping.read_blocks.tolist()
            indptr = mapping.write_indptr.tolist()
            written: dict[int, int] = {}
            for i, seq in enumerate(seqs):
                request = self.sched._owner[seq].request
                seq_len = int(out.seq_lens[i])
                computed = seq_len - int(out.num_scheduled_tokens[i])
                tokens = mgr.token_ids(seq).tolist()[:seq_len]
                ids = self._state_ids(request, g, tokens)
                if computed == 0:
                    if reads[i] != -1:
                        raise ContentError(f"sequence {seq}: reads block {reads[i]} at 0 tokens")
                else:
                    got = mem.read_state(reads[i]) if reads[i] > 0 else None
                    if got != ids[computed - 1]:
                        raise ContentError(
                            f"sequence {seq} group {g}: block {reads[i]} holds state {got}, "
                            f"expected the state after {computed} tokens"
                        )
                    self.reached["state_reads"] += 1
                positions = mapping.write_positions[indptr[i] : indptr[i + 1]].tolist()
                blocks = mapping.write_blocks[indptr[i] : indptr[i + 1]].tolist()
                want = state_writes(computed, seq_len, cfg.block_size, every)
                assert positions == want, (seq, g, computed, seq_len, positions, want)
                for p, block in zip(positions, blocks, strict=True):
                    assert block > 0, (seq, g, p, block)
                    owner = written.setdefault(block, seq)
                    if owner != seq or block in reads[:i] + reads[i + 1 :]:
                        raise ContentError(
                            f"group {g}: block {block} is written by sequence {seq} and "
                            f"used by another sequence of the step"
                        )
                    mem.write(mem.state_slots(block), [ids[p - 1]] * cfg.block_size)
                self.reached["state_checkpoints"] += len(positions) - 1

    def run_step(self, step: int) -> None:
        super().run_step(step)
        mgr = self.mgr
        # The step's sequences that are still held (a waiting one may hold a claimed
        # prefix and no table yet).
        for seq in self.scheduled:
            if seq not in mgr or mgr.is_swapped(seq):
                continue
            request = self.sched._owner[seq].request
            computed = mgr.num_computed_tokens(seq)
            tokens = mgr.token_ids(seq).tolist()[:computed]
            for g in self.cfg.state_groups:
                self.mem.check_state(
                    seq,
                    mgr.block_table(seq, group=g),
                    self._state_ids(request, g, tokens),
                    computed,
                    held_exactly=True,
                )

    def pool_is_full(self, request: Request, tokens: list[int]) -> bool:
        """The base rule (``Harness.pool_is_full``), with each sequence (each beam) also
        holding, in every state group, its state and every state its step saves: a step
        that computes the sequence whole (a recompute) saves each checkpoint it crosses
        before its commit lets the cache take them."""
        cfg = self.cfg
        usable = cfg.num_blocks - 1 - int(np.floor(cfg.watermark * cfg.num_blocks))
        prompt = request.num_prompt_tokens
        length = prompt + len(tokens)
        need = -(-length // cfg.block_size)
        params = request.sampling_params
        width = params.beam_width if params.use_beam_search else 1
        if params.use_beam_search:
            shared = prompt // cfg.block_size
            need = shared + width * (need - shared)
        states = sum(length // (k * cfg.block_size) + 2 for k in cfg.every)
        return need + states * width > usable


#: By seed: what each configuration's run reached, kept by the run that judged it (the file
#: runs on one worker) so that the coverage test reads it instead of running it again.
_REACHED: dict[int, Counter[str]] = {}


def run_config(seed: int) -> StateHarness:
    """Run one configuration to the end; raise with the seed on any failure."""
    harness = StateHarness(StateConfig(seed))
    try:
        harness.run()
    except (AssertionError, ContentError) as exc:
        raise AssertionError(f"state configuration seed={seed}: {exc}") from exc
    seen = Counter(harness.reached) + Counter(harness.tier_ops)
    counters = harness.sched.counters
    seen["cached_tokens"] += counters.num_cached_tokens_admitted
    seen["preempt_swap"] += counters.num_preemptions_swap
    seen["preempt_recompute"] += counters.num_preemptions_recompute
    _REACHED[seed] = seen
    return harness


@pytest.mark.parametrize("batch", range(NUM_BATCHES))
def test_every_step_reads_its_own_state(batch: int) -> None:
    """Every scheduled sequence reads its own state and attention KV; every request ends."""
    for k in range(CONFIGS_PER_BATCH):
        run_config(batch * CONFIGS_PER_BATCH + k)


def test_the_state_oracle_reaches_forks_hits_and_preemption() -> None:
    """The runs above restore states from the prefix cache, fork them (copy-on-write
    copies), swap and recompute them, and save checkpoints inside steps."""
    seen: Counter[str] = Counter()
    for seed in range(CONFIGS_PER_BATCH):
        if seed not in _REACHED:
            run_config(seed)
        seen.update(_REACHED[seed])
    keys = ("state_reads", "state_checkpoints", "copy", "swap_out", "swap_in")
    keys += ("cached_tokens", "preempt_swap", "preempt_recompute")
    assert all(seen[k] > 0 for k in keys), seen
