"""KV-content oracle, level (b): the scheduler driven exactly like an engine.

Random configurations (policies, both preemption modes and auto, chunked prefill on/off,
lookahead slots, prefix caching, sliding windows, KV cache groups (mixes of full,
sliding-window and chunked-local groups over one pool), CPU pools, n > 1, beam search, stop
tokens, EOS, aborts before and during a step, single samples of ``n > 1`` requests ended
early with ``finish_sequence``) run against an emulated KV memory
(:mod:`oracle.kv_memory`). Every step the harness

1. applies ``SchedulerOutput.memory_ops`` in order (``KVMemory.apply_memory_ops``: copy
   pairs one after the other, as the interface document says they mean);
2. writes the KV id of every scheduled token through ``slot_mapping`` (and garbage into
   the lookahead slots of decodes), failing if two sequences write one slot;
3. reads every scheduled sequence's whole context back through its row of the engine's
   copy of the persistent block table (``block_table[block_table_rows[i]]``), a copy kept
   only by applying ``block_table_delta`` each step (rebuilt whole only when
   ``block_table_reallocated``), and its ``seq_lens`` entry, and compares it with the KV
   ids of that sequence's own tokens; that copy must equal the scheduler's rows, and the
   compatibility ``block_tables`` must equal them too. With KV cache groups, every group
   of every sequence is written through its row of ``group_slot_mappings`` and read
   through its own table (``group_block_table``, kept by ``group_block_table_deltas``)
   under the group's attention rule (the oracle's :class:`Attention`), each group's KV
   distinct from every other's; group 0 must be the single-group fields exactly; and
   every group's FlashInfer (pages in place, and without released ones) and
   FlashAttention page tables must make a kernel read exactly what the step's queries
   of that group may attend to (:mod:`oracle.page_table_reads`);
4. samples with the deterministic fake model and calls ``update``, collecting every
   record it returns: each sequence's ``new_token_ids`` over the steps must add up to its
   final ``token_ids``.

Every request must be rejected at ``add_request`` (with a message) or finish with a
reason, within a bounded number of steps; no completion may be cut short without a
reason that says so (``"length"`` means exactly ``max_tokens`` tokens).

``KVBLOCKS_ORACLE_SCALE`` (an integer, default 1) multiplies the number of
configurations (300 at scale 1) for long runs.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import numpy as np
import pytest
from sched_fake_model import fake_step, next_tokens

from kvblocks import GroupSpec, InvalidArgumentError, KVCacheManager
from kvblocks.scheduler import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from kvblocks.scheduler.stats import SchedulerCounters
from oracle.kv_memory import (
    GARBAGE,
    Attention,
    ContentError,
    KVMemory,
    PrefixIds,
    assert_array_equal,
)
from oracle.page_table_reads import check_step_exports

SCALE = int(os.environ.get("KVBLOCKS_ORACLE_SCALE", "1"))
NUM_BATCHES = 10
CONFIGS_PER_BATCH = 30 * SCALE  # 300 configurations per run at scale 1
MAX_STEPS = 3000
EOS = 7


class Config:
    """One random configuration: pool, scheduler limits and a workload."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.block_size = int(rng.choice([1, 2, 4, 8, 16]))
        # Mostly pools of 24-200 tokens (preemption without rejecting most prompts),
        # sometimes of a few blocks.
        tokens = int(rng.integers(24, 200)) if rng.random() < 0.8 else 0
        self.num_blocks = max(int(rng.integers(4, 12)), min(tokens // self.block_size + 2, 64))
        self.num_cpu_blocks = int(rng.choice([0, 0, 6, 24, 128]))
        self.caching = bool(rng.random() < 0.7)
        self.watermark = float(rng.choice([0.0, 0.0, 0.1]))
        self.window = int(rng.integers(3, 40)) if rng.random() < 0.15 else None
        self.sched = SchedulerConfig(
            max_num_batched_tokens=int(rng.integers(4, 96)),
            max_num_seqs=int(rng.integers(2, 24)),
            policy=str(rng.choice(["fcfs", "priority", "lpm"])),
            preemption_mode=[None, "recompute", "swap"][int(rng.integers(0, 3))],
            enable_chunked_prefill=bool(rng.random() < 0.5),
            num_lookahead_tokens=int(rng.choice([0, 0, 0, 1, 3])),
        )
        shared = rng.integers(1, 97, 40).tolist()
        salts = [None, None, "a", b"b"]
        self.arrivals: dict[int, list[Request]] = {}
        self.abort_at: dict[str, tuple[int, bool]] = {}  # rid -> (step, in flight)
        for i in range(int(rng.integers(1, 25))):
            body = rng.integers(1, 97, int(rng.integers(1, 24))).tolist()
            if rng.random() < 0.6:
                body = shared[: int(rng.integers(0, 40))] + body
            kind = int(rng.integers(0, 8))
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 40)),
                n=int(rng.integers(2, 5)) if kind in (0, 1) else 1,
                beam_width=int(rng.integers(2, 4)) if kind == 2 else 1,
                stop_token_ids=tuple(rng.integers(0, 97, int(rng.integers(1, 3))).tolist())
                if kind == 3
                else (),
                ignore_eos=bool(rng.random() < 0.5),
                seed=int(rng.integers(0, 100)) if rng.random() < 0.3 else None,
            )
            request = Request(
                f"r{i}",
                body,
                params,
                priority=int(rng.integers(0, 3)),
                cache_salt=salts[int(rng.integers(0, 4))],
                lora_id=int(rng.integers(1, 3)) if rng.random() < 0.15 else None,
                eos_token_id=EOS if rng.random() < 0.8 else None,
            )
            self.arrivals.setdefault(int(rng.integers(0, 40)), []).append(request)
            if rng.random() < 0.1:
                self.abort_at[request.request_id] = (
                    int(rng.integers(0, 80)),
                    bool(rng.random() < 0.5),
                )
        # Own generator: the configurations drawn above stay what they were.
        extra = np.random.default_rng(seed + 1_000_003)
        self.finish_seq_at: dict[str, tuple[int, int]] = {}  # rid -> (step, index)
        for requests in self.arrivals.values():
            for request in requests:
                params = request.sampling_params
                if params.n > 1 and not params.use_beam_search and extra.random() < 0.4:
                    self.finish_seq_at[request.request_id] = (
                        int(extra.integers(0, 60)),
                        int(extra.integers(0, params.n)),
                    )
        # A host tier below the GPU pool for a third of the caching configurations (its
        # own generator again).
        tier = np.random.default_rng(seed + 2_000_003)
        self.host_cache_blocks = (
            int(tier.integers(1, 24)) if self.caching and tier.random() < 0.33 else 0
        )
        self.host_offload = str(tier.choice(["evict", "commit"]))
        # With a tier: a bound on each step's loads (None, 0: never load, or a few blocks).
        if self.host_cache_blocks:
            bound = [None, 0, 1, 2, 4][int(tier.integers(0, 5))]
            self.sched = dataclasses.replace(self.sched, max_load_blocks_per_step=bound)
        # With prefix caching, retention priorities per request (None: the default) in
        # half the configurations: they order the GPU cache's eviction and the tier's.
        retention = np.random.default_rng(seed + 3_000_003)
        if self.caching and retention.random() < 0.5:
            for step, requests in self.arrivals.items():
                self.arrivals[step] = [
                    dataclasses.replace(
                        r,
                        retention_priority=None
                        if retention.random() < 0.3
                        else int(retention.integers(0, 101)),
                    )
                    for r in requests
                ]

        # KV cache groups (a hybrid model's layer kinds: full, sliding window, chunked
        # local; sizes that are and are not multiples of the block size) in a third of
        # the configurations without a single window (its own generator).
        kinds = np.random.default_rng(seed + 4_000_003)
        self.rules: list[Attention] = [Attention(window=self.window)]
        self.groups: list[GroupSpec] | None = None
        if self.window is None and kinds.random() < 0.35:
            self.rules, self.groups = [], []
            for _ in range(int(kinds.integers(1, 4))):
                kind = int(kinds.integers(0, 3))
                size = int(kinds.integers(2, 40))
                if kind == 0:
                    self.rules.append(Attention())
                    self.groups.append(GroupSpec.full_attention())
                elif kind == 1:
                    self.rules.append(Attention(window=size))
                    self.groups.append(GroupSpec.sliding_window(size))
                else:
                    self.rules.append(Attention(chunk=size))
                    self.groups.append(GroupSpec.chunked_local_attention(size))

    def manager(self) -> KVCacheManager:
        """A fresh block manager for this configuration."""
        return KVCacheManager(
            self.num_blocks,
            self.block_size,
            num_cpu_blocks=self.num_cpu_blocks,
            enable_prefix_caching=self.caching,
            watermark=self.watermark,
            sliding_window=self.window,
            groups=self.groups,
            record_events=False,
            host_cache_blocks=self.host_cache_blocks,
            host_offload=self.host_offload,
        )


