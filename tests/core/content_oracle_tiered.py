"""The level (a) content oracle over a manager with a small host tier (see
:class:`TieredContentOracle`)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import kvblocks
from kvblocks import KVCacheManager
from kvblocks.router import PromptHasher
from oracle.kv_memory import Attention, KVMemory

from .content_oracle import ContentOracle
from .content_oracle_settings import COVERAGE, pick

#: Host-tier effects reached by :class:`TieredContentOracle` (op kinds, hits, evictions).
TIER_COVERAGE: Counter[str] = Counter()


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
        tokens = pick(data, self.floods[:-1])
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
        tokens = pick(data, self.floods)
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
