"""Level (a) of the content oracle: the block manager drives an emulated KV memory.

Every operation is applied as an engine applies it (see ``tests/oracle/kv_memory.py``):
``allocate_slots`` is followed by the copy-on-write copies it queued, then the model
step's writes through ``slot_mapping`` (lookahead slots get garbage), and ``commit`` may
then take fewer tokens than were written. After every operation each resident sequence
must read exactly the KV of its own tokens through its block table, and no write may land
in a block that another live sequence holds. Nothing here models the manager's rules:
the claimed prefix, the copies and the swaps are judged by what the memory holds.

The reads go through a persistent ``[rows, max_blocks]`` table kept only by
``update_block_table`` (each sequence in a row of a small row allocator: rows are freed
when a sequence is freed or swapped out, reused by others, moved, and the buffer is
replaced by a bigger one with ``full=True`` when rows run out), as an engine keeps it; a
mirror of it is patched only through the returned deltas. A few sequences at a time lag
(are not synced for some operations), as unscheduled sequences do in a serving loop.

Effects that random draws reach only by luck have a rule that reaches them for certain:
``flood`` runs one-off prompts over the whole free pool, so with prefix caching on its
cached blocks are evicted, and a high-priority prefix must outlive a low-priority one
that least-recently-used order alone would have kept (``set_retention_priority``);
``add_twin`` adds a prompt while a pending reservation computes its prefix (blocks in
flight); ``fork_and_write`` writes into a shared partial block (copy-on-write). Hypothesis
derandomizes under ``CI=true``, so whether a configuration with caching is drawn at all
depends on the class's shape: :func:`_forced_flood` runs one fixed such example besides.

Budget: ``ORACLE_EXAMPLES * ORACLE_STEPS`` random operations per run (at least 10,000),
multiplied by the environment variable ``KVBLOCKS_ORACLE_SCALE`` for long runs.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvblocks
from kvblocks import KVCacheManager
from kvblocks.router import PromptHasher
from oracle.kv_memory import (
    GARBAGE,
    Attention,
    ContentError,
    KVMemory,
    PrefixIds,
    assert_array_equal,
)

SCALE = int(os.environ.get("KVBLOCKS_ORACLE_SCALE", "1"))
MIN_OPERATIONS = 10_000 * SCALE
ORACLE_EXAMPLES = 200 * SCALE
ORACLE_STEPS = 90

#: What the runs reached, summed over examples: operations that changed something, and
#: the events whose content effects the oracle exists to check.
COVERAGE: Counter[str] = Counter()

# A small vocabulary and a few shared stems make prefix-cache hits and duplicates common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4]]
NAMESPACES = [(None, None), ("salt", None), (None, 3)]
#: Columns of the persistent table: more than any table of a run can reach.
TABLE_WIDTH = 256
#: A sequence's retention priority until it is set.
DEFAULT_PRIORITY = 35
#: What ``prioritize`` sets: valid priorities and two out of range (refused, no change).
PRIORITIES = [0, 10, 35, 60, 100, -1, 101]
#: First token of one-off flood prompts: above the vocabulary, one per sequence id, so a
#: flood prompt shares no block with any other prompt.
FLOOD_TOKEN = 1000


def _oracle_settings(
    max_examples: int = ORACLE_EXAMPLES, attempt: int = 0, **overrides: Any
) -> settings:
    """The budget of one oracle run (``max_examples`` runs of ``ORACLE_STEPS`` steps, no
    deadline, no health checks), with further ``settings`` options in ``overrides``.

    ``attempt`` > 0 is a repeat because the budget or the coverage was not reached: it
    draws new examples even where the profile derandomizes (``CI=true``), whose repeats
    would replay the same draws and never reach what the first run missed (the draws
    depend on what the manager does, so a change elsewhere can move them)."""
    if attempt:
        overrides.setdefault("derandomize", False)
    return settings(
        max_examples=max_examples,
        stateful_step_count=ORACLE_STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **overrides,
    )


class ContentOracle(RuleBasedStateMachine):
    """Random manager operations, each checked against what the KV memory holds."""

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.mem: KVMemory
        self.ids = PrefixIds()
        self.next_id = 0
        # Per held sequence: its tokens and namespace (the oracle's own record, never
        # read back from the manager), and the pending reservation's size, if any.
        self.tokens: dict[int, list[int]] = {}
        self.ns: dict[int, tuple[str | None, int | None]] = {}
        self.prio: dict[int, int] = {}  # retention priority set (DEFAULT_PRIORITY if absent)
        self.computed: dict[int, int] = {}
        self.allocated: set[int] = set()
        self.swapped: set[int] = set()
        self.pending: dict[int, int] = {}
        # Token lists seen so far: new prompts often repeat one, for prefix-cache hits.
        self.history: list[tuple[list[int], tuple[str | None, int | None]]] = []
        self.ops = 0
        # The persistent block tables, one per KV cache group (see the module
        # docstring), and their delta mirror.
        self.table = np.zeros((1, 4, TABLE_WIDTH), dtype=np.int32)
        self.mirror = self.table.copy()
        #: The attention rule of each KV cache group (set by ``setup``).
        self.attention: list[Attention] = [Attention()]
        self.row_of: dict[int, int] = {}
        self.row_last_owner: dict[int, int] = {}
        self.row_len: dict[tuple[int, int], int] = {}  # entries last written per (group, row)
        self.free_rows = list(range(3, -1, -1))
        self.lagging: dict[int, int] = {}  # sid -> invariants it skips

    @initialize(
        num_blocks=st.integers(4, 30),
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_cpu_blocks=st.integers(0, 12),
        caching=st.booleans(),
        hash_algo=st.sampled_from(["blake3", "xxh3_128", "sha256_cbor"]),
        window=st.sampled_from([None, None, 3, 8, 20]),
    )
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, hash_algo, window):
        self.bs = block_size
        self.attention = [Attention(window=window)]
        self.m = KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=caching,
            hash_algo=hash_algo,
            watermark=0.0,
            sliding_window=window,
            record_events=False,
        )
        # sha256_cbor keys a LoRA by vLLM's adapter name and path, not by its id.
        self.m.register_lora(3, "adapter-3", "/adapters/3")
        self.mem = KVMemory(num_blocks, num_cpu_blocks, block_size)

    # -- helpers ---------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.attention)

    def _expected(self, sid: int, group: int = 0) -> list[int]:
        """What group ``group`` of the sequence must read: its own KV, distinct from every
        other group's (a one-group manager keeps the plain namespace)."""
        ns = self.ns[sid] if self.num_groups == 1 else (self.ns[sid], group)
        return self.ids.ids(self.tokens[sid], ns)

    def _tables(self, sid: int) -> list[np.ndarray]:
        """The sequence's block table of every group (a one-group manager through the
        one-group API)."""
        if self.num_groups == 1:
            return [self.m.block_table(sid)]
        return list(self.m.group_block_tables([sid])[:, 0])

    def _slot_mappings(self, sids: list[int], counts: list[int]) -> np.ndarray:
        """``[groups, tokens]`` slots of the sequences' next ``counts`` tokens."""
        if self.num_groups == 1:
            return self.m.slot_mapping(sids, counts)[None, :]
        return self.m.group_slot_mappings(sids, counts)

    def _check_reads(self, sid: int, computed: int, tables: list[np.ndarray] | None = None):
        """Every group of the sequence reads its own KV through its table, and holds no
        block a future query cannot see."""
        tables = self._tables(sid) if tables is None else tables
        for g, table in enumerate(tables):
            self.mem.check(
                (sid, g),
                table,
                self._expected(sid, g),
                computed,
                attention=self.attention[g],
                released_exactly=True,
            )

    def _resident(self) -> list[int]:
        return sorted(self.allocated - self.swapped)

    def _idle(self) -> list[int]:
        """Resident, allocated sequences without a pending reservation."""
        return [s for s in self._resident() if s not in self.pending]

    def _write_reserved(self, served: dict[int, tuple[int, int]]) -> None:
        """The model step: write ``new`` tokens' KV and ``lookahead`` garbage slots of every
        served sequence through ``slot_mapping``, all in one step."""
        writes = []
        sids = list(served)
        counts = [new + lookahead for new, lookahead in served.values()]
        slots = self._slot_mappings(sids, counts)
        assert slots.shape == (self.num_groups, sum(counts)), slots.shape
        starts = np.cumsum([0, *counts])
        for i, (sid, (new, lookahead)) in enumerate(served.items()):
            c = self.computed[sid]
            for g in range(self.num_groups):
                values = self._expected(sid, g)[c : c + new] + [GARBAGE] * lookahead
                writes.append(((sid, g), slots[g, starts[i] : starts[i + 1]], values))
        # A write must not land in a block any other live sequence (or another group of
        # the same one) holds.
        held: dict[int, tuple[int, int]] = {}
        for other in self._resident():
            for g, table in enumerate(self._tables(other)):
                for b in table.tolist():
                    if b != 0:
                        held.setdefault(b, (other, g))
                        if held[b] != (other, g):
                            held[b] = (-1, -1)  # shared
        for owner, owner_slots, _ in writes:
            for b in np.unique(np.asarray(owner_slots) // self.bs).tolist():
                if held.get(b) != owner:
                    raise ContentError(
                        f"sequence {owner[0]} group {owner[1]} writes block {b}, which "
                        f"(sequence, group) {held.get(b)} ((-1, -1): several) also holds"
                    )
        self.mem.write_step(writes)

    def _copy_on_writes(self) -> None:
        pairs = self.m.take_copy_on_writes()
        COVERAGE["copy_on_write"] += len(pairs)
        self.mem.copy(pairs)

    def _after_allocate(self, sid: int, new: int, lookahead: int) -> None:
        COVERAGE["ops"] += 1
        COVERAGE["lookahead"] += lookahead > 0
        if sid not in self.allocated:
            self.allocated.add(sid)
            self.computed[sid] = self.m.num_computed_tokens(sid)
            COVERAGE["prefix_hit"] += self.computed[sid] > 0
        self.pending[sid] = new

    # -- rules -----------------------------------------------------------------------------

    @rule(
        data=st.data(),
        stem=st.sampled_from(STEMS),
        extra=st.lists(st.integers(0, 11), max_size=12),
        cut=st.integers(1, 8),
        ns=st.sampled_from(NAMESPACES),
    )
    def add(self, data, stem, extra, cut, ns):
        tokens = stem[:cut] + extra
        if self.history and data.draw(st.booleans()):
            # Another sequence's tokens (possibly with its KV cached), maybe extended.
            seen, ns = data.draw(st.sampled_from(self.history))
            tokens = seen[: data.draw(st.integers(1, len(seen)))] + extra[:4]
        sid = self.next_id
        self.next_id += 1
        self.m.add_sequence(sid, tokens, cache_salt=ns[0], lora_id=ns[1])
        COVERAGE["ops"] += 1
        self.tokens[sid] = list(tokens)
        self.ns[sid] = ns
        self.history = [*self.history[-15:], (list(tokens), ns)]

    def _allocatable(self) -> list[int]:
        return [s for s in self.tokens if s not in self.swapped and s not in self.pending]

    @rule(data=st.data(), lookahead=st.sampled_from([0, 0, 1, 3, 8]))
    def allocate(self, data, lookahead):
        candidates = [s for s in self.tokens if s not in self.swapped and s not in self.pending]
        if not candidates:
            return
        sid = data.draw(st.sampled_from(candidates))
        computed = self.m.num_computed_tokens(sid)
        left = len(self.tokens[sid]) - computed
        new = data.draw(st.integers(0, left))
        got = self.m.allocate_slots(sid, new, num_lookahead_tokens=lookahead)
        if got is None:
            return
        self._copy_on_writes()
        self._after_allocate(sid, new, lookahead)
        self._write_reserved({sid: (new, lookahead)})

    @rule(data=st.data(), lookahead=st.sampled_from([0, 1, 4]))
    def allocate_batch(self, data, lookahead):
        candidates = [s for s in self.tokens if s not in self.swapped and s not in self.pending]
        if not candidates:
            return
        sids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True))
        news = []
        for s in sids:
            left = len(self.tokens[s]) - self.m.num_computed_tokens(s)
            news.append(data.draw(st.integers(0, left)))
        result = self.m.allocate_slots_batch(
            np.array(sids), np.array(news), num_lookahead_tokens=lookahead
        )
        served = result.num_served
        # Every served sequence reports the cached tokens it claimed and its new blocks.
        assert len(result.num_cached_tokens) == served
        assert len(result.block_indptr) == served + 1
        self._copy_on_writes()
        for i, s in enumerate(sids[:served]):
            first = s not in self.allocated
            self._after_allocate(s, news[i], lookahead)
            claimed = int(result.num_cached_tokens[i])
            assert claimed == (self.computed[s] if first else 0), (s, claimed)
            table = {b for t in self._tables(s) for b in t.tolist()}
            new_blocks = result.block_ids[result.block_indptr[i] : result.block_indptr[i + 1]]
            assert set(new_blocks.tolist()) <= table
        self._write_reserved({s: (news[i], lookahead) for i, s in enumerate(sids[:served])})

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), sample=st.booleans())
    def commit(self, data, sample):
        sid = data.draw(st.sampled_from(sorted(self.pending)))
        wrote = self.pending.pop(sid)
        k = data.draw(st.integers(0, wrote))
        new_tokens = [data.draw(st.integers(0, 11))] if sample else []
        self.m.commit(sid, k, new_tokens)
        COVERAGE["ops"] += 1
        COVERAGE["partial_commit"] += k < wrote
        self.computed[sid] += k
        self.tokens[sid] += new_tokens

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit_batch(self, data):
        sids = data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True))
        ks = [data.draw(st.integers(0, self.pending[s])) for s in sids]
        toks = [data.draw(st.integers(-1, 11)) for _ in sids]
        self.m.commit_batch(np.array(sids), np.array(ks), np.array(toks))
        COVERAGE["ops"] += 1
        for s, k, t in zip(sids, ks, toks, strict=True):
            del self.pending[s]
            self.computed[s] += k
            if t >= 0:
                self.tokens[s].append(t)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 11))
    def fork(self, data, token):
        """Fork any held sequence — waiting, running, mid-prefill — then each side appends
        its own sampled token (the documented protocol). Forking a sequence with a pending
        reservation, or a swapped-out one, must be refused."""
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        if parent in self.pending or parent in self.swapped:
            with pytest.raises(kvblocks.SequenceStateError):
                self.m.fork(parent, child)
            return
        self.next_id += 1
        self.m.fork(parent, child)
        COVERAGE["ops"] += 1
        COVERAGE["fork"] += 1
        self.tokens[child] = list(self.tokens[parent])
        self.ns[child] = self.ns[parent]
        self.prio[child] = self.prio.get(parent, DEFAULT_PRIORITY)  # forks inherit it
        if parent not in self.allocated:
            return  # both claim the cached prefix at their first allocation
        self.computed[child] = self.computed[parent]
        self.allocated.add(child)
        if data.draw(st.booleans()):
            self.m.commit(parent, 0, [token])
            self.tokens[parent].append(token)
            self.m.commit(child, 0, [(token + 1) % 12])
            self.tokens[child].append((token + 1) % 12)

    @precondition(
        lambda self: any(self.computed[s] % self.bs for s in self._idle() if s not in self.swapped)
    )
    @rule(data=st.data(), token=st.integers(0, 11))
    def fork_and_write(self, data, token):
        """Fork a sequence whose last block is partly filled and let the child write its
        next token there: certain to need a copy-on-write copy (in the op list, with a
        host tier)."""
        cands = [s for s in self._idle() if self.computed[s] % self.bs]
        self._fork_and_write(data.draw(st.sampled_from(cands)), token)

    def _fork_and_write(self, parent: int, token: int) -> None:
        child = self.next_id
        self.next_id += 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.ns[child] = self.ns[parent]
        self.prio[child] = self.prio.get(parent, DEFAULT_PRIORITY)
        self.computed[child] = self.computed[parent]
        self.allocated.add(child)
        self.m.commit(child, 0, [token])
        self.tokens[child].append(token)
        if self.m.allocate_slots(child, 1) is None:
            return
        self._copy_on_writes()
        self._after_allocate(child, 1, 0)
        self._write_reserved({child: (1, 0)})
        COVERAGE["ops"] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), reset=st.integers(0, 7))
    def free(self, data, reset):
        """Free a sequence; now and then try to reset the prefix cache (it succeeds only
        when no block is in use)."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._forget(sid)
        if reset == 0:
            COVERAGE["cache_reset"] += self.m.reset_prefix_cache()

    def _forget(self, sid: int) -> None:
        """Free the sequence in the manager and in the oracle's records."""
        self.m.free(sid)
        COVERAGE["ops"] += 1
        for d in (self.tokens, self.ns, self.prio, self.computed, self.pending):
            d.pop(sid, None)
        self.allocated.discard(sid)
        self.swapped.discard(sid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), priority=st.sampled_from(PRIORITIES))
    def prioritize(self, data, priority):
        """Change a held sequence's retention priority (running, waiting or swapped out):
        the blocks it commits or claims from now on are evicted in that order. Out of
        range is refused and changes nothing."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if not 0 <= priority <= 100:
            with pytest.raises(kvblocks.InvalidArgumentError):
                self.m.set_retention_priority(sid, priority)
            return
        self.m.set_retention_priority(sid, priority)
        self.prio[sid] = priority
        COVERAGE["ops"] += 1
        COVERAGE["retention_priority"] += 1

    def _one_off(
        self,
        blocks: int,
        priority: int | None,
        tokens: list[int] | None = None,
        keep: bool = False,
    ):
        """Prefill a prompt of ``blocks`` full blocks of fresh tokens (or ``tokens``) whole,
        at ``priority`` (set while it is live, before its blocks are committed), check
        every sequence's KV, commit it and free it (``keep``: leave it held): its blocks
        stay cached. Return the prompt and the cached tokens it claimed (``None``: not
        admitted)."""
        if tokens is None:
            tokens = [FLOOD_TOKEN + self.next_id, *range(12, 11 + blocks * self.bs)]
        sid = self.next_id
        self.next_id += 1
        self.m.add_sequence(sid, tokens)
        self.tokens[sid] = list(tokens)
        self.ns[sid] = (None, None)
        if priority is not None:
            self.m.set_retention_priority(sid, priority)
            self.prio[sid] = priority
        new = len(tokens) - self.m.num_computed_tokens(sid)
        if self.m.allocate_slots(sid, new) is None:
            self._forget(sid)
            return tokens, None
        self._copy_on_writes()
        self._after_allocate(sid, new, 0)
        hit = self.computed[sid]
        self._write_reserved({sid: (new, 0)})
        self.m.commit(sid, new)
        del self.pending[sid]
        self.computed[sid] += new
        self.every_sequence_reads_its_own_kv()
        if not keep:
            self._forget(sid)
        return tokens, hit

    # Without caching nothing is evicted: the rule would only take steps from the others.
    @precondition(lambda self: self.m.enable_prefix_caching)
    @rule(high=st.integers(DEFAULT_PRIORITY + 1, 100), low=st.integers(0, DEFAULT_PRIORITY - 1))
    def flood(self, high, low):
        """Memory pressure, certain to evict when prefix caching is on: a prompt ``A`` of
        half the free pool at a high priority, then two prompts ``B`` (low priority) and
        ``C`` over the rest, each computed, checked and freed (their blocks stay cached).
        ``C`` must evict cached blocks: the pool holds nothing else. Least recently used
        first would evict ``A`` (freed before ``B``); by priority ``B`` goes first, and
        ``A`` extended by a token then claims its whole prefix, whose KV the read
        check judges."""
        # Sized for the prompts' blocks in every group.
        free = self.m.num_free_blocks() // self.num_groups
        if free == 0:
            return
        # One operation of the budget, not one per prompt: the budget is for random ones.
        ops = COVERAGE["ops"]
        try:
            self._flood(free, high, low)
        finally:
            COVERAGE["ops"] = ops + 1

    def _flood(self, free: int, high: int, low: int) -> None:
        half = max(1, free // 2)
        a_tokens, a_hit = self._one_off(half, high)
        if a_hit is None:
            return
        rest = max(1, free - half)
        self._one_off(rest, low)
        self._one_off(rest, None)
        _, hit = self._one_off(0, None, tokens=[*a_tokens, 0])
        COVERAGE["flood"] += 1
        COVERAGE["priority_kept"] += hit == len(a_tokens)

    def _whole_hits(self) -> bool:
        """Whether a prompt whose every block some sequence holds must hit whole (not with
        a recurrent-state group: its hit ends on a checkpoint boundary)."""
        return True

    # Without caching nothing is duplicated in the cache.
    @precondition(lambda self: self.m.enable_prefix_caching)
    @rule(free_first=st.booleans())
    def duplicate(self, free_first):
        """Two sequences compute one prompt at once (neither can claim blocks the other has
        not committed), so every block of it is cached twice. One of them is freed
        (``free_first``: the one that committed first) and a prompt over the whole free
        pool evicts its copies. While the other holds its copies, the prompt extended by a
        token must hit whole, and the claimed blocks must hold its KV (the read check)."""
        free = self.m.num_free_blocks() // self.num_groups
        if free < 2:
            return
        ops = COVERAGE["ops"]
        try:
            self._duplicate(free // 2, free_first)
        finally:
            COVERAGE["ops"] = ops + 1

    def _duplicate(self, blocks: int, free_first: bool) -> None:
        tokens = [FLOOD_TOKEN + self.next_id, *range(12, 11 + blocks * self.bs)]
        pair = []
        for _ in range(2):
            sid = self.next_id
            self.next_id += 1
            self.m.add_sequence(sid, tokens)
            self.tokens[sid] = list(tokens)
            self.ns[sid] = (None, None)
            pair.append(sid)
        served: dict[int, tuple[int, int]] = {}
        for sid in pair:
            new = len(tokens) - self.m.num_computed_tokens(sid)
            if self.m.allocate_slots(sid, new) is None:
                for s in pair:
                    self._forget(s)
                return
            self._copy_on_writes()
            self._after_allocate(sid, new, 0)
            served[sid] = (new, 0)
        self._write_reserved(served)
        for sid, (new, _) in served.items():
            self.m.commit(sid, new)
            del self.pending[sid]
            self.computed[sid] += new
        self.every_sequence_reads_its_own_kv()
        gone, kept = pair if free_first else pair[::-1]
        self._forget(gone)
        self._one_off(self.m.num_free_blocks() // self.num_groups, None)
        _, hit = self._one_off(0, None, tokens=[*tokens, 0])
        COVERAGE["duplicate"] += 1
        if hit is not None and self._whole_hits():
            if hit != len(tokens):
                raise ContentError(
                    f"sequence {kept} holds every block of its prompt, yet the prompt hit "
                    f"{hit} of its {len(tokens)} tokens"
                )
            COVERAGE["duplicate_kept"] += 1
        self._forget(kept)

    @precondition(lambda self: len(self.mem.cpu) > 0 and self._idle())
    @rule(data=st.data())
    def swap_out(self, data):
        idle = self._idle()
        sids = data.draw(st.lists(st.sampled_from(idle), min_size=1, max_size=3, unique=True))
        if not self.m.can_swap_out(sids):
            with pytest.raises(kvblocks.OutOfBlocksError):
                self.m.swap_out(sids)
            return
        self.mem.swap_out(self.m.swap_out(sids))
        COVERAGE["ops"] += 1
        COVERAGE["swap_out"] += 1
        self.swapped.update(sids)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sids = data.draw(
            st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True)
        )
        try:
            rows = self.m.swap_in(sids)
        except kvblocks.OutOfBlocksError:
            return
        self.mem.swap_in(rows)
        COVERAGE["ops"] += 1
        COVERAGE["swap_in"] += 1
        self.swapped.difference_update(sids)

    @precondition(lambda self: any(s not in self.allocated for s in self.tokens))
    @rule()
    def refresh(self):
        self.m.refresh_prefixes([s for s in self.tokens if s not in self.allocated])
        COVERAGE["ops"] += 1

    @precondition(lambda self: self.row_of)
    @rule(data=st.data())
    def move_row(self, data):
        """Move a sequence to another row (a free one, or swap with another sequence)."""
        sid = data.draw(st.sampled_from(sorted(self.row_of)))
        others = sorted(self.row_of)
        if self.free_rows and data.draw(st.booleans()):
            new = self.free_rows.pop()
            self.free_rows.append(self.row_of[sid])
            self.row_of[sid] = new
        else:
            other = data.draw(st.sampled_from(others))
            self.row_of[sid], self.row_of[other] = self.row_of[other], self.row_of[sid]
        COVERAGE["ops"] += 1

    @precondition(lambda self: self.row_of)
    @rule(data=st.data(), steps=st.integers(1, 4))
    def lag(self, data, steps):
        """Leave a sequence out of the next few syncs (an unscheduled sequence)."""
        self.lagging[data.draw(st.sampled_from(sorted(self.row_of)))] = steps

    def _twin_sources(self) -> list[int]:
        """Sequences whose pending reservation completes a block it does not commit yet."""
        bs = self.bs
        return [
            p
            for p, new in self.pending.items()
            if p not in self.swapped and (self.computed[p] + new) // bs * bs > self.computed[p]
        ]

    @precondition(lambda self: self.m.enable_prefix_caching and self._twin_sources())
    @rule(data=st.data(), token=st.integers(0, 11))
    def add_twin(self, data, token):
        """A prompt arrives while its prefix is being computed: a waiting sequence with the
        tokens a pending reservation writes (and one more), probed at once, so blocks in
        flight are reported (and judged by what the memory holds) for certain."""
        p = data.draw(st.sampled_from(sorted(self._twin_sources())))
        tokens = [*self.tokens[p][: self.computed[p] + self.pending[p]], token]
        sid = self.next_id
        self.next_id += 1
        ns = self.ns[p]
        self.m.add_sequence(sid, tokens, cache_salt=ns[0], lora_id=ns[1])
        COVERAGE["ops"] += 1
        self.tokens[sid] = tokens
        self.ns[sid] = ns
        self.probe_in_flight()

    @precondition(lambda self: any(s not in self.allocated for s in self.tokens))
    @rule()
    def probe_in_flight(self):
        """Blocks reported in flight for a waiting sequence must hold, right now, the KV of
        that sequence's own tokens in the table of a sequence whose pending reservation
        wrote them and has not committed them: claimed after that commit, they are KV the
        waiting sequence can read."""
        waiting = [s for s in self.tokens if s not in self.allocated]
        got = self.m.probe_in_flight(waiting).tolist()
        COVERAGE["ops"] += 1
        bs = self.bs
        for sid, n in zip(waiting, got, strict=True):
            hit = self.m.num_computed_tokens(sid)
            assert n % bs == 0 and n >= 0, (sid, n)
            # Like the hit, never the prompt's last token.
            assert hit + n <= max(len(self.tokens[sid]) - 1, 0) // bs * bs, (sid, hit, n)
            want = self._expected(sid)
            for j in range(hit // bs, (hit + n) // bs):
                block_ids = want[j * bs : (j + 1) * bs]
                writers = [
                    p
                    for p, new in self.pending.items()
                    if p not in self.swapped
                    and self.computed[p] < (j + 1) * bs <= self.computed[p] + new
                    and self.mem.read(self._tables(p)[0], (j + 1) * bs)[j * bs :].tolist()
                    == block_ids
                ]
                if not writers:
                    raise ContentError(
                        f"sequence {sid}: block {j} reported in flight, but no pending "
                        f"reservation wrote its KV"
                    )
                COVERAGE["in_flight"] += 1

    # -- the check ---------------------------------------------------------------------------

    def _sync_table(self) -> list[int]:
        """Sync the resident sequences (all but the lagging ones) into their rows; return
        the synced ones. Rows of sequences that left the GPU go back to the allocator."""
        resident = self._resident()
        live = set(resident)
        for sid in [s for s in self.row_of if s not in live]:
            self.free_rows.append(self.row_of.pop(sid))
            self.lagging.pop(sid, None)
        full = False
        for sid in resident:
            if sid in self.row_of:
                continue
            if not self.free_rows:
                # A bigger buffer: the manager wrote none of it, so sync it whole.
                old = self.table.shape[1]
                self.table = np.zeros((self.num_groups, 2 * old, TABLE_WIDTH), dtype=np.int32)
                self.mirror = self.table.copy()
                self.free_rows = list(range(2 * old - 1, old - 1, -1))
                self.lagging.clear()
                full = True
            self.row_of[sid] = self.free_rows.pop()
        synced = [s for s in resident if self.lagging.get(s, 0) == 0]
        for sid in list(self.lagging):
            self.lagging[sid] -= 1
            if self.lagging[sid] <= 0:
                del self.lagging[sid]
        rows = [self.row_of[s] for s in synced]
        ids = np.array(synced, np.int64)
        if self.num_groups == 1:
            deltas = [self.m.update_block_table(self.table[0], ids, rows, full=full)]
        else:
            deltas = self.m.update_group_block_tables(self.table, ids, rows, full=full)
        assert len(deltas) == self.num_groups
        # The engine side: patch the mirror from the deltas alone.
        for g, delta in enumerate(deltas):
            assert len(delta.indptr) == len(delta) + 1
            for k in range(len(delta)):
                row = int(delta.rows[k])
                blocks = delta.block_ids[delta.indptr[k] : delta.indptr[k + 1]]
                start = int(delta.start_cols[k])
                if delta.reset[k]:
                    self.mirror[g, row] = 0
                    if self.row_last_owner.get(row, -1) not in (-1, synced[rows.index(row)]):
                        COVERAGE["table_row_reused"] += 1
                else:
                    COVERAGE["table_incremental"] += 1
                    # Copy-on-write, window releases and swap-ins rewrite entries in place.
                    COVERAGE["table_rewrite"] += start < self.row_len.get((g, row), 0)
                self.mirror[g, row, start : start + len(blocks)] = blocks
                self.row_len[(g, row)] = start + len(blocks)
        for s, r in zip(synced, rows, strict=True):
            self.row_last_owner[r] = s
        assert_array_equal(self.mirror, self.table)
        return synced

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        if not hasattr(self, "m"):
            return
        self.ops += 1
        synced = set(self._sync_table())
        for sid in self._resident():
            computed = self.m.num_computed_tokens(sid)
            assert computed == self.computed[sid], (sid, computed, self.computed[sid])
            tables = self._tables(sid)
            self._check_reads(sid, computed, tables)
            if sid in synced:
                # What the engine reads: the persistent rows, equal to the tables padded.
                rows = [self.table[g, self.row_of[sid]] for g in range(self.num_groups)]
                for row, table in zip(rows, tables, strict=True):
                    assert (row[: len(table)] == table).all() and not row[len(table) :].any()
                self._check_reads(sid, computed, rows)
            COVERAGE["window_release"] += any(bool((t == 0).any()) for t in tables)
        for sid in self.tokens:
            assert self.m.num_tokens(sid) == len(self.tokens[sid])
            assert self.m.retention_priority(sid) == self.prio.get(sid, DEFAULT_PRIORITY), sid

    @precondition(lambda self: hasattr(self, "m"))
    @invariant()
    def structure_holds(self):
        self.m.check_invariants()

    def teardown(self):
        if hasattr(self, "m"):
            COVERAGE["eviction"] += self.m.stats()["evictions"]


def _forced_flood() -> None:
    """One fixed example with prefix caching: a flood over a fresh pool (11 free blocks:
    ``A`` takes 5, ``B`` the 6 never used, ``C`` must evict 6 cached ones), whatever
    configurations the random examples drew."""
    machine = ContentOracle()
    machine.setup(
        num_blocks=12, block_size=2, num_cpu_blocks=0, caching=True, hash_algo="blake3", window=None
    )
    machine.flood(high=90, low=10)
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def _forced_duplicate() -> None:
    """One fixed example of the duplicate rule: two sequences compute one 10-token prompt
    at once, the first to commit is freed and a prompt over the free pool evicts its
    copies; the other's copies must keep the prompt a whole hit."""
    machine = ContentOracle()
    machine.setup(
        num_blocks=12, block_size=2, num_cpu_blocks=0, caching=True, hash_algo="blake3", window=None
    )
    machine.duplicate(free_first=True)
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def test_every_sequence_reads_its_own_kv() -> None:
    """At least ``MIN_OPERATIONS`` random operations, every content effect reached."""
    COVERAGE.clear()
    _forced_flood()
    _forced_duplicate()
    # Hypothesis decides how long each run is: repeat until the budget is spent.
    for attempt in range(10):
        run_state_machine_as_test(
            ContentOracle,
            settings=_oracle_settings(attempt=attempt),
        )
        if COVERAGE["ops"] >= MIN_OPERATIONS:
            break
    assert COVERAGE["ops"] >= MIN_OPERATIONS, COVERAGE
    reached = (
        "copy_on_write",
        "prefix_hit",
        "eviction",
        "swap_out",
        "swap_in",
        "fork",
        "lookahead",
        "partial_commit",
        "window_release",
        "cache_reset",
        "table_incremental",
        "table_rewrite",
        "table_row_reused",
        "in_flight",
        "retention_priority",
        "priority_kept",
        "duplicate_kept",
    )
    assert all(COVERAGE[what] > 0 for what in reached), COVERAGE


