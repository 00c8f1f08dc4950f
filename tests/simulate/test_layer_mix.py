"""The layer-mix accounting model: the formula, its totals over a run, the CLI report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate import SimulationConfig, WorkloadConfig, run_simulation
from kvblocks.simulate.layer_mix import LayerGroup, LayerMix, LayerMixTotals
from kvblocks.simulate.planner import GROUPED_SERVER, grouped_equivalent_blocks, run_plan
from kvblocks.simulate.workload import LengthDist

from .cli_runner import run_cli

GEMMA3 = "sliding:1024x5,full:1"
GPT_OSS = "sliding:128x1,full:1"


def test_parse() -> None:
    mix = LayerMix.parse(GEMMA3)
    assert mix.groups == (LayerGroup(1024, 5), LayerGroup(None, 1))
    assert mix.num_layers == 6 and str(mix) == "sliding:1024x5,full:1"
    assert LayerMix.parse("sliding:128, full").groups == (LayerGroup(128, 1), LayerGroup(None, 1))
    merged = LayerMix.parse("sliding:8x2,full:3,sliding:8,fullx2")
    assert merged.groups == (LayerGroup(8, 3), LayerGroup(None, 5))


@pytest.mark.parametrize(
    "text",
    [
        *("", "sliding", "sliding:0x2", "sliding:8x0", "full:0", "window:8", "full:x", "8"),
        # Past int32 a window or count was an OverflowError out of the step accounting.
        *(f"sliding:{2**70}x1", f"sliding:1024x{2**70}", f"full:{2**31},full:{2**31}"),
    ],
)
def test_bad_mixes_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        LayerMix.parse(text)


def test_issue_targets_at_32k() -> None:
    """Issue 18's memory targets at 32k tokens, blocks of 16, one decode token."""
    gemma3 = LayerMix.parse(GEMMA3).per_sequence(32768, 16)
    # Full layer: 2048 blocks; each window layer the 1,024 keys its query sees: 64.
    assert gemma3["blocks_per_layer"] == {"sliding:1024": 64, "full": 2048}
    assert gemma3["grouped_layer_blocks"] == 5 * 64 + 2048
    assert gemma3["uniform_layer_blocks"] == 6 * 2048
    assert gemma3["grouped_over_uniform"] <= 0.22  # >= 4.5x the sequences
    gpt_oss = LayerMix.parse(GPT_OSS).per_sequence(32768, 16)
    assert gpt_oss["grouped_over_uniform"] <= 0.52


def test_window_blocks_equal_a_brute_force_count() -> None:
    """A window layer holds exactly the blocks with a key some query of the step sees."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        block_size = int(rng.choice([8, 16, 32]))
        window = int(rng.integers(1, 100))
        seq_len = int(rng.integers(1, 400))
        step = int(rng.integers(1, seq_len + 1))
        seen = {
            key // block_size
            for query in range(seq_len - step, seq_len)
            for key in range(max(0, query - window + 1), query + 1)
        }
        mix = LayerMix((LayerGroup(window, 1),))
        (blocks,) = mix.group_blocks([seq_len], [step], block_size)
        assert int(blocks[0]) == len(seen), (block_size, window, seq_len, step)


def test_totals_and_degenerate_mixes() -> None:
    mix = LayerMix.parse("sliding:16x3,full:1")
    totals = LayerMixTotals(mix, 8)
    totals.add([100, 5], [1, 5])
    totals.add([], [])  # an empty step counts nothing
    # 100 tokens: full 13 blocks, window 16 + 1 token: positions 84..99, blocks 10..12.
    assert totals.grouped_sum == (3 * 3 + 13) + 4 * 1
    assert totals.uniform_sum == 4 * 13 + 4 * 1 and totals.steps == 1
    assert LayerMixTotals(mix, 8).ratio == 1.0
    s = totals.summary()
    assert s["grouped_over_uniform"] == pytest.approx(26 / 56)
    assert s["sequences_in_same_memory"] == pytest.approx(56 / 26)


def _config(mix: str | None, **kw) -> SimulationConfig:
    workload = WorkloadConfig(
        num_requests=30,
        request_rate=math.inf,
        prompt_len=LengthDist("uniform", 100, 300),
        output_len=LengthDist("uniform", 50, 200),
        system_prompt_share=0.0,
        multi_turn_share=0.0,
        parallel_share=0.0,
    )
    return SimulationConfig(
        workload=workload,
        num_blocks=kw.pop("num_blocks", 256),
        block_size=16,
        progress=False,
        layer_mix=None if mix is None else LayerMix.parse(mix),
        **kw,
    )


def test_run_counts_every_step_and_all_full_is_uniform() -> None:
    full = run_simulation(_config("full:4"))
    assert full.layer_mix is not None and full.layer_mix.ratio == 1.0
    assert 0 < full.layer_mix.steps <= full.num_steps
    wide = run_simulation(_config("sliding:4096x3,full:1"))  # windows beyond every context
    assert wide.layer_mix is not None and wide.layer_mix.ratio == 1.0
    narrow = run_simulation(_config("sliding:64x3,full:1"))
    assert narrow.layer_mix is not None and 0.25 < narrow.layer_mix.ratio < 0.75
    summary = narrow.summary()["layer_mix"]
    assert summary["layers"] == "sliding:64x3,full:1"
    assert summary["mean_grouped_layer_blocks"] < summary["mean_uniform_layer_blocks"]
    # The accounting does not change the run itself.
    plain = run_simulation(_config(None))
    assert plain.layer_mix is None and "layer_mix" not in plain.summary()
    assert plain.num_steps == narrow.num_steps


def test_plan_adds_the_grouped_server_on_the_equivalent_pool() -> None:
    assert grouped_equivalent_blocks(101, 0.25) == 401
    assert grouped_equivalent_blocks(101, 1.0) == 101
    plan = run_plan(_config("sliding:32x5,full:1", num_blocks=128), "estimate", 30)
    names = [s.name for s in plan.servers]
    assert names[:2] == ["paged", GROUPED_SERVER]
    paged, grouped = plan.servers[0], plan.servers[1]
    assert paged.capacity is not None and grouped.capacity is not None
    # Memory-bound trace: the grouped pool holds more sequences, so it serves faster.
    assert grouped.saturated is not None and paged.saturated is not None
    assert grouped.saturated["mean_batch_seqs"] > paged.saturated["mean_batch_seqs"]
    assert grouped.capacity.requests_per_s > paged.capacity.requests_per_s


SMALL = ["--num-requests", "30", "--num-blocks", "256", "--saturation-requests", "30"]


def test_cli_reports_the_layer_mix() -> None:
    proc = run_cli(*SMALL, "--layers", "sliding:64x5,full:1", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "Layer mix sliding:64x5,full:1 (6 layers):" in proc.stdout
    assert "x the sequences in the same memory" in proc.stdout
    assert "capacity:" in proc.stdout and GROUPED_SERVER in proc.stdout
    proc = run_cli(*SMALL, "--layers", "sliding:64x5,full:1", "--json", "--capacity", "off")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"]["layers"] == "sliding:64x5,full:1"
    assert 0 < doc["summary"]["layer_mix"]["grouped_over_uniform"] < 1
    assert [s["name"] for s in doc["servers"]][:2] == ["paged", GROUPED_SERVER]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "sliding:0x5"], "--layers"),
        (["--layers", "window:8"], "--layers"),
        (["--layers", "full:1", "--instances", "2"], "--layers applies to one instance"),
    ],
)
def test_bad_layers_are_usage_errors(argv: list[str], message: str) -> None:
    proc = run_cli(*argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert message in err, err
