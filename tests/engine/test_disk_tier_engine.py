"""A disk tier below the engine's host tier survives a restart of the process.

Engine A computes a prompt with a :class:`~kvblocks.tiers.DiskTier` as its ``remote_tier``
(write-through: every computed block reaches the directory) and is closed; a new Python
process (a real restart: nothing shared but the directory) opens engine B on the same
directory and must load the prefix instead of recomputing it: its device blocks hold
exactly the K/V A wrote (compared by digest), it computes only the last block, and its
tokens are those of an engine without any tier. A full directory evicts and never fails a
request; a directory of another model is rejected with a warning, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from kvblocks.engine import LLM, LlamaForCausalLM, weights_digest
from kvblocks.engine.dense import dense_greedy_generate
from kvblocks.engine.tiny import build_tiny_model
from kvblocks.tiers import DiskTier, KVLayout

from .test_host_tier_engine import BLOCK, GREEDY, POOL, TARGET, _prefix_payloads, _tokens
from .test_llm import _prompt

LOADABLE = 3  # TARGET has four full blocks; the last is always computed
MODEL_ID = "tiny-llama-seed0"

# Engine B in a fresh interpreter: the same tiny model (seeded weights), the same directory.
_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys, warnings
    import torch
    torch.set_num_threads(1)
    from kvblocks.engine import LLM, weights_digest
    from kvblocks.engine.tiny import build_tiny_model
    from kvblocks.sampling_params import SamplingParams
    from kvblocks.tiers import DiskTier, KVLayout
    from kvblocks.tiers.transfer import gather_blocks

    directory, model_id, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    block, pool = int(sys.argv[4]), int(sys.argv[5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        digest = weights_digest(build_tiny_model())
        disk = DiskTier(directory, KVLayout(2, 2, block, 64, torch.float32, model_id, digest), 64)
        llm = LLM(num_blocks=pool, block_size=block, num_cpu_blocks=0, device="cpu",
                  host_cache_blocks=16, host_offload="commit", remote_tier=disk)
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    m = llm.manager
    probe = 1 << 40
    m.add_sequence(probe, prompt)
    m.allocate_slots(probe, 0)
    assert m.take_memory_ops() == []
    blocks = m.block_table(probe).tolist()[: int(sys.argv[6])]
    kv = gather_blocks(llm.runner.host_layout, llm.runner.kv_caches, blocks)
    m.free(probe)
    stats = llm.stats()
    disk.close()
    print(json.dumps({
        "tokens": out[0].outputs[0].token_ids,
        "prefill": llm.scheduler.counters.num_prefill_tokens,
        "remote": {k: v for k, v in stats["remote"].items() if isinstance(v, int)},
        "host_loads": stats["cache"]["host_loads"],
        "kv_blocks": int(kv.shape[0]),
        "kv_sha256": hashlib.sha256(kv.numpy().tobytes()).hexdigest(),
        "warnings": [str(w.message) for w in caught],
    }))
    """
)


@pytest.fixture(scope="module")
def expected(tiny_llama: LlamaForCausalLM) -> list[int]:
    return dense_greedy_generate(tiny_llama, [TARGET], GREEDY.max_tokens)[0]


def _layout(model_id: str = MODEL_ID) -> KVLayout:
    """The tiny Llama's layout: its weights, plus ``model_id``."""
    return KVLayout(2, 2, BLOCK, 64, torch.float32, model_id, weights_digest(build_tiny_model()))


def _engine(model: LlamaForCausalLM, disk: DiskTier, **kwargs: object) -> LLM:
    options: dict[str, object] = {"host_cache_blocks": 16, **kwargs}
    return LLM(
        model,
        num_blocks=POOL,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_offload="commit",
        remote_tier=disk,
        **options,  # type: ignore[arg-type]
    )


def _run_a(model: LlamaForCausalLM, directory: Path) -> tuple[list[int], str]:
    """Engine A computes TARGET into ``directory`` and is closed: its tokens and the
    digest of its prefix blocks' K/V."""
    disk = DiskTier(directory, _layout(), 64)
    a = _engine(model, disk)
    tokens = _tokens(a, TARGET)
    kv = _prefix_payloads(a, TARGET)[:LOADABLE]
    assert a.stats()["remote"]["published_blocks"] >= LOADABLE
    disk.close()
    del a
    return tokens, hashlib.sha256(kv.numpy().tobytes()).hexdigest()


