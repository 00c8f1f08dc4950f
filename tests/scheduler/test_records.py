"""Validation of the interface records: SamplingParams, Request, SchedulerConfig."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import InvalidArgumentError
from kvblocks.scheduler import (
    FinishReason,
    ModelStepResult,
    Request,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"n": 0},
        {"beam_width": 0},
        {"beam_width": 2, "n": 3},
        {"seed": -1},
        {"stop_token_ids": [2**32]},
        {"stop_token_ids": ["a"]},
        {"max_tokens": 2.5},
        {"ignore_eos": "yes"},
    ],
)
def test_sampling_params_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_and_derives() -> None:
    sp = SamplingParams(temperature=0, stop_token_ids=[3, 4], n=2)
    assert sp.stop_token_ids == (3, 4) and isinstance(sp.temperature, float)
    assert sp.greedy and not sp.use_beam_search and sp.num_sequences == 2
    beam = SamplingParams(beam_width=4, n=2)
    assert beam.use_beam_search and beam.num_sequences == 4


@pytest.mark.parametrize("kwargs", [{"top_k": 2**31}, {"top_k": 2**70}, {"seed": 2**63}])
def test_sampling_params_beyond_the_step_columns_are_refused(kwargs: dict) -> None:
    """The step's sampling columns are int32 (top_k) and int64 (seed). Before, top_k=2**40
    raised OverflowError in the middle of Scheduler.update, and LLM.generate's clean-up
    then failed too (IndexError), leaving the request and its sequence behind for good;
    seed=2**64 raised OverflowError from schedule()."""
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
    limit = {"top_k": 2**31 - 1, "seed": 2**63 - 1}
    key = next(iter(kwargs))
    assert getattr(SamplingParams(**{key: limit[key]}), key) == limit[key]


@pytest.mark.parametrize("max_tokens", [2**63, 10**30])
def test_max_tokens_beyond_the_step_column_is_refused(max_tokens: int) -> None:
    """The sequence table's max_tokens column is int64: 2**63 was accepted, then the
    first update raised OverflowError half-way, leaving the request unfinished with no
    sequence running (every later schedule() empty)."""
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)
    assert SamplingParams(max_tokens=2**63 - 1).max_tokens == 2**63 - 1


@pytest.mark.parametrize(
    ("request_id", "prompt"),
    [("", [1]), ("a", []), ("a", [[1, 2]]), ("a", [-1]), ("a", [2**32]), ("a", [1.5])],
)
def test_request_rejects_bad_input(request_id: str, prompt: list) -> None:
    with pytest.raises(InvalidArgumentError):
        Request(request_id, prompt)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eos_token_id": "2"},
        {"eos_token_id": float("nan")},
        {"eos_token_id": 1.7},
        {"eos_token_id": True},
        {"arrival_time": "1"},
        {"arrival_time": float("nan")},
        {"arrival_time": float("inf")},
        {"arrival_time": True},
    ],
)
def test_request_rejects_bad_eos_and_arrival_time(kwargs: dict) -> None:
    """Before: eos_token_id "2" or NaN raised ValueError, 1.7 was kept (no generated token
    equals it: the EOS never stopped anything); arrival_time "1" raised ValueError in
    add_request, NaN or inf were the fcfs order key of the request."""
    with pytest.raises(InvalidArgumentError, match=r"eos_token_id|arrival_time"):
        Request("a", [1, 2], **kwargs)


def test_request_keeps_eos_and_arrival_time_as_python_numbers() -> None:
    req = Request("a", [1, 2], eos_token_id=np.int64(3), arrival_time=np.float32(2.5))
    assert type(req.eos_token_id) is int and req.eos_token_id == 3
    assert type(req.arrival_time) is float and req.arrival_time == 2.5


def test_request_stores_a_read_only_int64_prompt() -> None:
    source = np.array([5, 6, 7], dtype=np.int32)
    req = Request("a", source)
    source[0] = 0
    assert req.prompt_token_ids.dtype == np.int64
    assert req.prompt_token_ids.tolist() == [5, 6, 7]
    assert req.num_prompt_tokens == 3
    with pytest.raises(ValueError):
        req.prompt_token_ids[0] = 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": 0},
        {"policy": "lifo"},
        {"preemption_mode": "drop"},
        {"num_lookahead_tokens": -1},
        {"enable_chunked_prefill": 1},
    ],
)
def test_scheduler_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SchedulerConfig(**kwargs)


def test_finish_reason_is_a_string() -> None:
    assert FinishReason.EOS == "eos" and str(FinishReason.LENGTH) == "length"


def test_empty_output_and_result_records() -> None:
    out = SchedulerOutput.empty()
    assert out.is_empty and out.num_tokens == 0 and out.query_start_loc.tolist() == [0]
    assert out.blocks_to_copy.shape == (0, 2)
    res = ModelStepResult(np.zeros(0, np.int64))
    assert res.topk_token_ids is None
