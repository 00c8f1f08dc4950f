"""``hash_algo="sha256_cbor"`` gives exactly vLLM's block hashes.

The vectors in ``data/vllm_sha256_cbor_hashes.json`` were computed by vLLM's own
``get_request_block_hasher`` and ``sha256_cbor`` (``data/record_vllm_hashes.py``); the
manager's ``BlockStored`` events must carry the same 32-byte hashes, whether a block
fills at ``add_sequence`` (the prompt) or later at ``commit`` (decode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvblocks
from kvblocks import BlockRemoved, BlockStored, KVCacheManager

VECTORS = json.loads((Path(__file__).parent / "data" / "vllm_sha256_cbor_hashes.json").read_text())
CASES: list[dict[str, Any]] = VECTORS["cases"]


def _manager(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch, num_blocks: int = 64
) -> KVCacheManager:
    """A ``sha256_cbor`` manager seeded through PYTHONHASHSEED as vLLM is, LoRA mapped."""
    if case["seed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", case["seed"])
    m = KVCacheManager(num_blocks, case["block_size"], hash_algo="sha256_cbor", watermark=0.0)
    if case["lora"] is not None:
        m.register_lora(case["lora"]["id"], case["lora"]["name"], case["lora"]["path"])
    return m


def _lora_id(case: dict[str, Any]) -> int | None:
    return None if case["lora"] is None else case["lora"]["id"]


def _stored(m: KVCacheManager) -> list[bytes]:
    """Hashes of the blocks stored since the last drain, in order."""
    return [h for ev in m.take_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]


def _case_id(case: dict[str, Any]) -> str:
    lora = case["lora"]["name"] if case["lora"] else None
    salt = None if case["cache_salt"] is None else len(case["cache_salt"])
    return f"bs{case['block_size']}-n{len(case['tokens'])}-salt{salt}-lora{lora}-seed{case['seed']}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prompt_blocks_carry_vllms_hashes(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _manager(case, monkeypatch)
    tokens = case["tokens"]
    m.add_sequence(1, tokens, cache_salt=case["cache_salt"], lora_id=_lora_id(case))
    m.allocate_slots(1, len(tokens))
    m.commit(1, len(tokens), [])
    assert [h.hex() for h in _stored(m)] == case["block_hashes"]
    assert m.none_hash is not None and m.none_hash.hex() == VECTORS["none_hash"][str(case["seed"])]


@pytest.mark.parametrize("case", [c for c in CASES if len(c["block_hashes"]) >= 2], ids=_case_id)
def test_decoded_blocks_carry_vllms_hashes(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt shorter than one block: every block fills at commit, one token a step."""
    m = _manager(case, monkeypatch)
    bs, tokens = case["block_size"], case["tokens"]
    first = max(1, bs - 1)
    m.add_sequence(1, tokens[:first], cache_salt=case["cache_salt"], lora_id=_lora_id(case))
    m.allocate_slots(1, first)
    stored = []
    for i in range(first, len(tokens)):
        m.commit(1, 1 if i > first else first, [tokens[i]])
        stored += _stored(m)
        m.allocate_slots(1, 1)
    m.commit(1, 1, [])
    stored += _stored(m)
    assert [h.hex() for h in stored] == case["block_hashes"]


def test_explicit_hash_seed_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    case = next(c for c in CASES if c["seed"] == "12345" and not c["cache_salt"] and not c["lora"])
    m = KVCacheManager(64, case["block_size"], hash_algo="sha256_cbor", hash_seed="12345")
    m.add_sequence(1, case["tokens"])
    m.allocate_slots(1, len(case["tokens"]))
    m.commit(1, len(case["tokens"]), [])
    assert [h.hex() for h in _stored(m)] == case["block_hashes"]
    # The other algorithms have no NONE_HASH and ignore PYTHONHASHSEED.
    assert KVCacheManager(8, 4).none_hash is None


def test_prefix_hits_and_evictions_use_vllms_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c["seed"] is None and c["lora"] and c["cache_salt"])
    bs, tokens, want = case["block_size"], case["tokens"], case["block_hashes"]
    m = _manager(case, monkeypatch, num_blocks=1 + len(tokens) // bs + 1)
    lora = _lora_id(case)
    m.add_sequence(1, tokens, cache_salt=case["cache_salt"], lora_id=lora)
    m.allocate_slots(1, len(tokens))
    m.commit(1, len(tokens), [])
    m.take_events()
    m.free(1)
    # Same prompt, same keys: every full block but the last token's is a hit.
    hit = m.add_sequence(2, tokens, cache_salt=case["cache_salt"], lora_id=lora)
    assert hit == (len(tokens) - 1) // bs * bs
    # Another salt keys the first block differently: no hit at all.
    assert m.add_sequence(3, tokens, cache_salt="other", lora_id=lora) == 0
    m.free(2)
    m.free(3)
    # A different prompt evicts the cached blocks; their removal names vLLM's hashes.
    m.add_sequence(4, [t + 1 for t in tokens], cache_salt=case["cache_salt"], lora_id=lora)
    m.allocate_slots(4, len(tokens))
    removed = [
        h.hex() for ev in m.take_events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes
    ]
    assert sorted(removed) == sorted(want)


def test_keys_vllm_cannot_express_are_rejected_unchanged() -> None:
    m = KVCacheManager(16, 4, hash_algo="sha256_cbor")
    with pytest.raises(kvblocks.InvalidArgumentError, match="register_lora"):
        m.add_sequence(1, [1, 2, 3, 4, 5], lora_id=9)
    with pytest.raises(kvblocks.InvalidArgumentError, match="UTF-8"):
        m.add_sequence(1, [1, 2, 3, 4, 5], cache_salt=b"\xff\xfe")
    assert len(m) == 0 and m.num_free_blocks() == 15
    m.register_lora(9, "adapter")
    assert m.add_sequence(1, [1, 2, 3, 4, 5], lora_id=9) == 0
    # A bytes salt that is UTF-8 is vLLM's str salt.
    m.add_sequence(2, [1, 2, 3, 4, 5], cache_salt=b"t")
    with pytest.raises(kvblocks.InvalidArgumentError, match="hash_seed"):
        KVCacheManager(16, 4, hash_seed="0")
    with pytest.raises(kvblocks.InvalidArgumentError):
        KVCacheManager(16, 4, hash_algo="sha256_cbor", hash_seed=0)  # type: ignore[arg-type]
    with pytest.raises(kvblocks.InvalidArgumentError):
        m.register_lora(-1, "x")
    with pytest.raises(kvblocks.InvalidArgumentError):
        m.register_lora(1, b"x")  # type: ignore[arg-type]


def test_register_lora_is_harmless_for_other_algorithms() -> None:
    m = KVCacheManager(16, 4)
    m.register_lora(3, "x", "/p")
    assert m.add_sequence(1, [1, 2, 3, 4, 5], lora_id=3) == 0
    assert m.add_sequence(2, [1, 2, 3, 4, 5], lora_id=4) == 0
