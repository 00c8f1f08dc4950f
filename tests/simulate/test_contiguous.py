"""The contiguous-reservation baseline: the sizing rule and what it costs in batch size."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks.errors import InvalidArgumentError
from kvblocks.simulate import run_simulation
from kvblocks.simulate.capacity import saturated_config
from kvblocks.simulate.contiguous import reservation_tokens, run_contiguous
from kvblocks.simulate.workload import SimRequest

from .toy import PROMPT_LEN, SERVICE_S, toy_config


def _request(prompt: int, output: int, declared: int, n: int) -> SimRequest:
    return SimRequest("r", 0.0, np.zeros(prompt, dtype=np.int64), output, declared, n)


def test_reservation_rule_arithmetic() -> None:
    # A contiguous server reserves prompt + max_tokens for every sequence...
    assert reservation_tokens(_request(100, 40, 256, 1), "max_tokens") == 356
    assert reservation_tokens(_request(100, 40, 256, 3), "max_tokens") == 3 * 356
    # ...the oracle lower bound, prompt + the real output.
    assert reservation_tokens(_request(100, 40, 256, 1), "exact") == 140
    assert reservation_tokens(_request(100, 40, 256, 3), "exact") == 3 * 140
    with pytest.raises(InvalidArgumentError):
        run_contiguous(toy_config(), "guess")


# 34 usable blocks x 16 tokens = 544 tokens. Each toy request is 16 + 9 tokens (2 paged
# blocks) and declares max_tokens 256: under "max_tokens" two fit (2 x 272 = 544), under
# "exact" 21 would, and paged 17; max_num_seqs = 8 caps the last two.
POOL = dict(num_blocks=35, max_num_seqs=8)


def test_reserving_max_tokens_limits_the_batch_and_the_throughput() -> None:
    config = saturated_config(toy_config(**POOL), 200)
    fair = run_contiguous(config, "max_tokens")
    exact = run_contiguous(config, "exact")
    paged = run_simulation(config)
    assert fair.peak_batch_seqs == 2 and fair.peak_reserved_tokens == 2 * (PROMPT_LEN + 256)
    assert exact.peak_batch_seqs == 8 and exact.peak_reserved_tokens == 8 * (PROMPT_LEN + 9)
    assert paged.timeline.peak("running_seqs") == 8
    assert fair.saturated_requests_per_s == pytest.approx(2 / SERVICE_S, rel=0.01)
    assert exact.saturated_requests_per_s == pytest.approx(8 / SERVICE_S, rel=0.01)
    assert paged.saturated_requests_per_s == pytest.approx(8 / SERVICE_S, rel=0.01)


def test_a_reservation_larger_than_memory_is_rejected_with_its_later_turns() -> None:
    config = toy_config(num_blocks=10, num_requests=5)  # 144 tokens < 16 + 256
    fair = run_contiguous(config, "max_tokens")
    assert fair.num_rejected == 5 and fair.num_finished == 0
    exact = run_contiguous(config, "exact")
    assert exact.num_finished == 5 and exact.num_rejected == 0


def test_same_trace_same_work() -> None:
    config = toy_config(num_requests=30, request_rate=5.0, max_num_seqs=4)
    paged = run_simulation(config)
    for rule in ("max_tokens", "exact"):
        contiguous = run_contiguous(config, rule)
        assert contiguous.num_finished == paged.num_finished == 30
        assert contiguous.generated_tokens == paged.generated_tokens
