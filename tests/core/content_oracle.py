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
depends on the class's shape: ``test_content_oracle.py`` runs fixed such examples besides.

Budget: ``ORACLE_EXAMPLES * ORACLE_STEPS`` random operations per run (at least 10,000),
multiplied by the environment variable ``KVBLOCKS_ORACLE_SCALE`` for long runs.

Where the parts live: the budget, draws and coverage counters in
:mod:`core.content_oracle_settings`; the rules that reach effects for certain in
:mod:`core.content_oracle_targeted`; the persistent tables' rows and sync in
:mod:`core.content_oracle_table`; the host-tier machine in :mod:`core.content_oracle_tiered`.
The tests: ``test_content_oracle.py`` (and its fault checks),
``test_content_oracle_host_tier.py``, ``test_content_oracle_groups.py`` and
``test_content_oracle_state.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvblocks
from kvblocks import KVCacheManager
from oracle.kv_memory import (
    GARBAGE,
    Attention,
    ContentError,
    KVMemory,
    PrefixIds,
)

from .content_oracle_settings import (
    COVERAGE,
    DEFAULT_PRIORITY,
    NAMESPACES,
    PRIORITIES,
    STEMS,
    TABLE_WIDTH,
    pick,
)
from .content_oracle_table import BlockTableRows
from .content_oracle_targeted import TargetedRules


class ContentOracle(TargetedRules, BlockTableRows, RuleBasedStateMachine):
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
            seen, ns = pick(data, self.history)
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

    def _can_allocate(self) -> bool:
        """Whether some held sequence can be allocated (the allocate rules' precondition:
        without one, a step drawn for them did nothing and counted no operation)."""
        swapped, pending = self.swapped, self.pending
        return any(s not in swapped and s not in pending for s in self.tokens)

    @precondition(lambda self: self._can_allocate())
    @rule(data=st.data(), lookahead=st.sampled_from([0, 0, 1, 3, 8]))
    def allocate(self, data, lookahead):
        candidates = self._allocatable()
        sid = pick(data, candidates)
        computed = self.m.num_computed_tokens(sid)
        left = len(self.tokens[sid]) - computed
        new = data.draw(st.integers(0, left))
        got = self.m.allocate_slots(sid, new, num_lookahead_tokens=lookahead)
        if got is None:
            return
        self._copy_on_writes()
        self._after_allocate(sid, new, lookahead)
        self._write_reserved({sid: (new, lookahead)})

    @precondition(lambda self: self._can_allocate())
    @rule(data=st.data(), lookahead=st.sampled_from([0, 1, 4]))
    def allocate_batch(self, data, lookahead):
        candidates = self._allocatable()
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
        sid = pick(data, sorted(self.pending))
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
        parent = pick(data, sorted(self.tokens))
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

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), reset=st.integers(0, 7))
    def free(self, data, reset):
        """Free a sequence; now and then try to reset the prefix cache (it succeeds only
        when no block is in use)."""
        sid = pick(data, sorted(self.tokens))
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
        sid = pick(data, sorted(self.tokens))
        if not 0 <= priority <= 100:
            with pytest.raises(kvblocks.InvalidArgumentError):
                self.m.set_retention_priority(sid, priority)
            return
        self.m.set_retention_priority(sid, priority)
        self.prio[sid] = priority
        COVERAGE["ops"] += 1
        COVERAGE["retention_priority"] += 1

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

    # -- the check ---------------------------------------------------------------------------

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
                # What the engine reads: the persistent rows, which must be the tables
                # padded with null entries. Reading through them is then reading through
                # the tables, checked above (the reads depend only on the entries a
                # position maps to, and the null entries past a table map none).
                for g, table in enumerate(tables):
                    row = self.table[g, self.row_of[sid]]
                    assert (row[: len(table)] == table).all() and not row[len(table) :].any()
            COVERAGE["window_release"] += any(bool((t == 0).any()) for t in tables)
        for sid in self.tokens:
            assert self.m.num_tokens(sid) == len(self.tokens[sid])
            assert self.m.retention_priority(sid) == self.prio.get(sid, DEFAULT_PRIORITY), sid
        # One invariant, not two: Hypothesis' own work per invariant and step (its
        # precondition, timing, reporting) costs more than the check.
        self.structure_holds()

    def structure_holds(self):
        """The manager's own structural checks."""
        self.m.check_invariants()

    def teardown(self):
        if hasattr(self, "m"):
            COVERAGE["eviction"] += self.m.stats()["evictions"]
