"""The rules of the level (a) content oracle that reach, for certain, the effects random
draws reach only by luck (see :mod:`core.content_oracle`): ``fork_and_write`` writes into a
shared partial block (copy-on-write); ``flood`` runs one-off prompts over the whole free
pool, so with prefix caching on its cached blocks are evicted, and a high-priority prefix
must outlive a low-priority one that least-recently-used order alone would have kept;
``duplicate`` caches every block of a prompt twice and evicts one copy; ``add_twin`` adds a
prompt while a pending reservation computes its prefix (blocks in flight, judged by
``probe_in_flight``)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from oracle.kv_memory import ContentError, KVMemory

from .content_oracle_settings import COVERAGE, DEFAULT_PRIORITY, FLOOD_TOKEN, pick


class TargetedRules:
    """Rules and fixed-example helpers of :class:`core.content_oracle.ContentOracle`
    (mixed in before ``RuleBasedStateMachine``); they drive the manager through the
    machine's own helpers (``_after_allocate``, ``_write_reserved``, ``_forget``...)."""

    m: Any
    mem: KVMemory
    bs: int
    next_id: int
    tokens: dict[int, list[int]]
    ns: dict[int, tuple[str | None, int | None]]
    prio: dict[int, int]
    computed: dict[int, int]
    allocated: set[int]
    swapped: set[int]
    pending: dict[int, int]

    @precondition(
        lambda self: any(self.computed[s] % self.bs for s in self._idle() if s not in self.swapped)
    )
    @rule(data=st.data(), token=st.integers(0, 11))
    def fork_and_write(self, data, token):
        """Fork a sequence whose last block is partly filled and let the child write its
        next token there: certain to need a copy-on-write copy (in the op list, with a
        host tier)."""
        cands = [s for s in self._idle() if self.computed[s] % self.bs]
        self._fork_and_write(pick(data, cands), token)

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
        p = pick(data, sorted(self._twin_sources()))
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
