"""A fleet of instances behind a router, on the simulated clock.

Each instance is a real :class:`Scheduler` + :class:`KVCacheManager` (events on); the
router sees each instance's KV events (drained after every step, as
:mod:`kvblocks.router.events` records) and its load, and routes every arriving request,
a multi-turn conversation's follow-ups included, to one instance.

Time is event-driven: instances step independently, each step lasting the
:class:`CostModel` time of its batch. What a step changes (KV events, load, finished
requests) becomes visible to the router when the step *ends*; requests routed while an
instance is mid-step join it at its next step. At equal times, step ends are handled
before arrivals, and arrivals before step starts.

Fleet metrics:

- **prefix hit rate**: prompt tokens served from an instance's prefix cache at
  admission over prompt tokens admitted, summed over the fleet;
- **TTFT / TPOT / latency**: as in :mod:`kvblocks.simulate.metrics`;
- **throughput**: requests finished per simulated second between the 10% and 90%
  completion marks (no ramp-up, no drain), and output tokens per simulated second over
  the whole run. With ``request_rate=inf`` (every conversation starts at t=0, later
  turns closed-loop) the fleet is saturated and this is its capacity; at a rate the fleet
  sustains, it is just the arrival rate.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from kvblocks._core import KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.router import (
    ROUTERS,
    InstanceLoad,
    PromptHasher,
    Router,
    make_router,
    records_from_manager,
)
from kvblocks.router.events import EventRecord
from kvblocks.scheduler import Scheduler, SchedulerConfig
from kvblocks.simulate.config import check_parts
from kvblocks.simulate.cost_model import CostModel
from kvblocks.simulate.fleet_remote import RemoteTotals, SharedRemoteTier
from kvblocks.simulate.metrics import RequestMetrics
from kvblocks.simulate.runner import (
    SimulationError,
    TierTotals,
    _fake_model,
    _progress_bar,
    request_for,
)
from kvblocks.simulate.workload import (
    ArrivalQueue,
    SimRequest,
    WorkloadConfig,
    count_conversations,
)
from kvblocks.validation import check_bool, check_int, check_number, check_optional_int

__all__ = ["FleetConfig", "FleetResult", "run_fleet"]


@dataclass(frozen=True)
class FleetConfig:
    """A fleet simulation: ``num_instances`` identical instances behind ``router``.

    Attributes:
        workload: the trace (shared by the whole fleet).
        num_instances: instances behind the router.
        router: ``"round-robin"``, ``"least-loaded"`` or ``"cache-aware"``.
        scheduler, num_blocks, block_size, num_cpu_blocks, enable_prefix_caching,
            hash_algo: each instance's scheduler and block manager.
        host_cache_blocks, host_offload: each instance's host tier (0: none), as in
            :class:`~kvblocks.simulate.SimulationConfig`; the cost model charges its
            loads and offloads.
        remote_tier_blocks: a remote tier of this many blocks shared by every instance
            (0: none; needs a host tier), as one Valkey below their host tiers: each
            offloaded block is written to it, and a routed request's blocks past what its
            instance holds are imported from it (:mod:`kvblocks.simulate.fleet_remote`).
        remote_fetch_wait_s: a request whose read would take longer goes ahead without
            it and computes its blocks (the engine's ``RemoteTierOptions.fetch_wait_s``).
        remote_max_pending_write_blocks: blocks an instance's write-back queue holds at
            most; a write that does not fit is dropped (the engine's
            ``RemoteTierOptions.max_pending_write_blocks``).
        cost_model: simulated step time of each instance; a request with blocks to read
            from the remote tier joins its instance once they crossed the network at
            ``remote_bandwidth_bytes_per_s``, the store's link, which carries the whole
            fleet's reads and writes one at a time.
        max_concurrency: at most this many conversations in progress at once, as a pool
            of closed-loop clients (a benchmark's ``--num-clients``): a conversation due
            while the pool is full starts when one ends, and its arrival time is then.
            ``None``: no limit.
        follow_ups_first: queue a conversation's later turns ahead of conversations that
            have not started (as :class:`~kvblocks.simulate.SimulationConfig`).
        progress: tqdm bar on stderr.
    """

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    num_instances: int = 8
    router: str = "cache-aware"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int = 4096
    block_size: int = 16
    num_cpu_blocks: int = 1024
    enable_prefix_caching: bool = True
    hash_algo: str = "blake3"
    host_cache_blocks: int = 0
    host_offload: str = "evict"
    remote_tier_blocks: int = 0
    remote_fetch_wait_s: float = 1.0
    remote_max_pending_write_blocks: int = 256
    cost_model: CostModel = field(default_factory=CostModel)
    max_concurrency: int | None = None
    follow_ups_first: bool = True
    progress: bool = False

    def __post_init__(self) -> None:
        check_parts(self)
        for name in (
            "num_instances",
            "num_blocks",
            "remote_max_pending_write_blocks",
            "remote_tier_blocks",
        ):
            check_int(getattr(self, name), name, numpy=True)
        check_optional_int(self.max_concurrency, "max_concurrency", numpy=True)
        check_number(self.remote_fetch_wait_s, "remote_fetch_wait_s", numpy=True, infinite=True)
        if not isinstance(self.hash_algo, str):
            raise InvalidArgumentError(f"hash_algo must be a str, got {self.hash_algo!r}")
        check_bool(self.follow_ups_first, "follow_ups_first")
        if not isinstance(self.router, str):
            raise InvalidArgumentError(
                f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}"
            )
        if self.num_instances < 1:
            raise InvalidArgumentError(f"num_instances must be >= 1, got {self.num_instances}")
        if self.router not in ROUTERS:
            raise InvalidArgumentError(
                f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidArgumentError(
                f"max_concurrency must be >= 1 or None, got {self.max_concurrency}"
            )
        if self.num_blocks < 2:
            raise InvalidArgumentError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if not self.remote_fetch_wait_s >= 0:
            raise InvalidArgumentError(
                f"remote_fetch_wait_s must be >= 0, got {self.remote_fetch_wait_s}"
            )
        if self.remote_max_pending_write_blocks < 1:
            raise InvalidArgumentError(
                "remote_max_pending_write_blocks must be >= 1, got "
                f"{self.remote_max_pending_write_blocks}"
            )
        if self.remote_tier_blocks < 0:
            raise InvalidArgumentError(
                f"remote_tier_blocks must be >= 0, got {self.remote_tier_blocks}"
            )
        if self.remote_tier_blocks and not (
            self.host_cache_blocks > 0 and self.enable_prefix_caching
        ):
            raise InvalidArgumentError(
                "remote_tier_blocks needs a host tier (host_cache_blocks > 0) and prefix caching"
            )


@dataclass
class FleetResult:
    """Outcome of :func:`run_fleet` (see the module docstring for the definitions).

    Attributes:
        config: the run's configuration.
        num_requests, num_finished, num_rejected: requests in the trace / finished /
            rejected at admission (with their conversation's later turns).
        simulated_time_s: simulated time until the last request finished.
        prompt_tokens_admitted, cached_tokens_admitted: fleet totals (hit rate).
        generated_tokens: tokens sampled by finished requests.
        requests_per_s: completions per simulated second between the 10% and 90% marks.
        metrics: TTFT, TPOT, latency and queueing delay distributions.
        requests_per_instance: requests routed to each instance.
        hit_rate_per_instance: each instance's prefix hit rate.
        wall_s: wall-clock seconds of the run.
        tier: prefill tokens computed and host-tier traffic, fleet totals.
        remote: the shared remote tier's traffic (all zero without one).
    """

    config: FleetConfig
    num_requests: int
    num_finished: int
    num_rejected: int
    simulated_time_s: float
    prompt_tokens_admitted: int
    cached_tokens_admitted: int
    generated_tokens: int
    requests_per_s: float
    metrics: RequestMetrics
    requests_per_instance: list[int]
    hit_rate_per_instance: list[float]
    wall_s: float
    tier: TierTotals = field(default_factory=TierTotals)
    remote: RemoteTotals = field(default_factory=RemoteTotals)

    @property
    def label(self) -> str:
        """The router's name, ``+ host`` with a host tier, ``+ remote`` with a shared one."""
        return (
            self.config.router
            + (" + host" if self.config.host_cache_blocks else "")
            + (" + remote" if self.config.remote_tier_blocks else "")
        )

    @property
    def prefix_hit_rate(self) -> float:
        """Cached over admitted prompt tokens, fleet-wide."""
        return self.cached_tokens_admitted / max(self.prompt_tokens_admitted, 1)

    @property
    def output_tokens_per_s(self) -> float:
        """Generated tokens per simulated second over the whole run."""
        return self.generated_tokens / max(self.simulated_time_s, 1e-12)

    def summary(self) -> dict[str, Any]:
        """Headline numbers as a JSON-ready dict."""
        return {
            "router": self.config.router,
            "host_cache_blocks": self.config.host_cache_blocks,
            "remote_tier_blocks": self.config.remote_tier_blocks,
            "num_instances": self.config.num_instances,
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_rejected": self.num_rejected,
            "num_cut_short": self.metrics.num_cut_short,
            "simulated_time_s": self.simulated_time_s,
            "prefix_hit_rate": self.prefix_hit_rate,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "prompt_tokens_admitted": self.prompt_tokens_admitted,
            "cached_tokens_admitted": self.cached_tokens_admitted,
            "generated_tokens": self.generated_tokens,
            **self.metrics.summary(),
            "requests_per_instance": list(self.requests_per_instance),
            "hit_rate_per_instance": list(self.hit_rate_per_instance),
            "wall_s": self.wall_s,
            **self.tier.summary(
                self.config.cost_model,
                self.config.block_size,
                self.prompt_tokens_admitted,
                self.cached_tokens_admitted,
            ),
            **self.remote.summary(
                self.config.cost_model.block_bytes(self.config.block_size),
                self.config.block_size,
                self.prompt_tokens_admitted,
                self.simulated_time_s,
            ),
        }


@dataclass
class _Entry:
    sim: SimRequest
    index: int
    instance: int
    queued_blocks: int  # charged to the instance's queued prefill until its first step
    first_token_time: float | None = None


@dataclass
class _Instance:
    """One instance and what its running step will publish when it ends."""

    manager: KVCacheManager
    scheduler: Scheduler
    step_end: float | None = None  # end of the step in flight
    ready: float = 0.0  # earliest start of its next step
    stuck: bool = False  # its last step did nothing: wait for a new request
    pending_events: list[EventRecord] = field(default_factory=list)
    pending_done: list[Any] = field(default_factory=list)
    pending_first: list[str] = field(default_factory=list)
    pending_started: list[str] = field(default_factory=list)
    step_start: float = 0.0
    queued_blocks: int = 0
    routed: int = 0


class _CompletionWindow:
    """Completions per second between the 10% and 90% completion marks."""

    def __init__(self, num_requests: int) -> None:
        self.low = max(1, num_requests // 10)
        self.high = max(self.low + 1, (9 * num_requests) // 10)
        self.done = 0
        self.t_low: float | None = None
        self.t_high: float | None = None

    def finished(self, now: float, count: int) -> None:
        before = self.done
        self.done += count
        if before < self.low <= self.done:
            self.t_low = now
        if before < self.high <= self.done:
            self.t_high = now

    def rate(self, clock: float) -> float:
        if self.t_low is not None and self.t_high is not None and self.t_high > self.t_low:
            return (self.high - self.low) / (self.t_high - self.t_low)
        return self.done / clock if clock > 0 else 0.0


def run_fleet(config: FleetConfig) -> FleetResult:
    """Run the workload through ``config.num_instances`` instances behind the router."""
    started = time.perf_counter()
    n = config.num_instances
    router: Router = make_router(config.router, n)
    hasher = PromptHasher(config.block_size, config.hash_algo)
    bs = config.block_size
    usable = config.num_blocks - 1
    fleet = []
    for _ in range(n):
        manager = KVCacheManager(
            config.num_blocks,
            bs,
            num_cpu_blocks=config.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo,  # type: ignore[arg-type]
            record_events=config.enable_prefix_caching,
            host_cache_blocks=config.host_cache_blocks,
            host_offload=config.host_offload,  # type: ignore[arg-type]
        )
        fleet.append(_Instance(manager, Scheduler(manager, config.scheduler, record_history=False)))
    arrivals = ArrivalQueue(config.workload)
    entries: dict[str, _Entry] = {}
    rng = np.random.default_rng(config.workload.seed + 1)
    vocab = config.workload.vocab_size
    num_requests = config.workload.num_requests
    metrics = RequestMetrics(num_requests, count_conversations(config.workload))
    window = _CompletionWindow(num_requests)
    # (end time, instance) of the steps in flight
    ends: list[tuple[float, int]] = []
    # (end time, index, instance, request, prompt blocks, router credit, blocks read,
    # blocks before them) of the remote reads in flight
    reads: list[tuple[float, int, int, SimRequest, int, float, list[bytes], list[bytes]]] = []
    arrived = finished = rejected = generated = 0
    active = 0  # conversations in progress
    limit = config.max_concurrency
    clock = 0.0
    bar = _progress_bar(num_requests, config.progress)
    tier = TierTotals()
    remote = (
        SharedRemoteTier(config.remote_tier_blocks, config.remote_max_pending_write_blocks)
        if config.remote_tier_blocks
        else None
    )
    _started: set[str] = set()  # requests whose first step has ended
    _first: set[str] = set()  # requests whose first token has been sampled

    def publish_load(i: int) -> None:
        inst = fleet[i]
        active = round(float(inst.manager.usage()) * usable)
        router.set_load(i, InstanceLoad(active, inst.queued_blocks))

    def route(sim: SimRequest, now: float) -> None:
        nonlocal arrived, active
        if sim.turn == 0:
            active += 1
            if sim.arrival_time < now:  # held back by the client pool
                sim = replace(sim, arrival_time=now)
        tokens = sim.prompt_token_ids
        # A claim never covers the last token: only the blocks before it can be hits
        # (a block-aligned prompt's last block is computed even where it is cached).
        limit = max(len(tokens) - 1, 0) // bs
        hashes = hasher.block_hashes(tokens)[:limit] if router.uses_prefix else []
        prompt_blocks = -(-len(tokens) // bs)
        i = router.route(hashes, prompt_blocks)
        credit = router.overlaps(hashes)[i] if hashes else 0.0
        inst = fleet[i]
        index = arrived
        arrived += 1
        if remote is not None and len(tokens) > bs:
            # Only the blocks a claim can cover are read.
            digests = hashes if hashes else hasher.block_hashes(tokens)
            claimable = cast("list[bytes]", list(digests[:limit]))
            found = remote.lookup(inst.manager, claimable, now)
            if found:
                # The request waits for its read, as the engine holds a prefetching
                # request back; the store's one link serves the fleet's reads in turn.
                done = remote.read_done(now, len(found), config.cost_model, bs)
                if done - now <= config.remote_fetch_wait_s:
                    before = claimable[: claimable.index(found[0])]
                    heapq.heappush(
                        reads, (done, index, i, sim, prompt_blocks, credit, found, before)
                    )
                    return
                remote.totals.fetch_timeouts += 1
        admit(i, sim, index, prompt_blocks, credit, now)

    def admit(
        i: int, sim: SimRequest, index: int, prompt_blocks: int, credit: float, now: float
    ) -> None:
        """Queue a routed request on instance ``i``."""
        nonlocal rejected, active
        inst = fleet[i]
        try:
            inst.scheduler.add_request(request_for(sim, config.follow_ups_first))
        except InvalidArgumentError:
            lost = 1 + len(sim.next_turns)
            rejected += lost
            active -= 1
            bar.update(lost)
            return
        queued = max(prompt_blocks - int(credit), 0)
        entries[sim.request_id] = _Entry(sim, index, i, queued)
        inst.queued_blocks += queued
        inst.routed += 1
        inst.stuck = False
        inst.ready = max(inst.ready, now)
        publish_load(i)

    def start_step(i: int, now: float) -> None:
        inst = fleet[i]
        output = inst.scheduler.schedule()
        if remote is not None:
            # Before update() unpins the slots; the write-back is queued as the step's
            # ops copy the blocks to the host tier.
            remote.publish(i, inst.manager, output, now, config.cost_model, bs)
        result = _fake_model(output, rng, vocab)
        outputs = inst.scheduler.update(output, result)
        dt = config.cost_model.step_time(output, bs, config.host_offload == "commit")
        tier.add(output, config.cost_model, bs, dt)
        if dt == 0.0 and not outputs.finished:
            # Nothing could run (e.g. the pool cannot admit the queue head): wait for a
            # new request to change the picture.
            inst.stuck = True
            return
        # An empty step can still end requests (a sequence that alone fills the pool ends
        # with reason "length" when scheduled): it ends at once, and they finish now.
        inst.step_start = now
        inst.step_end = now + dt
        heapq.heappush(ends, (inst.step_end, i))
        running = set(inst.scheduler.running_request_ids()).union(output.sample_request_ids)
        inst.pending_started = [r for r in running if r in entries and r not in _started]
        inst.pending_first = [r for r in output.sample_request_ids if r not in _first]
        inst.pending_done = list(outputs.finished)
        if config.enable_prefix_caching:
            inst.pending_events = records_from_manager(i, inst.manager.take_events())

    def end_step(i: int) -> None:
        nonlocal finished, generated, active
        inst = fleet[i]
        now = inst.step_end
        assert now is not None
        inst.step_end = None
        inst.ready = now
        router.apply_events(inst.pending_events)
        inst.pending_events = []
        for rid in inst.pending_started:
            if rid in _started:
                continue
            _started.add(rid)
            e = entries[rid]
            metrics.scheduled(e.sim.conversation, e.sim.turn, inst.step_start - e.sim.arrival_time)
            inst.queued_blocks -= e.queued_blocks
        for rid in inst.pending_first:
            if rid in _first or rid not in entries:
                continue
            _first.add(rid)
            e = entries[rid]
            e.first_token_time = now
            metrics.first_token(now - e.sim.arrival_time)
        for out in inst.pending_done:
            e = entries.pop(out.request_id)
            _started.discard(out.request_id)
            _first.discard(out.request_id)
            finished += 1
            generated += sum(len(c.token_ids) for c in out.outputs)
            first = e.first_token_time if e.first_token_time is not None else now
            tokens = max(len(c.token_ids) for c in out.outputs)
            metrics.finished(now - e.sim.arrival_time, now - first, tokens, e.sim.output_len)
            follow = e.sim.next_turn(out.outputs[0].token_ids, now)
            if follow is not None:
                arrivals.push(follow)
            else:
                active -= 1
        if inst.pending_done:
            window.finished(now, len(inst.pending_done))
            bar.update(len(inst.pending_done))
        inst.pending_done = []
        publish_load(i)

    try:
        while True:
            t_end = ends[0][0] if ends else None
            starts = limit is None or active < limit
            t_arr = arrivals.next_time(starts)
            startable = [
                (inst.ready, i)
                for i, inst in enumerate(fleet)
                if inst.step_end is None
                and not inst.stuck
                and inst.scheduler.has_unfinished_requests()
            ]
            t_start = min(startable)[0] if startable else None
            t_read = reads[0][0] if reads else None
            times = [t for t in (t_end, t_read, t_arr, t_start) if t is not None]
            if not times:
                break
            now = clock = max(clock, min(times))
            if t_end is not None and t_end <= now:
                _, i = heapq.heappop(ends)
                end_step(i)
            elif t_read is not None and t_read <= now:
                while reads and reads[0][0] <= now:
                    _, index, i, waited, blocks, credit, found, before = heapq.heappop(reads)
                    assert remote is not None
                    remote.import_blocks(fleet[i].manager, found, before)
                    admit(i, waited, index, blocks, credit, now)
            elif t_arr is not None and t_arr <= now:
                while (sim := arrivals.pop_due(now, limit is None or active < limit)) is not None:
                    route(sim, now)
            else:
                for ready, i in sorted(startable):
                    if ready <= now:
                        start_step(i, now)
    finally:
        bar.close()
    if entries:
        raise SimulationError(
            f"{len(entries)} requests could never be scheduled: an instance's pool is too "
            "small for them (raise --num-blocks)"
        )
    per_hit = []
    prompt_total = cached_total = 0
    for inst in fleet:
        c = inst.scheduler.counters
        prompt_total += c.num_prompt_tokens_admitted
        cached_total += c.num_cached_tokens_admitted
        tier.readmitted_loads += c.num_readmitted_load_blocks
        per_hit.append(c.prefix_hit_rate)
    return FleetResult(
        config=config,
        num_requests=num_requests,
        num_finished=finished,
        num_rejected=rejected,
        simulated_time_s=clock,
        prompt_tokens_admitted=prompt_total,
        cached_tokens_admitted=cached_total,
        generated_tokens=generated,
        requests_per_s=window.rate(clock),
        metrics=metrics,
        requests_per_instance=[inst.routed for inst in fleet],
        hit_rate_per_instance=per_hit,
        wall_s=time.perf_counter() - started,
        tier=tier,
        remote=remote.totals if remote is not None else RemoteTotals(),
    )
