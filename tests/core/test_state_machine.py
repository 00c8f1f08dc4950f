"""Model-based test: the Rust manager and the pure-Python reference side by side.

A hypothesis ``RuleBasedStateMachine`` applies the same random operations (add, allocate,
commit, decode steps, fork, free, swap out/in, batch calls, prefix hits under eviction
pressure, reset) to both, and after every step compares everything observable: return
values, raised error classes, block tables, CoW pairs, swap mappings, free-queue order,
stats and events (hashes matched through a bijection, since the two hash differently),
then runs ``check_invariants`` on both. Pools are tiny so that eviction, ``None`` from
``allocate_slots`` and ``OutOfBlocksError`` from swaps happen often.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvblocks
from oracle.reference_manager import ReferenceKVCacheManager

from .core_state import snapshot

# Ids are mostly drawn from the held sequences (see ``pick``), sometimes from this range.
ANY_SEQ_ID = st.integers(0, 9)
# A few shared prompt heads so that prefixes hit the cache; tokens from a tiny vocabulary.
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]
SALTS = st.sampled_from([None, None, b"", b"tenant-a", "tenant-a"])
LORAS = st.sampled_from([None, None, 0, 3])


def _normalise(value: Any) -> Any:
    """Comparable form of a return value (arrays as dtype + nested lists)."""
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tolist())
    if isinstance(value, kvblocks.AllocStatus):
        return int(value)
    if hasattr(value, "block_indptr"):  # BatchAllocation / RefBatchAllocation
        fields = ("num_served", "num_cached_tokens", "block_ids", "block_indptr")
        return tuple(_normalise(getattr(value, f)) for f in fields)
    return value


class ManagerComparison(RuleBasedStateMachine):
    """Drive ``KVCacheManager`` and ``ReferenceKVCacheManager`` with the same calls."""

    def __init__(self) -> None:
        super().__init__()
        self.rust: Any = None
        self.ref: Any = None
        # Rust digest -> reference digest, and back: event hashes must correspond 1:1.
        self.hash_map: dict[bytes, bytes] = {}
        self.hash_map_back: dict[bytes, bytes] = {}
        self.next_token = 100

    @initialize(
        num_blocks=st.integers(2, 14),
        block_size=st.sampled_from([1, 2, 4]),
        num_cpu_blocks=st.integers(0, 12),
        caching=st.sampled_from([True, True, True, False]),
        sliding_window=st.sampled_from([None, None, None, 3, 6]),
        watermark=st.sampled_from([0.0, 0.0, 0.1, 0.3]),
        hash_algo=st.sampled_from(["blake3", "xxh3_128"]),
        record_events=st.sampled_from([True, True, True, False]),
    )
    def build(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int,
        caching: bool,
        sliding_window: int | None,
        watermark: float,
        hash_algo: str,
        record_events: bool,
    ) -> None:
        kwargs = {
            "record_events": record_events,
            "num_cpu_blocks": num_cpu_blocks,
            "enable_prefix_caching": caching,
            "sliding_window": sliding_window,
            "watermark": watermark,
            "hash_algo": hash_algo,
        }
        self.rust = kvblocks.KVCacheManager(num_blocks, block_size, **kwargs)
        self.ref = ReferenceKVCacheManager(num_blocks, block_size, **kwargs)
        self.all_ids = list(range(10))

    # -- the comparison core -------------------------------------------------------
    def both(self, call: Any) -> Any:
        """Apply ``call`` to both managers; results or error classes must agree."""
        outcomes = []
        for m in (self.rust, self.ref):
            try:
                outcomes.append(("ok", _normalise(call(m))))
            except kvblocks.KVBlocksError as e:
                outcomes.append(("error", type(e).__name__))
        assert outcomes[0] == outcomes[1], f"rust {outcomes[0]} != reference {outcomes[1]}"
        if outcomes[0] == ("ok", None) and "allocate_slots" in call.__code__.co_names:
            event("allocate_slots returned None")
        if outcomes[0][0] == "error":
            event(f"raised {outcomes[0][1]}")
        return outcomes[0]

    def _match_hash(self, rust_hash: bytes | None, ref_hash: bytes | None) -> None:
        assert (rust_hash is None) == (ref_hash is None)
        if rust_hash is None or ref_hash is None:
            return
        assert self.hash_map.setdefault(rust_hash, ref_hash) == ref_hash
        assert self.hash_map_back.setdefault(ref_hash, rust_hash) == rust_hash

    def _fresh_token(self) -> int:
        self.next_token += 1
        return self.next_token % 50 + 100

    def pick(self, data: st.DataObject) -> int:
        """A sequence id: usually a held one, sometimes any (unknown ids hit error paths)."""
        held = self.rust.seq_ids().tolist() if self.rust is not None else []
        if held and data.draw(st.integers(0, 9), label="held?") > 0:
            return data.draw(st.sampled_from(held), label="seq_id")
        return data.draw(ANY_SEQ_ID, label="seq_id")

    def pick_many(self, data: st.DataObject, min_size: int = 0, max_size: int = 4) -> list[int]:
        """Several ids (repeats possible: batch calls must reject them)."""
        n = data.draw(st.integers(min_size, max_size), label="batch size")
        return [self.pick(data) for _ in range(n)]

    def _counts(self, seq_id: int) -> tuple[int, int] | None:
        """(computed, known) of a resident sequence, or None."""
        if seq_id not in self.rust or self.rust.is_swapped(seq_id):
            return None
        return self.rust.num_computed_tokens(seq_id), self.rust.num_tokens(seq_id)

    # -- sequences -------------------------------------------------------------------
    def _add(self, data: st.DataObject) -> None:
        seq_id = data.draw(ANY_SEQ_ID, label="new seq_id")
        head = data.draw(st.sampled_from(HEADS), label="head")
        tokens: Any = head[: data.draw(st.integers(0, len(head)))] + data.draw(
            st.lists(st.integers(0, 3), max_size=6), label="tail"
        )
        if data.draw(st.booleans(), label="as array"):
            tokens = np.array(
                tokens, dtype=data.draw(st.sampled_from(["int32", "int64", "uint32"]))
            )
        salt = data.draw(SALTS, label="salt")
        lora = data.draw(LORAS, label="lora")
        self.both(lambda m: m.add_sequence(seq_id, tokens, cache_salt=salt, lora_id=lora))

    @rule(data=st.data())
    def add_sequence(self, data: st.DataObject) -> None:
        self._add(data)

    @rule(data=st.data())
    def add_another_sequence(self, data: st.DataObject) -> None:
        self._add(data)

    @rule(data=st.data(), lookahead=st.sampled_from([0, 0, 1, 3]))
    def can_allocate(self, data: st.DataObject, lookahead: int) -> None:
        seq_id = self.pick(data)
        self.both(lambda m: m.can_allocate(seq_id, num_lookahead_tokens=lookahead))

    @rule(data=st.data(), extra=st.integers(-1, 2), lookahead=st.sampled_from([0, 0, 2]))
    def allocate(self, data: st.DataObject, extra: int, lookahead: int) -> None:
        """Allocate for the whole uncomputed part (or a bit less/more: invalid counts too)."""
        seq_id = self.pick(data)
        counts = self._counts(seq_id)
        new = max(0, counts[1] - counts[0] + extra) if counts else 1
        self.both(lambda m: m.allocate_slots(seq_id, new, num_lookahead_tokens=lookahead))

    @rule(data=st.data(), chunk=st.integers(0, 5))
    def allocate_chunk(self, data: st.DataObject, chunk: int) -> None:
        """A chunked-prefill step: up to ``chunk`` of the uncomputed tokens."""
        seq_id = self.pick(data)
        counts = self._counts(seq_id)
        new = min(chunk, counts[1] - counts[0]) if counts else chunk
        self.both(lambda m: m.allocate_slots(seq_id, new))

    @rule(data=st.data(), short=st.integers(0, 2), sample=st.booleans())
    def commit(self, data: st.DataObject, short: int, sample: bool) -> None:
        """Commit what was reserved (minus ``short``), optionally with a sampled token."""
        seq_id = self.pick(data)
        counts = self._counts(seq_id)
        n = max(0, counts[1] - counts[0] - short) if counts else 0
        tokens = [self._fresh_token()] if sample else []
        self.both(lambda m: m.commit(seq_id, n, tokens))

    @rule(data=st.data(), n=st.integers(0, 6))
    def commit_raw(self, data: st.DataObject, n: int) -> None:
        """Arbitrary counts: exercises the commit limit checks."""
        seq_id = self.pick(data)
        self.both(lambda m: m.commit(seq_id, n))

    def _step(self, seq_id: int) -> None:
        counts = self._counts(seq_id)
        if counts is None:
            return
        new = counts[1] - counts[0]
        outcome = self.both(lambda m: m.allocate_slots(seq_id, new))
        if outcome[0] == "ok" and outcome[1] is not None:
            token = self._fresh_token()
            self.both(lambda m: m.commit(seq_id, new, [token]))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A full engine round: allocate the uncomputed tokens, then commit them + 1 token."""
        self._step(self.pick(data))

    @rule(data=st.data())
    def step_again(self, data: st.DataObject) -> None:
        self._step(self.pick(data))

    @rule(data=st.data(), lookahead=st.sampled_from([0, 1]))
    def decode_batch(self, data: st.DataObject, lookahead: int) -> None:
        """Batch round: allocate_slots_batch over the uncomputed parts, commit the served."""
        ids = self.pick_many(data)
        news = []
        for sid in ids:
            counts = self._counts(sid)
            news.append(counts[1] - counts[0] if counts else 1)
        arr = np.array(ids, dtype=np.int64)
        outcome = self.both(
            lambda m: m.allocate_slots_batch(arr, np.array(news), num_lookahead_tokens=lookahead)
        )
        if outcome[0] != "ok":
            return
        served = outcome[1][0]
        self.both(lambda m: m.block_tables(arr[:served]))
        self.both(lambda m: m.slot_mapping(arr[:served]))
        tokens = np.array([self._fresh_token() for _ in range(served)], dtype=np.int64)
        if served:
            tokens[0] = -1  # "no token" for one of them
        self.both(lambda m: m.commit_batch(arr[:served], np.array(news[:served]), tokens))

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data)
        child = data.draw(ANY_SEQ_ID, label="child")
        self.both(lambda m: m.fork(parent, child))

    def _new_id(self, data: st.DataObject) -> int | None:
        unused = [i for i in self.all_ids if i not in self.rust]
        return data.draw(st.sampled_from(unused), label="new id") if unused else None

    @rule(data=st.data())
    def fork_and_step(self, data: st.DataObject) -> None:
        """Parallel sampling: fork a committed sequence, then both append their own token."""
        parent = self.pick(data)
        child = self._new_id(data)
        if child is None:
            return
        if self.both(lambda m: m.fork(parent, child))[0] == "ok":
            self._step(child)
            self._step(parent)

    @rule(data=st.data())
    def free_and_readd(self, data: st.DataObject) -> None:
        """Free a sequence and add its tokens again under a new id: a prefix-cache hit."""
        old = self.pick(data)
        if old not in self.rust:
            return
        tokens = self.rust.token_ids(old)
        self.both(lambda m: m.free(old))
        new = self._new_id(data)
        if new is not None:
            self.both(lambda m: m.add_sequence(new, tokens))
            self._step(new)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        self.both(lambda m: m.free(seq_id))

    # -- swap ------------------------------------------------------------------------
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        ids = self.pick_many(data, 1, 3)
        self.both(lambda m: m.can_swap_out(ids))
        self.both(lambda m: m.swap_out(ids))

    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        ids = self.pick_many(data, 1, 3)
        self.both(lambda m: m.can_swap_in(ids))
        self.both(lambda m: m.swap_in(ids))

    @rule(data=st.data())
    def preempt_by_swap(self, data: st.DataObject) -> None:
        """Scheduler-style preemption: end the round (commit 0), then swap out."""
        seq_id = self.pick(data)
        self.both(lambda m: m.commit(seq_id, 0))
        self.both(lambda m: m.swap_out([seq_id]))

    @rule()
    def resume_swapped(self) -> None:
        """Swap every swapped sequence back in, in id order."""
        swapped = [s for s in self.rust.seq_ids().tolist() if self.rust.is_swapped(s)]
        if swapped:
            self.both(lambda m: m.swap_in(swapped))

    @rule(data=st.data())
    def fill_pool(self, data: st.DataObject) -> None:
        """A long fresh prompt under memory pressure: evicts cached blocks or gets None."""
        seq_id = self._new_id(data)
        if seq_id is None:
            return
        length = data.draw(st.integers(4, 40), label="long prompt length")
        tokens = [200 + (seq_id + i) % 7 for i in range(length)]
        self.both(lambda m: m.add_sequence(seq_id, tokens))
        self._step(seq_id)

    # -- reads and cache -------------------------------------------------------------
    @rule(data=st.data(), max_extra=st.sampled_from([None, 0, 3]))
    def read_step_inputs(self, data: st.DataObject, max_extra: int | None) -> None:
        ids = self.pick_many(data)
        self.both(lambda m: m.probe_prefixes(ids))
        outcome = self.both(lambda m: m.block_tables(ids))
        if outcome[0] == "ok" and max_extra is not None:
            width = outcome[1][1][1]
            self.both(lambda m: m.block_tables(ids, max_blocks=max(width + max_extra - 1, 0)))
        self.both(lambda m: m.slot_mapping(ids))
        self.both(lambda m: m.slot_mapping(ids, 1 if ids else []))

    @rule(data=st.data())
    def refresh_prefixes(self, data: st.DataObject) -> None:
        """Re-probe waiting sequences (errors for allocated, swapped or unknown ids)."""
        ids = self.pick_many(data)
        self.both(lambda m: m.refresh_prefixes(ids))

    @rule(data=st.data())
    def probe_in_flight(self, data: st.DataObject) -> None:
        """Prefix blocks pending reservations fill: every held sequence one by one (waiting
        ones answer, others raise), then a random batch."""
        for sid in self.rust.seq_ids().tolist() if self.rust is not None else []:
            outcome = self.both(lambda m, sid=sid: m.probe_in_flight([sid]))
            if outcome[0] == "ok" and outcome[1][2][0] > 0:
                event("probe_in_flight found blocks in flight")
        ids = self.pick_many(data)
        self.both(lambda m: m.probe_in_flight(ids))

    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit_together(self, data: st.DataObject, chunk: int) -> None:
        """Two requests with one prompt admitted in one step: the first one's reservation
        puts the prompt's blocks in flight for the second (until the first commits)."""
        held = set(self.rust.seq_ids().tolist()) if self.rust is not None else set()
        free_ids = [s for s in range(10) if s not in held]
        if len(free_ids) < 2:
            return
        first, second = data.draw(st.permutations(free_ids), label="ids")[:2]
        head = data.draw(st.sampled_from(HEADS), label="head")
        tokens = head + data.draw(st.lists(st.integers(0, 3), max_size=6), label="tail")
        for sid in (first, second):
            self.both(lambda m, sid=sid: m.add_sequence(sid, tokens))
        computed, known = self._counts(first) or (0, 0)
        self.both(lambda m: m.allocate_slots(first, min(chunk, known - computed)))
        outcome = self.both(lambda m: m.probe_in_flight([second, second]))
        if outcome[0] == "ok" and outcome[1][2][0] > 0:
            event("probe_in_flight found blocks in flight")

    @rule(really=st.integers(0, 3))
    def reset_prefix_cache(self, really: int) -> None:
        if really == 0:
            self.both(lambda m: m.reset_prefix_cache())

    @rule()
    def copy_on_writes(self) -> None:
        self.both(lambda m: m.take_copy_on_writes())

    # -- after every step --------------------------------------------------------------
    @invariant()
    def same_state(self) -> None:
        if self.rust is None:
            return
        self.rust.check_invariants()
        self.ref.check_invariants()
        rust_events = self.rust.take_events()
        ref_events = self.ref.take_events()
        assert [type(e).__name__ for e in rust_events] == [
            type(e).__name__.removeprefix("Ref") for e in ref_events
        ]
        for a, b in zip(rust_events, ref_events, strict=True):
            if isinstance(a, kvblocks.BlockStored):
                assert (a.token_ids, a.block_size, a.lora_id) == (
                    b.token_ids,
                    b.block_size,
                    b.lora_id,
                )
                self._match_hash(a.parent_block_hash, b.parent_block_hash)
            if not isinstance(a, kvblocks.AllBlocksCleared):
                assert len(a.block_hashes) == len(b.block_hashes)
                for ha, hb in zip(a.block_hashes, b.block_hashes, strict=True):
                    self._match_hash(ha, hb)
        assert snapshot(self.rust) == snapshot(self.ref)
        stats = self.rust.stats()
        for key in ("evictions", "cow_copies", "blocks_swapped_out", "prefix_cache_hits"):
            if stats[key]:
                event(f"{key} > 0")
        if any(isinstance(e, kvblocks.BlockStored) for e in rust_events):
            event("blocks stored")


ManagerComparison.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerComparison = ManagerComparison.TestCase
