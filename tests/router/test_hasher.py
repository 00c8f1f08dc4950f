"""PromptHasher gives exactly the hashes an instance publishes for the same prompt."""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import KVCacheManager
from kvblocks.errors import InvalidArgumentError
from kvblocks.router import PromptHasher, records_from_manager


def _instance_hashes(
    tokens: np.ndarray, bs: int, algo: str, hash_seed: str | None = None, **kw: object
) -> list[bytes]:
    m = KVCacheManager(len(tokens) // bs + 4, bs, hash_algo=algo, hash_seed=hash_seed)  # type: ignore[arg-type]
    m.register_lora(3, "sql-adapter", "/adapters/sql")
    m.add_sequence(1, tokens, **kw)  # type: ignore[arg-type]
    m.allocate_slots(1, len(tokens))
    m.commit(1, len(tokens))
    out: list[bytes] = []
    for r in records_from_manager(0, m.take_events()):
        out.extend(r.block_hashes)  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("algo", ["blake3", "xxh3_128", "sha256_cbor"])
@pytest.mark.parametrize("kw", [{}, {"cache_salt": "tenant-a"}, {"lora_id": 3}])
def test_hashes_match_the_instances(algo: str, kw: dict[str, object]) -> None:
    rng = np.random.default_rng(5)
    hasher = PromptHasher(16, algo)
    hasher.register_lora(3, "sql-adapter", "/adapters/sql")
    for n in (16, 47, 160, 333):
        tokens = rng.integers(0, 32000, size=n)
        got = hasher.block_hashes(tokens, **kw)  # type: ignore[arg-type]
        assert got == _instance_hashes(tokens, 16, algo, **kw)
        assert len(got) == n // 16


def test_each_prompt_is_hashed_from_scratch() -> None:
    """Hashing a prompt twice, or a prompt that extends an earlier one, gives every block:
    the scratch cache must not keep blocks (a cached block publishes no event)."""
    hasher = PromptHasher(8)
    a = np.arange(40)
    first = hasher.block_hashes(a)
    assert len(first) == 5
    assert hasher.block_hashes(a) == first
    longer = hasher.block_hashes(np.arange(64))
    assert longer[:5] == first and len(longer) == 8


def test_salt_and_lora_change_the_hashes() -> None:
    hasher = PromptHasher(4)
    t = np.arange(12)
    plain = hasher.block_hashes(t)
    assert hasher.block_hashes(t, cache_salt="x") != plain
    assert hasher.block_hashes(t, lora_id=1) != plain


def test_a_fleet_s_seed_and_loras_are_the_instances() -> None:
    """Regression: the hasher drove a scratch manager built from (block_size, hash_algo)
    only, so a sha256_cbor fleet with its own seed got other hashes (every lookup missed)
    and a LoRA prompt could not be hashed at all."""
    tokens = np.arange(40)
    want = _instance_hashes(tokens, 8, "sha256_cbor", hash_seed="fleet-7", lora_id=3)
    hasher = PromptHasher(8, "sha256_cbor", hash_seed="fleet-7")
    hasher.register_lora(3, "sql-adapter", "/adapters/sql")
    assert hasher.block_hashes(tokens, lora_id=3) == want
    m = KVCacheManager(8, 8, hash_algo="sha256_cbor", hash_seed="fleet-7")
    m.register_lora(3, "sql-adapter", "/adapters/sql")
    from_manager = PromptHasher.from_manager(m)
    assert (from_manager.block_size, from_manager.hash_algo) == (8, "sha256_cbor")
    assert from_manager.block_hashes(tokens, lora_id=3) == want


def test_short_and_long_prompts() -> None:
    hasher = PromptHasher(16)
    assert hasher.block_hashes(np.arange(15)) == []
    assert hasher.block_hashes(np.arange(0)) == []
    long = np.arange(5000) % 32000
    assert hasher.block_hashes(long) == _instance_hashes(long, 16, "blake3")[: 5000 // 16]


def test_bad_input_raises_and_the_hasher_still_works() -> None:
    hasher = PromptHasher(4)
    with pytest.raises(InvalidArgumentError):
        hasher.block_hashes(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises((InvalidArgumentError, ValueError, TypeError, OverflowError)):
        hasher.block_hashes(np.array([-1, 2, 3, 4, 5]))
    assert len(hasher.block_hashes(np.arange(8))) == 2
    with pytest.raises(InvalidArgumentError):
        PromptHasher(0)


@pytest.mark.parametrize("manager", [None, 4, "m", object()])
def test_from_manager_refuses_what_is_no_manager(manager: object) -> None:
    # An AttributeError (no block_size) before.
    with pytest.raises(InvalidArgumentError, match="manager"):
        PromptHasher.from_manager(manager)  # type: ignore[arg-type]


def test_a_hash_format_that_is_no_str_is_refused() -> None:
    # An array was NumPy's ambiguous-truth ValueError.
    with pytest.raises(InvalidArgumentError, match="hash_format"):
        PromptHasher(4).block_hashes([1, 2, 3, 4], hash_format=np.array(["int"]))  # type: ignore[arg-type]
