"""CPU time of ``LLM.generate`` against HF ``generate`` per phase, on the uniform or mixed batch.

The engine benchmark (``test_engine_vs_transformers.py``) times whole calls by the wall
clock, which on a machine shared with other work mostly measures the load. This script
measures the calling thread's CPU time (``time.thread_time``; with one torch thread,
the default here, every op runs on it) of the same model and prompts, rounds
interleaved: a call generating one token (the prefill and the first sample) and a full
call; their difference is the decode steps. Tokens are checked identical once.

Run: ``python benches/engine/cpu_phases.py [uniform|mixed] [rounds]``.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvblocks.engine import LLM
from kvblocks.sampling_params import SamplingParams

CASES = {"uniform": (16, (128, 128), 32), "mixed": (32, (16, 512), 64)}


def _bench_module() -> Any:
    """The engine benchmark's model and prompt builders (one definition of the setup)."""
    path = Path(__file__).with_name("test_engine_vs_transformers.py")
    spec = importlib.util.spec_from_file_location("engine_vs_transformers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(case: str, rounds: int) -> None:
    """Print the median CPU seconds per phase and HF / kvblocks ratios."""
    import transformers

    torch.set_num_threads(1)
    bench = _bench_module()
    batch, lengths, max_new = CASES[case]
    path = Path(tempfile.mkdtemp())
    hf = bench._random_llama(transformers, path)
    prompts = bench._prompts(batch, lengths)

    def kvblocks(new: int) -> tuple[float, list[list[int]]]:
        llm = LLM(path)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        start = time.thread_time()
        tokens = [out.token_ids for out in llm.generate(prompts, params)]
        return time.thread_time() - start, tokens

    def hf_generate(new: int) -> tuple[float, list[list[int]]]:
        start = time.thread_time()
        tokens = bench._hf_generate(hf, prompts, new)
        return time.thread_time() - start, tokens

    assert kvblocks(max_new)[1] == hf_generate(max_new)[1]
    runs: dict[str, list[float]] = {"hf_1": [], "kv_1": [], "hf_all": [], "kv_all": []}
    for _ in range(rounds):
        runs["hf_1"].append(hf_generate(1)[0])
        runs["kv_1"].append(kvblocks(1)[0])
        runs["hf_all"].append(hf_generate(max_new)[0])
        runs["kv_all"].append(kvblocks(max_new)[0])
    m = {key: statistics.median(values) for key, values in runs.items()}
    phases = {
        "prefill + 1st token": (m["hf_1"], m["kv_1"]),
        f"{max_new - 1} decode steps": (m["hf_all"] - m["hf_1"], m["kv_all"] - m["kv_1"]),
        "whole call": (m["hf_all"], m["kv_all"]),
    }
    print(f"[{case}, 1 thread, {rounds} rounds, CPU seconds of the calling thread]")
    for name, (hf_s, kv_s) in phases.items():
        print(f"  {name}: HF {hf_s:.3f} s, kvblocks {kv_s:.3f} s, x{hf_s / kv_s:.2f}")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "uniform",
        int(sys.argv[2]) if len(sys.argv) > 2 else 5,
    )