def _run_b(directory: Path, model_id: str = MODEL_ID) -> dict[str, object]:
    """Engine B in a new process on ``directory``."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(directory),
            model_id,
            json.dumps(TARGET),
            str(BLOCK),
            str(POOL),
            str(LOADABLE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_restarted_process_loads_the_prefix_from_disk(
    tiny_llama: LlamaForCausalLM, tmp_path: Path, expected: list[int]
) -> None:
    a_tokens, a_kv = _run_a(tiny_llama, tmp_path)
    b = _run_b(tmp_path)
    assert a_tokens == b["tokens"] == expected
    # B computed only the last block: three were read from disk and loaded.
    assert b["prefill"] == len(TARGET) - LOADABLE * BLOCK
    remote = b["remote"]
    assert isinstance(remote, dict)
    assert remote["imported_blocks"] == LOADABLE and remote["hits"] == LOADABLE
    assert remote["rejected"] == 0
    assert b["host_loads"] == LOADABLE
    # The memory: B's device blocks of the prefix hold exactly the K/V A computed.
    assert b["kv_blocks"] == LOADABLE and b["kv_sha256"] == a_kv
    assert b["warnings"] == []


def test_another_models_directory_is_never_loaded(
    tiny_llama: LlamaForCausalLM, tmp_path: Path, expected: list[int]
) -> None:
    """B names other weights: A's blocks stay A's (a warning says why B misses)."""
    _run_a(tiny_llama, tmp_path)
    b = _run_b(tmp_path, model_id="another-model")
    assert b["tokens"] == expected
    assert b["prefill"] == len(TARGET)
    remote = b["remote"]
    assert isinstance(remote, dict) and remote["imported_blocks"] == 0
    assert b["host_loads"] == 0
    warned = b["warnings"]
    assert isinstance(warned, list)
    assert any("other layouts" in w and MODEL_ID in w for w in warned), warned


def test_a_directory_renamed_from_another_model_is_rejected(
    tiny_llama: LlamaForCausalLM, tmp_path: Path, expected: list[int]
) -> None:
    """A's fingerprint directory moved to B's name: every block rejected, none loaded."""
    _run_a(tiny_llama, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / _layout().fingerprint.hex()).rename(
        tmp_path / "b" / _layout("another-model").fingerprint.hex()
    )
    b = _run_b(tmp_path / "b", model_id="another-model")
    assert b["tokens"] == expected
    assert b["prefill"] == len(TARGET)
    remote = b["remote"]
    assert isinstance(remote, dict)
    assert remote["imported_blocks"] == 0 and remote["rejected"] >= LOADABLE
    warned = b["warnings"]
    assert isinstance(warned, list)
    assert any("describes another layout" in w for w in warned), warned


def test_a_full_disk_tier_evicts_and_never_fails_a_request(
    tiny_llama: LlamaForCausalLM, tmp_path: Path
) -> None:
    prompts = [TARGET] + [_prompt(4 * BLOCK, 10 + i) for i in range(3)]
    plain = LLM(tiny_llama, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0)
    want = [_tokens(plain, p) for p in prompts]
    disk = DiskTier(tmp_path, _layout(), 2)
    llm = _engine(tiny_llama, disk, host_cache_blocks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eviction is normal: nothing to warn about
        got = [_tokens(llm, p) for p in prompts]
        got.append(_tokens(llm, prompts[-1]))  # the newest blocks are still there
    assert got == [*want, want[-1]]
    stats = disk.stats()
    assert len(disk) == 2 and len(list(disk.root.glob("*.kvb"))) == 2
    assert stats.evictions >= 4 * len(prompts) - 2 and stats.dropped_puts == 0
    llm.manager.check_invariants()


def test_the_remote_tier_asks_for_the_manager_s_own_hashes(tmp_path: Path) -> None:
    """Regression: the remote tier hashed prompts with (block_size, hash_algo) only, so a
    manager with its own ``hash_seed`` asked the store for keys no instance writes (every
    read a miss). It now hashes with the manager's hasher: seed and LoRAs included."""
    from kvblocks import KVCacheManager
    from kvblocks.tiers import RemoteTierOptions
    from kvblocks.tiers.remote_link import RemoteTierLink, TierRead

    layout = KVLayout(1, 1, 4, 8, torch.float32, MODEL_ID, "ab" * 32)
    manager = KVCacheManager(
        16, 4, hash_algo="sha256_cbor", hash_seed="fleet-7", host_cache_blocks=8
    )
    pool = torch.zeros(8, layout.payload_nbytes, dtype=torch.uint8)
    store = DiskTier(tmp_path, layout, 32)
    link = RemoteTierLink(store, manager, pool, layout, RemoteTierOptions(async_io=False))
    prompt = list(range(1, 17))  # four full blocks, the last one always computed
    manager.add_sequence(0, prompt)
    assert manager.allocate_slots(0, 16) is not None
    manager.commit(0, 16)
    stored = [h for e in manager.take_events() if e.medium == "GPU" for h in e.block_hashes]  # type: ignore[union-attr]
    manager.free(0)
    assert manager.reset_prefix_cache()
    assert link.missing(TierRead(prompt)) == stored[:3]