def _namespace(request: Request) -> object:
    # The KV of a token depends on the cache salt and the LoRA adapter as well.
    return (request.cache_salt, request.lora_id)


class Harness:
    """Drives one scheduler like an engine over an emulated KV memory."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.mgr = cfg.manager()
        self.sched = Scheduler(self.mgr, cfg.sched, record_history=False)
        self.mem = KVMemory(
            cfg.num_blocks, cfg.num_cpu_blocks, cfg.block_size, cfg.host_cache_blocks
        )
        self.tier_ops: Counter[str] = Counter()
        self.group_reads: Counter[str] = Counter()
        self.export_reads: Counter[str] = Counter()
        self.prefix_ids = PrefixIds()
        self.requests: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self.aborted: set[str] = set()
        self.seq_finished: dict[tuple[str, int], list[int]] = {}  # by finish_sequence
        self.deltas: dict[tuple[str, int], list[int]] = {}
        # The engine's (device) copy of every group's persistent block table, patched by
        # the per-group deltas.
        self.table: np.ndarray | None = None
        # Holds (True) or not of requests whose prefix the step computes (coverage test).
        self.prefix_holds: Counter[bool] = Counter()
        self._should_hold = self.sched._admission.prefix_hold.should_hold
        self.sched._admission.prefix_hold.should_hold = self._count_hold  # type: ignore[method-assign]

    def _count_hold(self, request: object, cached: int, in_flight: int) -> bool:
        held = self._should_hold(request, cached, in_flight)
        self.prefix_holds[held] += in_flight > 0
        return held

    def sync_table(self, out) -> np.ndarray:
        """Bring the engine's copy of every group's table up to date from the step's
        per-group deltas alone; return the scheduled sequences' rows of it, ``[G, S, B]``.

        Group 0 is the single-group interface: ``block_table``, ``block_table_delta``,
        ``block_tables`` and ``slot_mapping`` must be exactly it.
        """
        groups = len(self.cfg.rules)
        assert out.num_groups == groups
        assert out.group_block_table.shape[0] == groups
        assert np.shares_memory(out.group_block_table[0], out.block_table)
        assert out.group_block_table_deltas[0] is out.block_table_delta
        assert len(out.group_block_table_deltas) == groups
        if out.block_table_reallocated or self.table is None:
            assert out.block_table_reallocated, "the first step must announce a new table"
            self.table = np.array(out.group_block_table, copy=True)
        else:
            assert self.table.shape == out.group_block_table.shape
            for g, d in enumerate(out.group_block_table_deltas):
                for k in range(len(d)):
                    row, start = int(d.rows[k]), int(d.start_cols[k])
                    ids = d.block_ids[d.indptr[k] : d.indptr[k + 1]]
                    if d.reset[k]:
                        self.table[g, row] = 0
                    self.table[g, row, start : start + len(ids)] = ids
        rows = out.block_table_rows
        assert len(rows) == out.num_seqs and len(set(rows.tolist())) == len(rows)
        mine = self.table[:, rows]
        assert_array_equal(mine, out.group_block_table[:, rows])
        legacy = out.block_tables
        assert_array_equal(legacy, mine[0, :, : legacy.shape[1]])
        assert not mine[0, :, legacy.shape[1] :].any()
        gathered = out.group_block_tables
        assert_array_equal(gathered, mine[:, :, : gathered.shape[2]])
        assert not mine[:, :, gathered.shape[2] :].any()
        assert_array_equal(out.group_slot_mappings[0], out.slot_mapping)
        assert out.group_slot_mappings.shape == (groups, out.num_tokens)
        return mine

    # -- one step -----------------------------------------------------------------------
    def apply_memory_ops(self, out) -> None:
        ops = out.memory_ops
        if not ops:
            for name in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
                assert len(getattr(out, name)) == 0, f"{name} has pairs but memory_ops is empty"
        for kind, pairs in ops:
            self.tier_ops[kind] += len(pairs)
        bound = self.cfg.sched.max_load_blocks_per_step
        loads = sum(len(pairs) for kind, pairs in ops if kind == "load")
        assert bound is None or loads <= bound, f"{loads} loads in a step bounded to {bound}"
        self.mem.apply_memory_ops(ops)

    def run_step(self, step: int) -> None:
        cfg, sched, mgr, mem = self.cfg, self.sched, self.mgr, self.mem
        out = sched.schedule()
        assert out.num_tokens <= cfg.sched.max_num_batched_tokens
        assert out.num_seqs <= cfg.sched.max_num_seqs
        self.apply_memory_ops(out)
        bs = cfg.block_size
        writes = []
        contexts = []
        exports = []
        qsl = out.query_start_loc
        tables = self.sync_table(out)
        for i, seq in enumerate(out.seq_ids.tolist()):
            request = sched._owner[seq].request
            tokens = mgr.token_ids(seq).tolist()
            seq_len = int(out.seq_lens[i])
            n = int(out.num_scheduled_tokens[i])
            assert n >= 1 and seq_len <= len(tokens), (seq, seq_len, len(tokens))
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            pos = out.positions[lo:hi]
            assert pos.tolist() == list(range(seq_len - n, seq_len)), (seq, pos, seq_len)
            assert out.input_token_ids[lo:hi].tolist() == tokens[seq_len - n : seq_len]
            # Each group's layers write their own KV (the group is part of the namespace)
            # into the group's blocks, through the group's slot mapping.
            for g, rule in enumerate(cfg.rules):
                ids = self.prefix_ids.ids(tokens[:seq_len], (_namespace(request), g))
                slots = out.group_slot_mappings[g, lo:hi]
                values = [ids[p] for p in pos.tolist()]
                table = tables[g, i]
                if i < out.num_decode_seqs and cfg.sched.num_lookahead_tokens:
                    # Draft tokens of a speculative step: the engine writes their KV too.
                    look = np.arange(seq_len, seq_len + cfg.sched.num_lookahead_tokens)
                    if (look // bs).max() >= len(table) or (table[look // bs] == 0).any():
                        raise ContentError(f"sequence {seq}: lookahead slots are not reserved")
                    slots = np.concatenate([slots, table[look // bs] * bs + look % bs])
                    values = values + [GARBAGE] * len(look)
                writes.append(((seq, g), slots, values))
                contexts.append(((seq, g), table, ids, seq_len, rule))
                exports.append(((seq, g), g, i, ids, rule))
        mem.write_step(writes)
        # What each group's FlashInfer / FlashAttention page tables make a kernel read,
        # where a table may have released entries to place or skip (a window, or groups;
        # the plain full-attention table's exports are read by tests/page_tables).
        if cfg.window is not None or cfg.groups is not None:
            check_step_exports(mem, out, exports, self.export_reads)
        for name, table, ids, seq_len, rule in contexts:
            mem.check(name, table, ids, seq_len, attention=rule)
            if cfg.groups is not None and len(cfg.groups) > 1:
                # Reads through a group's table with blocks it released (null entries).
                self.group_reads[
                    "released" if (table[: -(-seq_len // bs)] == 0).any() else "whole"
                ] += 1
        in_flight = [rid for rid, (at, fl) in self.cfg.abort_at.items() if at == step and fl]
        for rid in in_flight:
            self.abort(rid)
        # The step is computed: its asynchronous host-tier copies are complete (the
        # scheduler confirms them to the manager in update()).
        mem.confirm()
        records = sched.update(out, fake_step(out))
        for record in records:
            self.add_deltas(record)
        for result in records.finished:
            self.finish(result)
        mgr.check_invariants()
        # Only sequences on the GPU hold block-table rows (swapped or freed ones gave
        # theirs back).
        assert sched._block_table.num_held_rows() <= sched._num_live_seqs()

    # -- requests -----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        try:
            self.sched.add_request(request)
        except InvalidArgumentError as exc:
            assert str(exc), "a rejection must say why"
            self.rejected[request.request_id] = str(exc)
        else:
            self.requests[request.request_id] = request

    def abort(self, rid: str) -> None:
        result = self.sched.abort_request(rid)
        if result is not None:
            self.aborted.add(rid)
            self.add_deltas(result)  # the request's last record
            self.finish(result)

    def add_deltas(self, record: RequestOutput) -> None:
        for c in record.outputs:
            self.deltas.setdefault((record.request_id, c.index), []).extend(c.new_token_ids)

    def finish(self, result: RequestOutput) -> None:
        rid = result.request_id
        assert rid in self.requests and rid not in self.outputs, f"{rid} finished twice"
        self.outputs[rid] = result

    def run(self) -> None:
        cfg = self.cfg
        last_arrival = max(cfg.arrivals)
        for step in range(MAX_STEPS):
            for request in cfg.arrivals.get(step, []):
                self.add(request)
            for rid, (at, in_flight) in cfg.abort_at.items():
                if at == step and not in_flight:
                    self.abort(rid)
            for rid, (at, index) in cfg.finish_seq_at.items():
                # Tried every step from ``at`` until it applies (the request decodes with
                # other sequences) or the request has finished.
                if at <= step and (rid, index) not in self.seq_finished:
                    done = self.sched.finish_sequence(rid, index, FinishReason.ABORT)
                    if done is not None:
                        self.seq_finished[rid, index] = done.token_ids
            if self.sched.has_unfinished_requests():
                self.run_step(step)
            elif step > last_arrival:
                break
        else:
            raise AssertionError(f"no progress after {MAX_STEPS} steps (hang)")
        self.check_outputs()
        # Every block-table row came back (finished, aborted, preempted or swapped out).
        assert self.sched._block_table.num_held_rows() == 0, self.sched._block_table.num_held_rows()

    # -- end of run ---------------------------------------------------------------------
    def pool_is_full(self, request: Request, tokens: list[int]) -> bool:
        """Could the whole pool not hold this sequence one token longer?

        ``"length"`` short of ``max_tokens`` is the documented end of a sequence that
        alone needs more blocks than the pool has (minus the watermark, which applies
        when a preempted sequence is admitted again): the pool is its context limit.
        The sequences of an ``n > 1`` request are recomputed one by one, so each must
        have hit that limit on its own; the beams of a beam search run together, so
        together they must need more blocks than the pool has (counted with only the
        prompt's full blocks shared: an upper bound of what they hold).
        """
        cfg = self.cfg
        bs = cfg.block_size
        usable = cfg.num_blocks - 1 - int(np.floor(cfg.watermark * cfg.num_blocks))
        prompt = request.num_prompt_tokens
        # The step that could not be served computes at most the last token; a step of
        # one token at position p holds, in each group, the blocks from the first one its
        # query sees (a window group released the rest) to p + 1 + lookahead. A window
        # group's count is not monotone in p: the sequence cannot pass any position
        # whose step the pool cannot hold.
        params = request.sampling_params
        for p in range(prompt + len(tokens)):
            table_len = -(-(p + 1 + cfg.sched.num_lookahead_tokens) // bs)
            need = 0
            for rule in cfg.rules:
                gone = rule.first_visible(p) // bs
                held = table_len - gone
                if params.use_beam_search:
                    shared = max(prompt // bs - gone, 0)
                    held = shared + params.beam_width * (held - shared)
                need += held
            if need > usable:
                return True
        return False

    def check_outputs(self) -> None:
        mgr = self.mgr
        assert not self.sched.has_unfinished_requests()
        assert len(mgr) == 0 and mgr.num_free_blocks() == mgr.num_blocks - 1
        assert set(self.outputs) == set(self.requests), "a request never finished"
        for rid, result in self.outputs.items():
            request = self.requests[rid]
            params = request.sampling_params
            assert [c.index for c in result.outputs] == list(range(params.n)), (rid, result)
            prompt = request.prompt_token_ids.tolist()  # type: ignore[union-attr]
            assert result.prompt_token_ids == prompt, rid
            stops = set(params.stop_token_ids)
            eos = None if params.ignore_eos else request.eos_token_id
            for c in result.outputs:
                toks = c.token_ids
                assert c.finish_reason is not None
                assert len(toks) <= params.max_tokens
                # Streaming: the step records' deltas add up to the final tokens.
                assert self.deltas.get((rid, c.index), []) == toks, (rid, c.index)
                if (rid, c.index) in self.seq_finished:
                    assert c.finish_reason == FinishReason.ABORT
                    assert toks == self.seq_finished[rid, c.index], (rid, c.index)
                    continue
                if c.finish_reason == FinishReason.ABORT:
                    assert rid in self.aborted
                    continue
                if c.finish_reason == FinishReason.LENGTH:
                    assert len(toks) == params.max_tokens or self.pool_is_full(request, toks), (
                        f"{rid}[{c.index}]: {len(toks)} of {params.max_tokens} tokens "
                        "reported as 'length' (silently truncated)"
                    )
                elif c.finish_reason == FinishReason.STOP:
                    assert toks and toks[-1] in stops
                else:
                    assert c.finish_reason == FinishReason.EOS
                    assert toks and toks[-1] == eos
                if params.use_beam_search:
                    continue
                # Every token follows from the sequence's own content (fake model), and
                # no earlier token should have stopped it.
                assert not (set(toks[:-1]) & (stops | {eos})), f"{rid}: ran past a stop"
                last, pos = prompt[-1], len(prompt) - 1
                for k, tok in enumerate(toks):
                    want = int(next_tokens(np.int64(last), np.int64(pos), c.index if k == 0 else 0))
                    assert tok == want, f"{rid}[{c.index}] token {k}: {tok} != {want}"
                    last, pos = tok, pos + 1


@dataclasses.dataclass(frozen=True)
class Reached:
    """What one configuration's run reached, for the coverage tests below."""

    tier_ops: Counter[str]
    group_reads: Counter[str]
    export_reads: Counter[str]
    bounded_loads: bool
    counters: SchedulerCounters
    prefix_holds: Counter[bool]


#: By seed, what each run reached (the file runs on one worker): the coverage tests read
#: the content test's runs instead of running them again.
_REACHED: dict[int, Reached] = {}


def run_config(seed: int) -> Harness:
    """Run one configuration to the end; raise with the seed on any failure."""
    harness = h = Harness(Config(seed))
    try:
        harness.run()
    except (AssertionError, ContentError) as exc:
        raise AssertionError(f"configuration seed={seed}: {exc}") from exc
    bounded = harness.cfg.sched.max_load_blocks_per_step is not None
    _REACHED[seed] = Reached(
        h.tier_ops, h.group_reads, h.export_reads, bounded, h.sched.counters, h.prefix_holds
    )
    return harness


def reached(seed: int) -> Reached:
    """What configuration ``seed`` reached: its run's record, running it if none ran."""
    if seed not in _REACHED:
        run_config(seed)
    return _REACHED[seed]


@pytest.mark.parametrize("batch", range(NUM_BATCHES))
def test_scheduler_content_oracle(batch: int) -> None:
    """Every scheduled context reads back its own tokens' KV; every request ends."""
    for k in range(CONFIGS_PER_BATCH):
        run_config(batch * CONFIGS_PER_BATCH + k)


def test_the_oracle_reaches_host_tier_loads() -> None:
    """Configurations with a host tier offload and load blocks through
    ``SchedulerOutput.memory_ops``, so the runs above judge the tier by content."""
    seen: Counter[str] = Counter()
    for seed in range(2 * CONFIGS_PER_BATCH):
        seen.update(reached(seed).tier_ops)
    assert seen["offload"] > 0 and seen["load"] > 0, seen


def test_the_oracle_reaches_bounded_loads() -> None:
    """Configurations with ``max_load_blocks_per_step`` load under the bound and compute
    blocks instead of loading them (a request's loads over the whole bound), so the runs
    above judge both by content and check every step's loads against the bound. (A
    request deferred to a later step moves no data; its workload, two requests loading
    different prefixes in one step, is rare here and is in tests/scheduler/test_tier_loads.py.)"""
    seen: Counter[str] = Counter()
    for seed in range(2 * CONFIGS_PER_BATCH):
        run = reached(seed)
        if run.bounded_loads:
            counters = run.counters
            seen["bounded_loads"] += counters.num_load_blocks
            seen["recomputed"] += counters.num_loads_recomputed
    assert all(seen[k] > 0 for k in ("bounded_loads", "recomputed")), seen


def test_the_oracle_reaches_same_step_prefix_holds() -> None:
    """Requests held back for a prefix computed in the same step (then claimed from the
    cache) occur in the oracle's workloads, so the runs above judge them by content (the
    harness counts the scheduler's hold decisions, ``Harness.prefix_holds``)."""
    holds: Counter[bool] = Counter()
    for seed in range(CONFIGS_PER_BATCH):
        holds.update(reached(seed).prefix_holds)
    assert holds[True] > 0, holds


def test_the_oracle_reaches_overdue_requests() -> None:
    """Requests that waited ``max_wait_steps`` and were admitted ahead of the policy's
    order occur in the oracle's workloads, so the runs above judge them by content."""
    overdue = sum(reached(seed).counters.num_requests_overdue for seed in range(CONFIGS_PER_BATCH))
    assert overdue > 0


def test_the_oracle_reaches_groups() -> None:
    """Configurations with several KV cache groups read through window or chunked
    groups' tables with released blocks and are preempted, so the runs above judge the
    per-group output by content."""
    seen: Counter[str] = Counter()
    for seed in range(2 * CONFIGS_PER_BATCH):
        run = reached(seed)
        seen.update(run.group_reads)
        seen.update(run.export_reads)
        if run.group_reads:
            seen["preempted"] += run.counters.num_preemptions_recompute
            seen["swapped"] += run.counters.num_preemptions_swap
    assert all(seen[k] > 0 for k in ("released", "whole", "preempted", "swapped", "skipped")), seen
