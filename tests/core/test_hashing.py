"""``kvblocks.hashing``: the core's block hashes of a whole prompt in one call.

Checked against the two things they must equal: the manager's own hashes (its
``BlockStored`` events for the same prompt, salt and LoRA, every algorithm and seed) and
vLLM 0.33's ``sha256_cbor`` vectors recorded from its wheel (``data/``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvblocks
from kvblocks import KVCacheManager
from kvblocks.hashing import BlockHasher, low64

ALGOS = ["blake3", "xxh3_128", "sha256_cbor"]
VECTORS = json.loads((Path(__file__).parent / "data" / "vllm_sha256_cbor_hashes.json").read_text())


def manager_hashes(m: KVCacheManager, tokens: Any, **kw: Any) -> list[bytes]:
    """The hashes the manager's ``BlockStored`` events give the prompt's full blocks."""
    m.take_events()
    m.add_sequence(99, tokens, **kw)
    n = len(tokens)
    assert m.allocate_slots(99, n) is not None
    m.commit(99, n)
    out = [
        h for e in m.take_events() if isinstance(e, kvblocks.BlockStored) for h in e.block_hashes
    ]
    m.free(99)
    assert m.reset_prefix_cache()  # the next prompt stores (and reports) every block
    m.take_events()
    return out


@pytest.mark.parametrize(
    ("algo", "seed"),
    [("blake3", None), ("xxh3_128", None), ("sha256_cbor", None), ("sha256_cbor", "0"),
     ("sha256_cbor", "fleet-7")],
)  # fmt: skip
def test_hashes_equal_the_manager_s_events(algo: str, seed: str | None) -> None:
    rng = np.random.default_rng(3)
    bs = 16
    m = KVCacheManager(80, bs, hash_algo=algo, hash_seed=seed)  # type: ignore[arg-type]
    hasher = BlockHasher(bs, hash_algo=algo, hash_seed=seed)  # type: ignore[arg-type]
    for h in (hasher, m):
        h.register_lora(3, "sql-adapter", "/adapters/sql")
        h.register_lora(4, "chat-\u00fc")
    copy = m.block_hasher()
    assert (copy.block_size, copy.hash_algo, copy.none_hash) == (bs, algo, m.none_hash)
    assert hasher.none_hash == m.none_hash
    for kw in ({}, {"cache_salt": "tenant-a"}, {"lora_id": 3}, {"cache_salt": "s", "lora_id": 4}):
        for n in (0, 15, 16, 47, 160, 333):
            tokens = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.int64)
            want = manager_hashes(m, tokens, **kw)
            assert len(want) == n // bs
            assert hasher.block_hashes(tokens, **kw) == want, (kw, n)
            assert copy.block_hashes(list(map(int, tokens)), **kw) == want, (kw, n)


def test_hashes_equal_vllm_s_recorded_sha256_cbor() -> None:
    cases = VECTORS["cases"]
    assert len(cases) >= 20
    for case in cases:
        seed = case["seed"]
        h = BlockHasher(case["block_size"], hash_algo="sha256_cbor", hash_seed=seed)
        assert h.none_hash.hex() == VECTORS["none_hash"][str(seed)]  # type: ignore[union-attr]
        lora_id = None
        if case["lora"] is not None:
            lora = case["lora"]
            h.register_lora(lora["id"], lora["name"], lora["path"])
            lora_id = lora["id"]
        got = h.block_hashes(case["tokens"], cache_salt=case["cache_salt"], lora_id=lora_id)
        assert [d.hex() for d in got] == case["block_hashes"], case


def test_the_manager_s_copy_carries_its_seed_and_loras() -> None:
    """The manager's copy hashes with its seed and LoRAs; a default hasher would not (the
    router's old scratch-manager hasher ignored both)."""
    m = KVCacheManager(16, 4, hash_algo="sha256_cbor", hash_seed="12345")
    m.register_lora(9, "my-lora", "/p")
    tokens = list(range(12))
    want = manager_hashes(m, tokens, lora_id=9, cache_salt="s")
    assert m.block_hasher().block_hashes(tokens, lora_id=9, cache_salt="s") == want
    assert BlockHasher(4, hash_algo="sha256_cbor", hash_seed="12345").block_hashes(tokens) != want
    # A copy: a LoRA registered afterwards is not in it.
    copy = m.block_hasher()
    m.register_lora(10, "late")
    with pytest.raises(kvblocks.InvalidArgumentError, match="register_lora"):
        copy.block_hashes(tokens, lora_id=10)
    assert len(m.block_hasher().block_hashes(tokens, lora_id=10)) == 3


def test_pythonhashseed_seeds_sha256_cbor_as_the_manager_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    h = BlockHasher(4, hash_algo="sha256_cbor")
    assert h.none_hash is not None and h.none_hash.hex() == VECTORS["none_hash"]["0"]
    assert h.none_hash == KVCacheManager(4, 4, hash_algo="sha256_cbor").none_hash
    assert BlockHasher(4).none_hash is None


