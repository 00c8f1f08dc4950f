"""Two models never share KV through a tier; two copies of one model do.

Engines whose weights differ but whose shapes match (the tiny Llama with two seeds, or one
checkpoint directory rewritten in place) share a real Valkey server or one disk-tier
directory: the second imports nothing and its tokens are those of its own run without a
tier. Engines of identical weights loaded from two copies of a checkpoint in two
directories still share. A layout that names no weights is refused.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvblocks.engine import LLM, LlamaForCausalLM, weights_digest
from kvblocks.engine.loader import save_checkpoint
from kvblocks.engine.tiny import build_tiny_model, tiny_config
from kvblocks.engine.weights_identity import checkpoint_weights
from kvblocks.errors import InvalidArgumentError
from kvblocks.tiers import DiskTier, KVLayout, weights

from .test_host_tier_engine import BLOCK, POOL, TARGET, _tokens

pytest.importorskip("valkey", reason="the valkey client is missing: pip install 'kvblocks[tiers]'")

from kvblocks.tiers.valkey_tier import ValkeyTier
from tiers.valkey_server import ServerProcess, running_server

LOADABLE = 3  # TARGET has four full blocks; the last is always computed
# A time well in the past: a file last changed then is not "racy" for the digest cache.
OLD_NS = 1_600_000_000 * 10**9


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server() as proc:
        yield proc


def _model(seed: int) -> LlamaForCausalLM:
    return build_tiny_model(tiny_config("llama"), seed=seed)


def _engine(model: LlamaForCausalLM | Path | None, remote_tier: Any = None) -> LLM:
    options: dict[str, Any] = {}
    if remote_tier is not None:
        options = {"host_cache_blocks": 16, "host_offload": "commit", "remote_tier": remote_tier}
    return LLM(model, num_blocks=POOL, block_size=BLOCK, num_cpu_blocks=0, **options)


def _imported(llm: LLM) -> int:
    remote = llm.stats()["remote"]
    return int(remote["imported_blocks"])


def _valkey(server: ServerProcess, key_prefix: str) -> Callable[[KVLayout], ValkeyTier]:
    """The documented factory form, on one server (a prefix per test keeps tests apart)."""
    return lambda layout: ValkeyTier(layout, port=server.port, key_prefix=key_prefix)


def _disk(directory: Path) -> Callable[[KVLayout], DiskTier]:
    return lambda layout: DiskTier(directory, layout, 64)


def _save(model: LlamaForCausalLM, directory: Path) -> Path:
    """Write ``model`` as a checkpoint, its files dated in the past (cacheable digests)."""
    save_checkpoint(model, directory)
    for f in directory.iterdir():
        os.utime(f, ns=(OLD_NS, OLD_NS))
    return directory


@pytest.mark.parametrize("tier", ["valkey", "disk"])
def test_different_weights_with_the_same_shapes_never_share(
    server: ServerProcess, tmp_path: Path, tier: str
) -> None:
    """Issue 16's repro, through the documented factory form: B imports nothing of A's."""
    a_model, b_model = _model(0), _model(1)
    b_alone = _tokens(_engine(b_model), TARGET)
    assert b_alone != _tokens(_engine(a_model), TARGET), "the two models must tell apart"
    make = _valkey(server, f"diff-{tier}:") if tier == "valkey" else _disk(tmp_path)
    a = _engine(a_model, make)
    _tokens(a, TARGET)
    assert a.stats()["remote"]["puts"] >= LOADABLE
    b = _engine(b_model, make)
    assert _tokens(b, TARGET) == b_alone
    assert _imported(b) == 0 and b.stats()["remote"]["hits"] == 0
    # A third engine of A's weights still finds A's blocks.
    a2 = _engine(_model(0), make)
    _tokens(a2, TARGET)
    assert _imported(a2) == LOADABLE


@pytest.mark.parametrize(
    "change", [{"query_pre_attn_scalar": 1.0}, {"sliding_window": 32}], ids=str
)
def test_the_same_tensors_under_another_config_never_share(
    tmp_path: Path, change: dict[str, float]
) -> None:
    """A config field the HF dict of a Llama leaves out still changes its forward (and
    every later layer's KV): a model object of A's tensors under it imports nothing."""
    a_model = _model(0)
    b_model = build_tiny_model(dataclasses.replace(tiny_config("llama"), **change))
    b_model.load_state_dict(a_model.state_dict())
    b_alone = _tokens(_engine(b_model), TARGET)
    assert b_alone != _tokens(_engine(a_model), TARGET), "the two models must tell apart"
    a = _engine(a_model, _disk(tmp_path))
    _tokens(a, TARGET)
    assert a.stats()["remote"]["puts"] >= LOADABLE
    b = _engine(b_model, _disk(tmp_path))
    assert _tokens(b, TARGET) == b_alone
    assert _imported(b) == 0


def test_a_layout_that_names_no_weights_is_refused(server: ServerProcess, tmp_path: Path) -> None:
    """An explicit KVLayout with only a model_id (empty or shared) never reaches a store,
    and one made for A's weights is refused by an engine of B's."""
    bare = KVLayout(2, 2, BLOCK, 64, torch.float32)
    for model_id in ("", "tiny-llama"):
        layout = dataclasses.replace(bare, model_id=model_id)
        with pytest.raises(InvalidArgumentError, match="name the weights"):
            ValkeyTier(layout, port=server.port)
        with pytest.raises(InvalidArgumentError, match="name the weights"):
            DiskTier(tmp_path, layout, 8)
    a_layout = dataclasses.replace(bare, weights_digest=weights_digest(_model(0)))
    with pytest.raises(InvalidArgumentError, match="other weights"):
        _engine(_model(1), ValkeyTier(a_layout, port=server.port))
    # The factory may add a model id; it may not take the digest away.
    with pytest.raises(InvalidArgumentError, match="name the weights"):
        _engine(
            _model(0),
            lambda layout: DiskTier(tmp_path, dataclasses.replace(layout, weights_digest=""), 8),
        )


def test_the_named_opt_out_shares_by_model_id_alone(server: ServerProcess) -> None:
    """``trust_model_id=True``: the caller vouches that one id means one set of weights."""
    layout = KVLayout(2, 2, BLOCK, 64, torch.float32, "tiny@seed0", trust_model_id=True)
    a = _engine(_model(0), ValkeyTier(layout, port=server.port, key_prefix="trust:"))
    want = _tokens(a, TARGET)
    b = _engine(_model(0), ValkeyTier(layout, port=server.port, key_prefix="trust:"))
    assert _tokens(b, TARGET) == want and _imported(b) == LOADABLE


@pytest.mark.parametrize("tier", ["valkey", "disk"])
def test_identical_weights_from_two_copies_share(
    server: ServerProcess, tmp_path: Path, tier: str
) -> None:
    first = _save(_model(0), tmp_path / "copy-1")
    second = _save(_model(0), tmp_path / "copy-2")
    make = _valkey(server, f"copies-{tier}:") if tier == "valkey" else _disk(tmp_path / "kv")
    a = _engine(first, make)
    want = _tokens(a, TARGET)
    b = _engine(second, make)
    assert _tokens(b, TARGET) == want
    assert _imported(b) == LOADABLE


@pytest.mark.parametrize("tier", ["valkey", "disk"])
def test_a_checkpoint_overwritten_in_place_is_other_weights(
    server: ServerProcess, tmp_path: Path, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W1 saved to DIR and run (its digest cached), then W2 saved over it with the same
    file names, sizes and modification times: W2 imports nothing and gives its own tokens."""
    # Cache W1's digest although its files changed a moment ago (their change time is now).
    monkeypatch.setattr(weights, "RACY_WINDOW_NS", 0)
    directory = tmp_path / "model"
    make = _valkey(server, f"inplace-{tier}:") if tier == "valkey" else _disk(tmp_path / "kv")
    _save(_model(0), directory)
    _tokens(_engine(directory, make), TARGET)
    assert checkpoint_weights(directory).cached, "the digest of W1 should be cached"
    w2 = _model(1)
    _save(w2, directory)
    b = _engine(directory, make)
    assert _tokens(b, TARGET) == _tokens(_engine(w2), TARGET)
    assert _imported(b) == 0