class _FaultyManager:
    """A real manager with one fault injected, for the oracle's own checks: it drops the
    copy-on-write copies (``"copy_on_write"``) or ignores retention priorities while
    reporting them as set (``"priority"``)."""

    def __init__(self, fault: str, *args: object, **kwargs: object) -> None:
        self._m = kvblocks.KVCacheManager(*args, **kwargs)  # the module name is patched
        self._fault = fault
        self._priority: dict[int, int] = {}

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):  # not set yet (or a protocol probe): not the manager's
            raise AttributeError(name)
        return getattr(self._m, name)

    def take_copy_on_writes(self):
        pairs = self._m.take_copy_on_writes()
        return pairs[:0] if self._fault == "copy_on_write" else pairs

    def set_retention_priority(self, seq_id: int, priority: int) -> None:
        if self._fault != "priority":
            self._m.set_retention_priority(seq_id, priority)
            return
        if not 0 <= priority <= 100:
            raise kvblocks.InvalidArgumentError(f"priority {priority} out of range")
        self._priority[seq_id] = priority

    def retention_priority(self, seq_id: int) -> int:
        if self._fault != "priority":
            return self._m.retention_priority(seq_id)
        return self._priority.get(seq_id, DEFAULT_PRIORITY)


def test_oracle_catches_dropped_copy_on_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager whose copy-on-write copies never happen fails the read check."""
    monkeypatch.setattr(
        sys.modules[__name__], "KVCacheManager", functools.partial(_FaultyManager, "copy_on_write")
    )
    with pytest.raises(ContentError):
        run_state_machine_as_test(
            ContentOracle,
            settings=_oracle_settings(database=None, phases=[Phase.generate]),
        )


def test_forced_flood_needs_priority_ordered_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed flood keeps its high-priority prefix on the real manager and loses it on
    one that evicts least recently used first, whatever the priorities: the coverage
    requirement ``priority_kept`` cannot be met by a manager that ignores them."""
    COVERAGE.clear()
    _forced_flood()
    assert COVERAGE["priority_kept"] == 1 and COVERAGE["eviction"] > 0, COVERAGE
    monkeypatch.setattr(
        sys.modules[__name__], "KVCacheManager", functools.partial(_FaultyManager, "priority")
    )
    COVERAGE.clear()
    _forced_flood()
    assert COVERAGE["priority_kept"] == 0 and COVERAGE["eviction"] > 0, COVERAGE


