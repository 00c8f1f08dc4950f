"""A remote tier under an engine with KV cache groups (a Gemma 3 checkpoint: one full and
two sliding-window groups of one layer slot each).

The same tokens have one block per group, each holding its own layer's KV, so the store
keys a block by group and hash: engine A computes a prompt (write-through), a fresh
engine B on the same store (a real Valkey server, or a disk directory) loads its prefix
from the store by the hit rule (every full-attention block, a window group's last
block), and B's device blocks of every group hold exactly A's KV for those tokens; B's
tokens are transformers' own. Keyed by hash alone, the groups' blocks would collide and
B would read one layer's KV as another's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvblocks.engine import LLM
from kvblocks.sampling_params import SamplingParams
from kvblocks.tiers import DiskTier, KVLayout
from kvblocks.tiers.transfer import gather_blocks

from .hf_families import VOCAB, hf_greedy, load_hf, save_hf_checkpoint

BLOCK = 8
PROMPT = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(21)).tolist()
LOADABLE = 4  # 37 tokens: four full blocks, all of which a claim may use
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A random Gemma 3 checkpoint and transformers' greedy tokens for ``PROMPT``."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("gemma3")
    save_hf_checkpoint(transformers, "gemma3_text", path, seed=5)
    return path, hf_greedy(load_hf(transformers, path), PROMPT, MAX_TOKENS)


def _engine(path: Path, store: Callable[[KVLayout], Any], **kwargs: Any) -> LLM:
    return LLM(
        str(path),
        num_blocks=32,
        block_size=BLOCK,
        num_cpu_blocks=0,
        host_cache_blocks=32,
        host_offload="commit",
        remote_tier=store,
        device="cpu",
        **kwargs,
    )


def _group_kv(llm: LLM, prompt: list[int]) -> list[torch.Tensor]:
    """Per group, the KV of the prompt's cached blocks that group holds (a probe
    sequence's claim; a window group's released entries are the null block, skipped)."""
    m = llm.manager
    probe = 1 << 40
    m.add_sequence(probe, prompt)
    m.allocate_slots(probe, 0)
    assert m.take_memory_ops() == []
    out = []
    for g in range(m.num_groups):
        blocks = [b for b in m.block_table(probe, group=g).tolist()[:LOADABLE] if b != 0]
        out.append(gather_blocks(llm.runner.host_layout, llm.runner.kv_caches, blocks))
    m.free(probe)
    return out


def _share(path: Path, store: Callable[[KVLayout], Any], expected: list[int]) -> LLM:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    a = _engine(path, store)
    assert len(a.manager.groups) == 3
    assert a.generate([PROMPT], params)[0].token_ids == expected
    a.close()
    b = _engine(path, store)
    before = b.scheduler.counters.num_prefill_tokens
    out = b.generate([PROMPT], params)[0]
    assert out.token_ids == expected
    assert out.num_cached_tokens == LOADABLE * BLOCK
    # B computed only the prompt's last (partial) block.
    assert b.scheduler.counters.num_prefill_tokens - before == len(PROMPT) - LOADABLE * BLOCK
    stats = b.stats()["remote"]
    # Four full-attention blocks and each window group's last one.
    assert stats["imported_blocks"] == LOADABLE + 2
    a_kv, b_kv = _group_kv(a, PROMPT), _group_kv(b, PROMPT)
    assert [len(kv) for kv in b_kv] == [LOADABLE, 1, 1]
    for g in range(3):
        assert torch.equal(a_kv[g][-len(b_kv[g]) :], b_kv[g]), g
    b.close()
    return b


def test_disk_tier_shares_every_groups_blocks(
    gemma: tuple[Path, list[int]], tmp_path: Path
) -> None:
    path, expected = gemma
    _share(path, lambda layout: DiskTier(tmp_path, layout, 256), expected)


@pytest.fixture
def server() -> Iterator[Any]:
    from tiers.valkey_server import running_server

    with running_server() as proc:
        yield proc


def test_valkey_tier_shares_every_groups_blocks(gemma: tuple[Path, list[int]], server: Any) -> None:
    from kvblocks.tiers.valkey_tier import ValkeyTier

    path, expected = gemma
    stores: list[ValkeyTier] = []

    def store(layout: KVLayout) -> ValkeyTier:
        stores.append(ValkeyTier(layout, port=server.port, socket_timeout_s=2.0))
        return stores[-1]

    _share(path, store, expected)
    # An engine of another layer mix (one group of every layer) reads none of them:
    # its layout (3 layer slots per block, not 1) names other bytes.
    c = _engine(path, store, kv_cache_groups=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert c.generate([PROMPT], params)[0].token_ids == expected
    assert c.stats()["remote"]["imported_blocks"] == 0
    c.close()
    for s in stores:
        s.close()
