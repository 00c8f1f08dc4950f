"""Fleet simulation: N real schedulers + managers behind a router, on the simulated clock."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvblocks.errors import InvalidArgumentError
from kvblocks.scheduler import SchedulerConfig
from kvblocks.simulate import CostModel, WorkloadConfig, run_simulation
from kvblocks.simulate.fleet import FleetConfig, FleetResult, run_fleet
from kvblocks.simulate.workload import LengthDist

from .toy import OUTPUT_LEN, SERVICE_S, STEP_S, toy_config


def _chat(num_requests: int = 60, seed: int = 3) -> WorkloadConfig:
    """Multi-turn conversations with no shared system prompt: the only reuse is each
    conversation's own history, which only its previous instance holds."""
    return WorkloadConfig(
        num_requests=num_requests,
        request_rate=math.inf,
        seed=seed,
        prompt_len=LengthDist("fixed", 40),
        output_len=LengthDist("fixed", 12),
        max_prompt_len=64,
        max_output_len=64,
        max_context_len=512,
        system_prompt_share=0.0,
        multi_turn_share=1.0,
        max_turns=4,
        think_time_s=0.05,
        parallel_share=0.0,
    )


def _fleet(router: str, **kw: object) -> FleetResult:
    config = FleetConfig(
        workload=kw.pop("workload", _chat()),  # type: ignore[arg-type]
        num_instances=kw.pop("num_instances", 4),  # type: ignore[arg-type]
        router=router,
        num_blocks=kw.pop("num_blocks", 256),  # type: ignore[arg-type]
        block_size=8,
        num_cpu_blocks=0,
        **kw,  # type: ignore[arg-type]
    )
    return run_fleet(config)


def test_cache_aware_beats_round_robin_on_hit_rate() -> None:
    rr = _fleet("round-robin")
    ca = _fleet("cache-aware")
    for r in (rr, ca):
        assert r.num_finished == 60 and r.num_rejected == 0
        assert sum(r.requests_per_instance) == 60
        assert r.metrics.ttft.count == 60
    # Round-robin sends a follow-up to its conversation's instance 1 time in 4.
    assert ca.prefix_hit_rate >= 2 * rr.prefix_hit_rate, (ca.prefix_hit_rate, rr.prefix_hit_rate)
    assert ca.prefix_hit_rate > 0.4
    # Less to prefill: the fleet finishes sooner.
    assert ca.simulated_time_s < rr.simulated_time_s


def test_runs_are_deterministic_for_a_seed() -> None:
    a = _fleet("cache-aware").summary()
    b = _fleet("cache-aware").summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    c = _fleet("cache-aware", workload=_chat(seed=4)).summary()
    assert c["simulated_time_s"] != a["simulated_time_s"]


def test_least_loaded_spreads_the_load() -> None:
    r = _fleet("least-loaded")
    assert r.num_finished == 60
    assert min(r.requests_per_instance) >= 10


def test_one_instance_fleet_matches_the_single_instance_runner() -> None:
    """Same trace, same scheduler, one instance: the event loop must reproduce the
    single-instance simulation's clock and latencies exactly."""
    workload = dataclasses.replace(_chat(), request_rate=20.0)
    single = run_simulation(
        dataclasses.replace(
            toy_config(),
            workload=workload,
            num_blocks=256,
            block_size=8,
            follow_ups_first=True,
            cost_model=CostModel(),
            scheduler=SchedulerConfig(),
        )
    )
    fleet = _fleet("round-robin", workload=workload, num_instances=1, cost_model=CostModel())
    assert fleet.num_finished == single.num_finished == 60
    assert fleet.simulated_time_s == pytest.approx(single.simulated_time_s)
    assert fleet.prefix_hit_rate == pytest.approx(single.summary()["prefix_hit_rate"])
    assert fleet.metrics.ttft.mean == pytest.approx(single.metrics.ttft.mean)
    assert fleet.metrics.latency.max == pytest.approx(single.metrics.latency.max)


