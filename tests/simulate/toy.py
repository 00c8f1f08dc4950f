"""A toy server whose every number can be worked out by hand.

Every step costs exactly ``STEP_S`` whatever it computes, requests have a fixed prompt
and output length, and nothing is shared, so a request occupies ``OUTPUT_LEN`` steps
(one prefill step that samples the first token, then one decode step per later token).
"""

from __future__ import annotations

import math

from kvblocks.scheduler import SchedulerConfig
from kvblocks.simulate import CostModel, SimulationConfig, WorkloadConfig
from kvblocks.simulate.workload import LengthDist

STEP_S = 0.01
PROMPT_LEN = 16
OUTPUT_LEN = 9
SERVICE_S = OUTPUT_LEN * STEP_S  # one request alone: 0.09 s


def toy_config(
    *,
    num_requests: int = 200,
    request_rate: float = math.inf,
    max_num_seqs: int = 1,
    num_blocks: int = 1024,
    output_len: int = OUTPUT_LEN,
) -> SimulationConfig:
    """The toy server on a trace of identical, unrelated single-turn requests."""
    workload = WorkloadConfig(
        num_requests=num_requests,
        request_rate=request_rate,
        arrival="constant",
        prompt_len=LengthDist("fixed", PROMPT_LEN),
        output_len=LengthDist("fixed", output_len),
        system_prompt_share=0.0,
        multi_turn_share=0.0,
        parallel_share=0.0,
        num_priorities=1,
    )
    return SimulationConfig(
        workload=workload,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        num_blocks=num_blocks,
        num_cpu_blocks=0,
        cost_model=CostModel(fixed_s=STEP_S, per_token_s=0.0, per_context_token_s=0.0),
        progress=False,
    )