class TieredContentOracle(ContentOracle):
    """The same operations over a manager with a small host tier.

    Every block move goes through ``take_memory_ops`` (swaps and copies included, applied
    in issue order right after the call that queued them, before the step's writes), and
    the tier side is asynchronous: the emulated tier holds an offloaded block only once a
    ``confirm`` rule confirms the ops taken so far, and a load source may not be
    overwritten before then (see ``KVMemory.offload``/``load``). So a load of a slot whose
    offload is unconfirmed reads unwritten KV and fails the read check, and a slot
    overwritten under a load fails at once.
    """

    # A small GPU pool and small blocks: cached blocks get evicted (and offloaded) often.
    @initialize(
        num_blocks=st.integers(4, 14),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(2, 12),
        host_cache_blocks=st.integers(1, 24),
        host_offload=st.sampled_from(["evict", "evict", "commit"]),
        window=st.sampled_from([None, None, None, 8]),
    )
    def setup(
        self, num_blocks, block_size, num_cpu_blocks, host_cache_blocks, host_offload, window
    ):
        self.bs = block_size
        self.attention = [Attention(window=window)]
        self.m = KVCacheManager(
            num_blocks,
            block_size,
            num_cpu_blocks=num_cpu_blocks,
            watermark=0.0,
            sliding_window=window,
            record_events=False,
            host_cache_blocks=host_cache_blocks,
            host_offload=host_offload,
        )
        self.mem = KVMemory(num_blocks, num_cpu_blocks, block_size, host_cache_blocks)

    def _copy_on_writes(self) -> None:
        self._drain()

    def _drain(self) -> None:
        for kind, pairs in self.m.take_memory_ops():
            TIER_COVERAGE[kind] += len(pairs)
            self.mem.apply_memory_ops([(kind, pairs)])

    def _after_allocate(self, sid: int, new: int, lookahead: int) -> None:
        first = sid not in self.allocated
        super()._after_allocate(sid, new, lookahead)
        if first:
            tier = self.m.num_tier_tokens(sid)
            assert tier % self.bs == 0 and tier <= self.computed[sid], (sid, tier)
            TIER_COVERAGE["tier_hit"] += tier > 0
            # The loaded blocks (already applied by the drain) hold the prefix's KV.
            self._check_reads(sid, self.computed[sid])

    @precondition(lambda self: len(self.mem.cpu) > 0 and self._idle())
    @rule(data=st.data())
    def swap_out(self, data):
        idle = self._idle()
        sids = data.draw(st.lists(st.sampled_from(idle), min_size=1, max_size=3, unique=True))
        if not self.m.can_swap_out(sids):
            with pytest.raises(kvblocks.OutOfBlocksError):
                self.m.swap_out(sids)
            return
        self.m.swap_out(sids)
        self._drain()
        COVERAGE["ops"] += 1
        COVERAGE["swap_out"] += 1
        self.swapped.update(sids)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sids = data.draw(
            st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True)
        )
        try:
            self.m.swap_in(sids)
        except kvblocks.OutOfBlocksError:
            return
        self._drain()
        COVERAGE["ops"] += 1
        COVERAGE["swap_in"] += 1
        self.swapped.difference_update(sids)

    @rule(salt=st.integers(0, 3))
    def flood(self, salt):
        """A long one-off prompt fills every free block, is computed and freed: the free
        cached blocks are evicted (offloaded) on the way, as under memory pressure."""
        # Each group takes its blocks of the prompt (window groups fewer).
        n = self.m.num_free_blocks() // self.num_groups * self.bs
        if n == 0:
            return
        sid = self.next_id
        self.next_id += 1
        tokens = [12 + (sid * 5 + i * (salt + 1)) % 40 for i in range(n)]
        self.m.add_sequence(sid, tokens)
        self.tokens[sid] = tokens
        self.ns[sid] = (None, None)
        # Later prompts repeat it: hits on its blocks once they sit in the tier.
        self.floods = [*getattr(self, "floods", [])[-3:], list(tokens)]
        new = n - self.m.num_computed_tokens(sid)
        if self.m.allocate_slots(sid, new) is None:
            self.m.free(sid)
            del self.tokens[sid], self.ns[sid]
            return
        self._copy_on_writes()
        self._after_allocate(sid, new, 0)
        self._write_reserved({sid: (new, 0)})
        self.m.commit(sid, new)
        del self.pending[sid]
        self.computed[sid] += new
        self.every_sequence_reads_its_own_kv()
        self.m.free(sid)
        for d in (self.tokens, self.ns, self.computed):
            d.pop(sid, None)
        self.allocated.discard(sid)
        COVERAGE["ops"] += 1

    @precondition(lambda self: len(getattr(self, "floods", [])) > 1)
    @rule(data=st.data(), confirm=st.booleans())
    def add_flooded(self, data, confirm):
        """Add an earlier flood prompt again (its blocks evicted by a later flood: some
        sit in the tier), after a confirmation or not."""
        if confirm:
            self.confirm()
        tokens = data.draw(st.sampled_from(self.floods[:-1]))
        sid = self.next_id
        self.next_id += 1
        self.m.add_sequence(sid, tokens)
        self.tokens[sid] = list(tokens)
        self.ns[sid] = (None, None)
        COVERAGE["ops"] += 1
        # Admitted at once, as a scheduler would: the claim loads what the tier holds.
        new = len(tokens) - self.m.num_computed_tokens(sid)
        if self.m.allocate_slots(sid, new) is not None:
            self._copy_on_writes()
            self._after_allocate(sid, new, 0)
            self._write_reserved({sid: (new, 0)})

    @precondition(lambda self: getattr(self, "floods", []))
    @rule(data=st.data(), confirm=st.booleans())
    def import_from_remote(self, data, confirm):
        """A shared store holds a flood prompt's blocks (as another instance computed them):
        the blocks past the local hit are imported into reserved tier slots and written,
        then confirmed or not (an unconfirmed one must not be loaded by a claim)."""
        tokens = data.draw(st.sampled_from(self.floods))
        hashes = PromptHasher(self.bs).block_hashes(tokens)
        start = self.m.num_cached_prefix_blocks(hashes)
        count = data.draw(st.integers(1, max(1, len(hashes) - start)))
        if self.num_groups == 1:
            group = 0
            slots = self.m.import_tier_blocks(hashes[start : start + count])
        else:
            # A store keyed by group too: each group's blocks are that group's KV.
            group = data.draw(st.integers(0, self.num_groups - 1))
            slots = self.m.import_tier_blocks(hashes[start : start + count], group=group)
        ns = (None, None) if self.num_groups == 1 else ((None, None), group)
        ids = np.asarray(self.ids.ids(tokens, ns), dtype=np.int64)
        blocks = np.flatnonzero(slots >= 0)
        rows = [ids[(start + b) * self.bs : (start + b + 1) * self.bs] for b in blocks.tolist()]
        if rows:
            self.mem.import_blocks(slots[blocks], np.stack(rows))
        TIER_COVERAGE["import"] += len(rows)
        COVERAGE["ops"] += 1
        if confirm:
            self.confirm()

    @rule()
    def confirm(self):
        """The engine's asynchronous tier copies of the ops taken so far completed."""
        self.m.confirm_memory_ops()
        self.mem.confirm()
        COVERAGE["ops"] += 1

    @precondition(lambda self: hasattr(self, "m"))
    @invariant()
    def apply_left_ops(self):
        # Write-through offloads queued by a commit: the engine applies them before the
        # next step (the blocks are full and held, so nothing overwrites them meanwhile).
        self._drain()

    def teardown(self):
        if hasattr(self, "m"):
            s = self.m.stats()
            COVERAGE["eviction"] += s["evictions"]
            TIER_COVERAGE["tier_eviction"] += s["host_evictions"]


