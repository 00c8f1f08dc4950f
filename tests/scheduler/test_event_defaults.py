"""KV cache events are off where nothing drains them (issue #7, item 10).

``LLM`` and ``simulate`` never call ``take_events``; with recording on, the manager's
event queue grew with every block cached or evicted (2,144 events after 250 requests).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvblocks import KVCacheManager
from kvblocks.engine import LLM
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.sampling_params import SamplingParams
from kvblocks.simulate import runner
from kvblocks.simulate.config import SimulationConfig
from kvblocks.simulate.runner import run_simulation
from kvblocks.simulate.workload import WorkloadConfig


def test_llm_does_not_record_events_nobody_drains() -> None:
    llm = LLM(build_tiny_model(tiny_config("llama")), num_blocks=64, device="cpu")
    shared = list(range(1, 40))
    llm.generate(
        [[*shared, 100 + i] for i in range(4)], SamplingParams(max_tokens=4, temperature=0.0)
    )
    assert llm.manager.record_events is False
    assert llm.manager.take_events() == []


def test_simulate_does_not_record_events_nobody_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[KVCacheManager] = []

    def keep(*args: Any, **kwargs: Any) -> KVCacheManager:
        # The real manager, kept so the test can look at its event queue afterwards.
        built.append(KVCacheManager(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(runner, "KVCacheManager", keep)
    config = SimulationConfig(
        workload=WorkloadConfig(num_requests=40, seed=3), num_blocks=256, progress=False
    )
    result = run_simulation(config)
    assert result.num_finished > 0
    (manager,) = built
    assert manager.record_events is False
    assert manager.take_events() == []
