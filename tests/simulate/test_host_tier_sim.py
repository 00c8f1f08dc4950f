"""``kvblocks simulate`` with a host tier: the cost of loads and offloads, what the tier
saves on a multi-turn workload, the report, and the CLI options."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kvblocks._core import KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.sampling_params import SamplingParams
from kvblocks.scheduler import ModelStepResult, Request, Scheduler, SchedulerConfig
from kvblocks.scheduler.output import SchedulerOutput
from kvblocks.simulate import CostModel, SimulationConfig, WorkloadConfig, run_plan
from kvblocks.simulate.cost_model import DEFAULT_KV_BYTES_PER_TOKEN, tier_ops
from kvblocks.simulate.fleet import FleetConfig, FleetResult, run_fleet
from kvblocks.simulate.fleet_report import format_fleet_table
from kvblocks.simulate.report import format_json, format_table
from kvblocks.simulate.runner import run_simulation
from kvblocks.simulate.workload import LengthDist

from .cli_runner import run_cli as _cli

BS = 16


def _one_step() -> SchedulerOutput:
    """A real one-request prefill step (no memory ops of its own)."""
    manager = KVCacheManager(64, BS, num_cpu_blocks=0)
    sched = Scheduler(manager, SchedulerConfig(), record_history=False)
    sched.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=2), 0.0))
    out = sched.schedule()
    sched.update(out, ModelStepResult(np.zeros(1, dtype=np.int64), None, None, None))
    return out


def _pairs(n: int) -> np.ndarray:
    return np.zeros((n, 2), dtype=np.int64)


def test_default_block_bytes_are_the_7b_fp16_layout() -> None:
    assert DEFAULT_KV_BYTES_PER_TOKEN == 32 * 2 * 4096 * 2
    assert CostModel().block_bytes(16) == 8 * 2**20


def test_loads_and_offloads_cost_bytes_over_bandwidth_added_to_compute() -> None:
    out = _one_step()
    cost = CostModel(kv_bytes_per_token=1000, host_bandwidth_bytes_per_s=2e6)
    compute = cost.step_time(out, BS)
    assert compute == pytest.approx(cost.time(out.num_tokens, int(out.seq_lens.sum())))
    ops = [("load", _pairs(3)), ("copy", _pairs(5)), ("offload", _pairs(2)), ("load", _pairs(1))]
    tiered = replace(out, memory_ops=ops)
    assert tier_ops(tiered) == (4, 2)  # copies and swaps are not tier traffic
    # 6 blocks x 16 tokens x 1000 bytes / 2e6 B/s = 0.048 s on top of the compute.
    assert cost.transfer_time(6, BS) == pytest.approx(0.048)
    assert cost.step_time(tiered, BS) == pytest.approx(compute + 0.048)
    # Twice the bandwidth halves the transfer, not the compute.
    fast = replace(cost, host_bandwidth_bytes_per_s=4e6)
    assert fast.step_time(tiered, BS) == pytest.approx(compute + 0.024)
    # A step that computes nothing still pays for its transfers.
    idle = replace(out, seq_ids=out.seq_ids[:0], memory_ops=[("offload", _pairs(2))])
    assert idle.is_empty and cost.step_time(idle, BS) == pytest.approx(0.016)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        cost.step_time(tiered)


def test_write_through_offloads_overlap_compute_loads_do_not() -> None:
    out = _one_step()
    cost = CostModel(kv_bytes_per_token=1000, host_bandwidth_bytes_per_s=2e6)
    compute = cost.step_time(out, BS)  # ~10 ms
    assert 0.005 < compute < 0.02
    small = replace(out, memory_ops=[("offload", _pairs(1)), ("load", _pairs(2))])  # 8 + 16 ms
    assert cost.step_time(small, BS) == pytest.approx(compute + 0.024)
    # Overlapped: the 8 ms offload hides under the compute; the 16 ms of loads still add.
    assert cost.step_time(small, BS, overlap_offloads=True) == pytest.approx(compute + 0.016)
    big = replace(out, memory_ops=[("offload", _pairs(10))])  # 80 ms: longer than compute
    assert cost.step_time(big, BS, overlap_offloads=True) == pytest.approx(0.08)
    assert cost.step_time(big, BS) == pytest.approx(compute + 0.08)


@pytest.mark.parametrize("kwargs", [{"kv_bytes_per_token": 0}, {"host_bandwidth_bytes_per_s": 0.0}])
def test_cost_model_rejects_bad_layout(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgumentError):
        CostModel(**kwargs)  # type: ignore[arg-type]


def _multi_turn(num_requests: int = 60) -> WorkloadConfig:
    """Conversations whose histories outgrow a 63-block pool: the tier keeps them."""
    return WorkloadConfig(
        num_requests=num_requests,
        request_rate=20.0,
        arrival="constant",
        seed=3,
        prompt_len=LengthDist("fixed", 48),
        output_len=LengthDist("fixed", 8),
        max_prompt_len=64,
        max_output_len=16,
        max_context_len=1024,
        system_prompt_share=0.0,
        multi_turn_share=1.0,
        max_turns=5,
        think_time_s=0.5,
        parallel_share=0.0,
    )


def _sim(host_cache_blocks: int, host_offload: str = "evict") -> SimulationConfig:
    return SimulationConfig(
        workload=_multi_turn(),
        num_blocks=64,
        block_size=BS,
        num_cpu_blocks=0,
        host_cache_blocks=host_cache_blocks,
        host_offload=host_offload,
        progress=False,
    )


@pytest.mark.parametrize("policy", ["evict", "commit"])
def test_tier_recomputes_fewer_prefill_tokens(policy: str) -> None:
    base = run_simulation(_sim(0)).summary()
    tiered_result = run_simulation(_sim(256, policy))
    tiered = tiered_result.summary()
    assert base["num_finished"] == tiered["num_finished"] == 60
    assert base["blocks_loaded"] == base["blocks_offloaded"] == base["host_hit_rate"] == 0
    assert tiered["blocks_loaded"] > 0 and tiered["blocks_offloaded"] > 0
    # Every loaded block is a prefix block not recomputed.
    assert tiered["prefill_tokens_computed"] < base["prefill_tokens_computed"]
    assert (
        base["prefill_tokens_computed"] - tiered["prefill_tokens_computed"]
        >= tiered["blocks_loaded"] * BS // 2
    )
    assert tiered["host_hit_rate"] > 0.05
    assert tiered["gpu_hit_rate"] + tiered["host_hit_rate"] == pytest.approx(
        tiered["prefix_hit_rate"]
    )
    assert tiered["prefix_hit_rate"] > base["prefix_hit_rate"]
    moved = tiered["blocks_loaded"] + tiered["blocks_offloaded"]
    cost = CostModel()
    assert tiered["transfer_bytes"] == moved * cost.block_bytes(BS)
    assert tiered["transfer_s"] == pytest.approx(cost.transfer_time(moved, BS))
    if policy == "evict":  # nothing overlaps: every transfer adds to its step
        assert tiered["transfer_added_s"] == pytest.approx(tiered["transfer_s"])
    else:
        assert 0 < tiered["transfer_added_s"] < tiered["transfer_s"]
    assert tiered_result.scheduler_stats["num_prompt_tokens_admitted"] > 0


def test_write_through_offloads_at_least_as_much_as_evict() -> None:
    evict = run_simulation(_sim(256, "evict")).summary()
    commit = run_simulation(_sim(256, "commit")).summary()
    assert commit["blocks_offloaded"] >= evict["blocks_offloaded"]


def test_plan_runs_paged_without_and_with_the_tier() -> None:
    plan = run_plan(_sim(256), capacity="off")
    names = [s.name for s in plan.servers]
    assert names == ["paged", "paged + host tier", "contiguous max_tokens", "contiguous exact"]
    assert plan.paged.config.host_cache_blocks == 0 and plan.tiered is not None
    assert plan.servers[0].at_rate["blocks_loaded"] == 0
    assert plan.servers[1].at_rate["blocks_loaded"] > 0
    table = format_table(plan)
    assert "What the host tier adds (256 host blocks" in table
    assert "prefill tokens computed" in table and "blocks loaded / offloaded" in table
    assert "latency stable at this rate" in table.split("What the host tier adds")[1]
    doc = json.loads(format_json(plan))
    assert doc["config"]["host_cache_blocks"] == 256
    assert doc["config"]["host_bandwidth_gbps"] == pytest.approx(25.0)
    assert [s["name"] for s in doc["servers"]][:2] == ["paged", "paged + host tier"]


def test_plan_without_tier_is_unchanged() -> None:
    plan = run_plan(_sim(0), capacity="off")
    assert plan.tiered is None and len(plan.servers) == 3
    assert "What the host tier adds" not in format_table(plan)


def test_fleet_with_tier_loads_instead_of_recomputing() -> None:
    def fleet(host: int) -> FleetResult:
        return run_fleet(
            FleetConfig(
                workload=replace(_multi_turn(80), request_rate=float("inf")),
                num_instances=2,
                router="cache-aware",
                num_blocks=64,
                block_size=BS,
                num_cpu_blocks=0,
                host_cache_blocks=host,
            )
        )

    base, tiered = fleet(0), fleet(256)
    assert tiered.tier.blocks_loaded > 0 and base.tier.blocks_loaded == 0
    assert tiered.tier.prefill_tokens_computed < base.tier.prefill_tokens_computed
    s = tiered.summary()
    assert s["host_cache_blocks"] == 256 and s["host_hit_rate"] > 0
    table = format_fleet_table([base, tiered])
    assert "cache-aware + host vs cache-aware:" in table and "GPU+host hits" in table


TINY = [
    *("--num-requests", "30", "--num-blocks", "64", "--block-size", "16"),
    *("--prompt-len", "fixed:48", "--output-len", "fixed:8", "--max-prompt-len", "64"),
    *("--max-output-len", "16", "--max-context-len", "1024", "--system-prompt-share", "0"),
    *("--multi-turn-share", "1", "--max-turns", "5", "--think-time", "0.5"),
    *("--parallel-share", "0", "--num-cpu-blocks", "0", "--no-progress"),
]


def test_cli_single_mode_reports_the_tier() -> None:
    proc = _cli(
        *TINY, "--request-rate", "20", "--capacity", "off", "--host-cache-blocks", "256",
        "--host-offload", "commit", "--host-bandwidth-gbps", "12.5",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "paged + host tier" in proc.stdout
    assert "256 host blocks, offload at commit" in proc.stdout and "12.5 GB/s" in proc.stdout


def test_cli_fleet_json_has_rows_with_and_without_the_tier() -> None:
    proc = _cli(
        *TINY, "--instances", "2", "--router", "round-robin", "--host-cache-blocks", "256",
        "--kv-bytes-per-token", "1024", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = doc["routers"]
    assert [(r["router"], r["host_cache_blocks"]) for r in rows] == [
        ("round-robin", 0),
        ("round-robin", 256),
    ]
    assert rows[0]["blocks_loaded"] == 0 and rows[1]["blocks_loaded"] > 0
    assert doc["config"]["cost_model"]["kv_bytes_per_token"] == 1024
    assert rows[1]["transfer_bytes"] == 1024 * 16 * (
        rows[1]["blocks_loaded"] + rows[1]["blocks_offloaded"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--host-cache-blocks", "-1"], "--host-cache-blocks"),
        (["--host-cache-blocks", "many"], "--host-cache-blocks"),
        (["--host-cache-blocks", "8", "--host-offload", "later"], "--host-offload"),
        (["--host-cache-blocks", "8", "--host-bandwidth-gbps", "0"], "--host-bandwidth-gbps"),
        (["--host-cache-blocks", "8", "--host-bandwidth-gbps", "nan"], "--host-bandwidth-gbps"),
        (["--host-cache-blocks", "8", "--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
        (["--host-offload", "commit"], "--host-offload needs --host-cache-blocks"),
        (["--host-bandwidth-gbps", "10"], "--host-bandwidth-gbps needs --host-cache-blocks"),
        (["--kv-bytes-per-token", "1024"], "--kv-bytes-per-token needs --host-cache-blocks"),
        (["--host-cache-blocks", "8", "--no-prefix-caching"], "needs prefix caching"),
        (
            ["--instances", "2", "--host-cache-blocks", "8", "--no-prefix-caching"],
            "needs prefix caching",
        ),
    ],
)
def test_bad_tier_options_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    proc = _cli(*argv)
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kvblocks simulate: error:") and message in err, err
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"fixed_s": float("nan")}, "fixed_s"),  # every step time NaN
        ({"per_token_s": -1.0}, "per_token_s"),  # time running backwards
        ({"per_context_token_s": "1"}, "per_context_token_s"),
        ({"kv_bytes_per_token": 2.5}, "kv_bytes_per_token"),
        ({"host_bandwidth_bytes_per_s": float("inf")}, "host_bandwidth_bytes_per_s"),
        ({"remote_bandwidth_bytes_per_s": "1e9"}, "remote_bandwidth_bytes_per_s"),
    ],
)
def test_cost_model_fields_of_the_wrong_kind_are_refused(
    kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        CostModel(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"workload": None}, "workload"),  # each an AttributeError in run_simulation
        ({"scheduler": {}}, "scheduler"),
        ({"cost_model": 1}, "cost_model"),
        ({"layer_mix": "gemma"}, "layer_mix"),
        ({"num_blocks": 2.5}, "num_blocks"),
        ({"block_size": True}, "block_size"),
        ({"num_cpu_blocks": None}, "num_cpu_blocks"),
        ({"host_cache_blocks": "8"}, "host_cache_blocks"),
        ({"host_offload": 1}, "host_offload"),
        ({"progress": "no"}, "progress"),  # any truthy object showed a progress bar
        ({"stop_at_window": 1}, "stop_at_window"),
        ({"enable_prefix_caching": None}, "enable_prefix_caching"),
    ],
)
def test_simulation_fields_of_the_wrong_kind_are_refused(
    kwargs: dict[str, object], name: str
) -> None:
    from kvblocks.simulate import SimulationConfig

    with pytest.raises(InvalidArgumentError, match=name):
        SimulationConfig(**kwargs)  # type: ignore[arg-type]


def test_cost_model_times_are_kept_as_python_floats() -> None:
    # A NumPy float16 time overflowed to inf in a step's sums (OverflowError in a run).
    cost = CostModel(fixed_s=np.float16(1.0), per_token_s=np.float32(7e-5))
    assert type(cost.fixed_s) is float and type(cost.per_token_s) is float
    assert cost == CostModel(fixed_s=1.0, per_token_s=float(np.float32(7e-5)))


def test_host_hit_rate_counts_only_first_admissions_like_the_prefix_hit_rate() -> None:
    """Unique prompts share nothing (prefix hit rate 0), but a pool too small for the
    batch preempts, and a recompute readmission loads its own offloaded blocks back:
    those loads are not prompt hits. They were counted as host-tier hits over first
    admissions' prompt tokens (104% host hit rate here, on a 0% prefix hit rate)."""
    workload = WorkloadConfig(
        num_requests=40,
        seed=2,
        request_rate=float("inf"),
        system_prompt_share=0.0,
        multi_turn_share=0.0,
        parallel_share=0.0,
        prompt_len=LengthDist.parse("fixed:200"),
        output_len=LengthDist.parse("fixed:300"),
    )
    cfg = SimulationConfig(
        workload=workload, num_blocks=120, host_cache_blocks=4000, progress=False
    )
    result = run_simulation(cfg)
    s = result.summary()
    assert s["preemptions_recompute"] > 0 and s["blocks_loaded"] > 0  # readmissions loaded
    assert s["prefix_hit_rate"] == 0.0
    assert (s["gpu_hit_rate"], s["host_hit_rate"]) == (0.0, 0.0)