def test_block_size_bound_is_the_managers() -> None:
    """2**20 tokens per block, the manager's largest, hashes; one more is refused above."""
    KVCacheManager(2, 2**20)
    assert len(BlockHasher(2**20).block_hashes(np.arange(2**20 + 5, dtype=np.int64))) == 1
    with pytest.raises(kvblocks.InvalidArgumentError, match="block_size"):
        KVCacheManager(2, 2**20 + 1)


def test_low64_is_vllm_s_int_form() -> None:
    digest = bytes(range(32))
    assert low64(digest) == int.from_bytes(digest, "big") & (2**64 - 1)


@pytest.mark.parametrize(
    ("make", "call", "match"),
    [
        (lambda: BlockHasher(0), None, "block_size"),
        (lambda: BlockHasher(-1), None, "block_size"),
        (lambda: BlockHasher(True), None, "block_size"),
        (lambda: BlockHasher(2**20 + 1), None, r"block_size must be in \[1, 2\*\*20\]"),
        (lambda: BlockHasher(4, hash_algo="md5"), None, "hash_algo"),  # type: ignore[arg-type]
        (lambda: BlockHasher(4, hash_seed=3), None, "hash_seed"),  # type: ignore[arg-type]
        (lambda: BlockHasher(4, hash_seed="0"), None, "hash_seed"),  # blake3 has no seed
        (lambda: BlockHasher(4), lambda h: h.block_hashes([1, -2, 3, 4]), "token_ids"),
        (lambda: BlockHasher(4), lambda h: h.block_hashes([2**32]), "token_ids"),
        (lambda: BlockHasher(4), lambda h: h.block_hashes(np.zeros((2, 4), np.int64)), "token_ids"),
        (lambda: BlockHasher(4), lambda h: h.block_hashes("abcd"), "token_ids"),
        (lambda: BlockHasher(4), lambda h: h.block_hashes([1], cache_salt=3), "cache_salt"),
        (lambda: BlockHasher(4), lambda h: h.block_hashes([1], lora_id=-1), "lora_id"),
        (
            lambda: BlockHasher(4, hash_algo="sha256_cbor"),
            lambda h: h.block_hashes([1, 2, 3, 4], lora_id=1),
            "register_lora",
        ),
        (
            lambda: BlockHasher(4, hash_algo="sha256_cbor"),
            lambda h: h.block_hashes([1, 2, 3, 4], cache_salt=b"\xff"),
            "UTF-8",
        ),
    ],
)
def test_bad_input_is_named_and_the_hasher_keeps_working(make: Any, call: Any, match: str) -> None:
    if call is None:
        with pytest.raises(kvblocks.InvalidArgumentError, match=match):
            make()
        return
    h = make()
    before = h.block_hashes(list(range(8)))
    with pytest.raises(kvblocks.InvalidArgumentError, match=match):
        call(h)
    assert h.block_hashes(list(range(8))) == before


def test_threads_share_a_hasher() -> None:
    h = BlockHasher(16, hash_algo="sha256_cbor")
    prompts = [np.arange(i, i + 4000) % 50_000 for i in range(8)]
    want = [h.block_hashes(p) for p in prompts]
    got: dict[int, list[bytes]] = {}

    def work(i: int) -> None:
        for _ in range(5):
            got[i] = h.block_hashes(prompts[i], cache_salt=None)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(8)] == want


def test_long_prompts_hash_with_the_gil_released() -> None:
    """While one thread hashes a huge prompt, the main thread keeps running Python; if
    ``block_hashes`` held the GIL, the loop below would count (almost) nothing."""
    h = BlockHasher(16, hash_algo="sha256_cbor")
    prompt = np.arange(1 << 21, dtype=np.int64) % 50_000
    started, done = threading.Event(), threading.Event()
    result: list[list[bytes]] = []
    ticks = 0

    def hash_prompt() -> None:
        started.set()
        result.append(h.block_hashes(prompt))
        done.set()

    t = threading.Thread(target=hash_prompt)
    t0 = time.perf_counter()
    t.start()
    started.wait()
    while not done.is_set():
        ticks += 1
    t.join()
    assert len(result[0]) == (1 << 21) // 16
    assert ticks > 100, f"{ticks} ticks in {time.perf_counter() - t0:.2f} s"


@pytest.mark.parametrize("digest", ["ab", None, 5, [1, 2], np.array([1, 2]), np.uint64(3)])
def test_low64_refuses_what_is_no_digest(digest: object) -> None:
    # A list or an array of ints was read as bytes (a made-up hash); others raised bare
    # TypeError or IndexError.
    with pytest.raises(kvblocks.InvalidTypeError, match="digest"):
        low64(digest)  # type: ignore[arg-type]