#: Host-tier effects reached by :class:`TieredContentOracle` (op kinds, hits, evictions).
TIER_COVERAGE: Counter[str] = Counter()


def _small_tiered_oracle(num_cpu_blocks: int) -> TieredContentOracle:
    """A host-tier oracle small enough for a fixed example: 12 GPU blocks of 2 tokens and
    a 4-block tier that offloads on eviction."""
    machine = TieredContentOracle()
    machine.setup(
        num_blocks=12,
        block_size=2,
        num_cpu_blocks=num_cpu_blocks,
        host_cache_blocks=4,
        host_offload="evict",
        window=None,
    )
    return machine


def _forced_copy_on_write() -> None:
    """One fixed example over a host tier certain to journal a copy-on-write copy: a
    prompt of one and a half blocks stays held, is forked, and the child writes its next
    token into the shared partial block (Hypothesis derandomizes under ``CI=true``, and
    the fixed draws need not reach it)."""
    machine = _small_tiered_oracle(num_cpu_blocks=2)
    before = TIER_COVERAGE["copy"]
    _, hit = machine._one_off(0, None, tokens=[12, 13, 14], keep=True)
    assert hit == 0, hit
    machine._fork_and_write(machine.next_id - 1, 5)
    assert TIER_COVERAGE["copy"] > before, TIER_COVERAGE
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def _forced_swap_in() -> None:
    """One fixed example over a host tier certain to journal a swap-in copy: a prompt of
    one and a half blocks is swapped out and back (its partial block is never cached, so
    it must come back from CPU memory). Under ``CI=true`` the derandomized draws need not
    reach one: since every copy of a hash stays cached, the swap-ins they draw may find
    their blocks still cached on the GPU."""
    machine = _small_tiered_oracle(num_cpu_blocks=4)
    before = TIER_COVERAGE["swap_in"]
    machine._one_off(0, None, tokens=[12, 13, 14], keep=True)
    sid = machine.next_id - 1
    machine.m.swap_out([sid])
    machine._drain()
    machine.m.swap_in([sid])
    machine._drain()
    assert TIER_COVERAGE["swap_in"] > before, TIER_COVERAGE
    machine.every_sequence_reads_its_own_kv()
    machine.structure_holds()
    machine.teardown()


def test_every_sequence_reads_its_own_kv_with_a_host_tier() -> None:
    """Random operations over a host tier: every sequence reads its own KV, every loaded
    block holds its prefix's KV, and offloads, loads, imports, tier hits and tier
    evictions are all reached."""
    COVERAGE.clear()
    TIER_COVERAGE.clear()
    _forced_copy_on_write()
    _forced_swap_in()
    budget = MIN_OPERATIONS // 2
    reached = (
        "offload",
        "load",
        "copy",
        "swap_out",
        "swap_in",
        "tier_hit",
        "tier_eviction",
        "import",
    )
    for attempt in range(10):
        run_state_machine_as_test(
            TieredContentOracle,
            settings=_oracle_settings(max_examples=ORACLE_EXAMPLES // 2, attempt=attempt),
        )
        if COVERAGE["ops"] >= budget and all(TIER_COVERAGE[what] > 0 for what in reached):
            break
    assert COVERAGE["ops"] >= budget, COVERAGE
    assert all(TIER_COVERAGE[what] > 0 for what in reached), TIER_COVERAGE
    assert COVERAGE["prefix_hit"] > 0 and COVERAGE["eviction"] > 0, COVERAGE