def test_instances_run_in_parallel_on_the_clock() -> None:
    """Toy requests (every step STEP_S, one sequence per step): two instances finish a
    batch of 40 in half the time one instance needs."""
    base = toy_config(num_requests=40)
    common = {
        "workload": base.workload,
        "scheduler": SchedulerConfig(max_num_seqs=1),
        "cost_model": base.cost_model,
        "num_blocks": 64,
    }
    one = _fleet("round-robin", num_instances=1, **common)
    two = _fleet("round-robin", num_instances=2, **common)
    assert one.simulated_time_s == pytest.approx(40 * SERVICE_S)
    assert two.simulated_time_s == pytest.approx(20 * SERVICE_S)
    assert two.requests_per_instance == [20, 20]
    # TPOT of a lone sequence is exactly one step.
    assert two.metrics.tpot.max == pytest.approx(STEP_S, rel=0.02)
    assert OUTPUT_LEN > 1


def test_max_concurrency_holds_conversations_back() -> None:
    free = _fleet("cache-aware", num_instances=1)
    assert free.metrics.queue_delay.max > 0  # every conversation is due at t=0
    one = _fleet("cache-aware", num_instances=1, max_concurrency=1)
    # One client: each request finds the instance idle, so nothing ever waits.
    assert one.num_finished == 60
    assert one.metrics.queue_delay.max == 0.0
    assert one.simulated_time_s > free.simulated_time_s


def test_requests_too_long_for_an_instance_are_rejected_with_their_later_turns() -> None:
    """9 usable blocks of 8 tokens hold a first turn (40 + 12 tokens) but no later turn
    (its history alone is over 52 tokens): each conversation loses its later turns."""
    r = _fleet("cache-aware", num_blocks=10)
    assert r.num_finished + r.num_rejected == 60
    assert r.num_finished == 20 and r.num_rejected == 40


def _tiered(router: str, remote_blocks: int = 0, **kw: object) -> FleetResult:
    """The chat trace on 4 small instances with write-through host tiers and, with
    ``remote_blocks``, one remote tier shared by all four."""
    return _fleet(
        router,
        num_blocks=kw.pop("num_blocks", 64),
        host_cache_blocks=64,
        host_offload="commit",
        remote_tier_blocks=remote_blocks,
        **kw,
    )


def test_a_shared_remote_tier_serves_history_from_other_instances() -> None:
    """Round-robin sends a follow-up elsewhere 3 times in 4: its history is on another
    instance (GPU or host tier), which only a tier shared by the fleet can serve."""
    host = _tiered("round-robin")
    shared = _tiered("round-robin", remote_blocks=4096)
    for r in (host, shared):
        assert r.num_finished == 60 and r.num_rejected == 0
    assert host.remote.blocks_imported == host.remote.blocks_published == 0
    remote = shared.remote
    # Every offloaded block was written (write-through: every committed full block).
    assert remote.blocks_published == shared.tier.blocks_offloaded > 0
    assert 0 < remote.blocks_imported <= remote.blocks_read == remote.hits <= remote.lookups
    assert remote.fetch_timeouts == 0
    # Imported blocks are loaded, not computed: the hit rate rises, prefill falls. (A few
    # are stranded: their instance lost a block before them while the read was queued
    # behind the writes on the link, so their request's claim stops short of them.)
    assert remote.blocks_stranded < 0.05 * remote.blocks_imported
    assert shared.tier.blocks_loaded >= remote.blocks_imported - remote.blocks_stranded
    assert shared.prefix_hit_rate >= 2 * host.prefix_hit_rate, (
        shared.prefix_hit_rate,
        host.prefix_hit_rate,
    )
    assert shared.tier.prefill_tokens_computed < 0.7 * host.tier.prefill_tokens_computed
    # Reads and writes are charged by bytes over the remote bandwidth, on one link.
    cost = shared.config.cost_model
    assert remote.transfer_s == pytest.approx(
        remote.blocks_read * cost.block_bytes(8) / cost.remote_bandwidth_bytes_per_s
    )
    assert remote.write_s == pytest.approx(
        remote.blocks_published * cost.block_bytes(8) / cost.remote_bandwidth_bytes_per_s
    )
    assert remote.transfer_s + remote.write_s <= shared.simulated_time_s
    summary = shared.summary()
    assert summary["remote_blocks_imported"] == remote.blocks_imported
    assert summary["remote_hit_rate"] == pytest.approx(
        remote.blocks_imported * 8 / shared.prompt_tokens_admitted
    )
    assert shared.label == "round-robin + host + remote"


def test_remote_reads_cost_step_time_by_bandwidth() -> None:
    # Every read waited for (no fetch timeout): the bandwidth alone decides. (1 GB/s: the
    # link also carries the fleet's write-through traffic, 2.5 s of it here; at 100 MB/s
    # the writes never land in time to be read: see the saturation test below.)
    fast = _tiered(
        "round-robin",
        4096,
        cost_model=CostModel(remote_bandwidth_bytes_per_s=1e12),
        remote_fetch_wait_s=1e9,
    )
    slow = _tiered(
        "round-robin",
        4096,
        cost_model=CostModel(remote_bandwidth_bytes_per_s=1e9),
        remote_fetch_wait_s=1e9,
    )
    assert fast.remote.blocks_imported > 0 and slow.remote.blocks_imported > 0
    assert slow.remote.transfer_s > 100 * fast.remote.transfer_s
    assert slow.simulated_time_s > fast.simulated_time_s
    # One server link serves every instance's reads one at a time: never busier than 100%.
    assert slow.remote.transfer_s <= slow.simulated_time_s


def test_reads_slower_than_the_fetch_wait_are_left_unused() -> None:
    """A saturated link: a read due after ``remote_fetch_wait_s`` is not waited for (the
    request computes its blocks, as the engine does after its ``fetch_wait_s``)."""
    slow = CostModel(remote_bandwidth_bytes_per_s=2e9)  # 4 MiB blocks: 2.1 ms each
    patient = _tiered("round-robin", 4096, cost_model=slow, remote_fetch_wait_s=1e9)
    hasty = _tiered("round-robin", 4096, cost_model=slow, remote_fetch_wait_s=0.05)
    assert patient.remote.fetch_timeouts == 0
    assert patient.remote.blocks_imported > 0
    assert hasty.remote.fetch_timeouts > 0 and hasty.num_finished == 60
    assert hasty.remote.blocks_imported < patient.remote.blocks_imported
    # Not waiting for the link: the first tokens come sooner.
    assert hasty.metrics.ttft.percentile(99) < patient.metrics.ttft.percentile(99)
    assert hasty.summary()["remote_fetch_timeouts"] == hasty.remote.fetch_timeouts


def test_a_small_remote_tier_evicts_lru_and_serves_less() -> None:
    big = _tiered("round-robin", 4096)
    small = _tiered("round-robin", 16)
    assert small.remote.evictions > 0 and big.remote.evictions == 0
    assert small.remote.blocks_imported < big.remote.blocks_imported
    assert small.num_finished == 60


def test_remote_runs_are_deterministic() -> None:
    a = _tiered("cache-aware", 4096).summary()
    b = _tiered("cache-aware", 4096).summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"remote_tier_blocks": 8}, "needs a host tier"),
        ({"remote_tier_blocks": -1}, "remote_tier_blocks"),
        ({"remote_fetch_wait_s": -1.0}, "remote_fetch_wait_s"),
        (
            {"remote_tier_blocks": 8, "host_cache_blocks": 8, "enable_prefix_caching": False},
            "prefix caching",
        ),
        ({"router": "random"}, "router must be one of"),
        ({"num_instances": 0}, "num_instances"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"num_blocks": 1}, "num_blocks"),
    ],
)
def test_bad_configs_raise(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        FleetConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"num_instances": 2.5}, "num_instances"),
        ({"num_instances": "8"}, "num_instances"),  # a TypeError from the comparison
        ({"num_blocks": float("nan")}, "num_blocks"),
        ({"router": ["cache-aware"]}, "router"),  # unhashable
        ({"workload": None}, "workload"),  # an AttributeError in run_fleet
        ({"scheduler": {}}, "scheduler"),
        ({"cost_model": 1}, "cost_model"),
        ({"remote_fetch_wait_s": "1"}, "remote_fetch_wait_s"),
        ({"progress": "no"}, "progress"),
        ({"hash_algo": 3}, "hash_algo"),
    ],
)
def test_fleet_fields_of_the_wrong_kind_are_refused(kw: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        FleetConfig(**kw)  # type: ignore[arg-type]
