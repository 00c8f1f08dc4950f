"""Record the KV events vLLM 0.33 publishes, with vLLM's own classes, as test vectors.

Run by hand, never by the tests (they read the JSON this writes). vLLM is imported for
real, not stubbed: its ``KVCacheManager`` (block pool, prefix cache, ``take_events``),
``Request`` with ``get_request_block_hasher(sha256_cbor)``, ``LoRARequest``, the msgspec
event structs and its ``ZmqEventPublisher`` compute and encode everything below. What it
took here (vLLM's wheel has ~100 dependencies; these are the ones the imported modules
need, torch and transformers coming from the kvblocks dev venv)::

    python3 -m venv /tmp/vllm-env
    /tmp/vllm-env/bin/pip install --no-deps vllm==0.33.0
    echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > /tmp/vllm-env/lib/python3.11/site-packages/zz_kvblocks.pth
    /tmp/vllm-env/bin/pip install msgspec pyzmq cbor2 psutil urllib3 aiohttp requests \\
        openai-harmony openai pybase64 cachetools cloudpickle uvloop prometheus_client
    /tmp/vllm-env/bin/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi starlette \\
        "fastapi<0.137" "llguidance<1.8" partial-json-parser
    /tmp/vllm-env/bin/python tests/events/data/record_vllm_events.py \\
        tests/events/data/vllm_events.json

Scenarios (each batch is one scheduler step's ``take_events()``, encoded as vLLM's
publisher encodes ``KVEventBatch(ts=1.5, events, data_parallel_rank=0)``, stored as hex;
once with int block hashes, vLLM's default, and once with bytes,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``):

* ``variants``: 80 prompts = 4 cache salts x 4 LoRA adapters x 5 prompt lengths, block
  size 4, each prefilled in one step then decoded 6 tokens one step at a time.
* ``evict_and_reset``: a request's cached blocks evicted by another's, then
  ``reset_prefix_cache``.
* ``sliding_window``: a sliding-window KV cache group (window 8 tokens).
* ``duplicates``: copies of cached blocks (``DUPLICATES``: the same prompt computed twice
  in one step and decoded alike, a prompt's last block recomputed while a copy is cached,
  copies evicted one at a time by other prompts, a preempted request resuming on what is
  left, ``reset_prefix_cache`` with copies cached), every step's batch, empty ones too.
* ``duplicate_claim``, ``step_order``, ``window_release``: three known differences of
  kvblocks from vLLM, in what it does rather than how it reports it (see
  ``DUPLICATE_CLAIM``, ``STEP_ORDER``, ``WINDOW_RELEASE``).
* ``replay``: the frames vLLM's ``ZmqEventPublisher`` answers a replay request with.

(The pins: vLLM 0.33.0 requires ``xgrammar==0.2.8`` (which imports ``tvm_ffi``),
``fastapi<0.137`` (later ones import opentelemetry) and ``llguidance<1.8``.)
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib.metadata import version
from typing import Any

BLOCK_SIZE = 4
TS = 1.5
SALTS: list[str | None] = [None, "", "s", "tenant-\u00fc"]
LORAS: list[dict[str, Any] | None] = [
    None,
    {"id": 1, "name": "my-lora", "path": "/p"},
    {"id": 2, "name": "chat-\u00fc", "path": "/adapters/chat-\u00fc"},
    {"id": 7, "name": "sql-adapter", "path": "/adapters/sql"},
]
PROMPT_LENS = [3, 4, 6, 8, 11]
DECODE = [901, 902, 903, 904, 905, 906]


def _vllm() -> dict[str, Any]:
    """vLLM's classes and functions used below (imports torch: slow)."""
    import torch
    from vllm.distributed import kv_events
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    kv_cache_utils.init_none_hash(sha256_cbor)
    return {
        "torch": torch,
        "kv_events": kv_events,
        "LoRARequest": LoRARequest,
        "SamplingParams": SamplingParams,
        "sha256_cbor": sha256_cbor,
        "kv_cache_utils": kv_cache_utils,
        "KVCacheManager": KVCacheManager,
        "FullAttentionSpec": FullAttentionSpec,
        "KVCacheConfig": KVCacheConfig,
        "KVCacheGroupSpec": KVCacheGroupSpec,
        "SlidingWindowSpec": SlidingWindowSpec,
        "Request": Request,
        "RequestStatus": RequestStatus,
    }


def _manager(v: dict[str, Any], num_blocks: int, window: int | None = None) -> Any:
    torch = v["torch"]
    if window is None:
        spec = v["FullAttentionSpec"](
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
        )
    else:
        spec = v["SlidingWindowSpec"](
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=8,
            dtype=torch.float16,
            sliding_window=window,
        )
    config = v["KVCacheConfig"](
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[v["KVCacheGroupSpec"](["layer.0"], spec)],
    )
    return v["KVCacheManager"](
        config,
        max_model_len=4096,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        enable_kv_cache_events=True,
    )


def _request(
    v: dict[str, Any],
    rid: str,
    tokens: list[int],
    salt: str | None,
    lora: dict[str, Any] | None,
    read_cache: bool = True,
) -> Any:
    lora_request = (
        None
        if lora is None
        else v["LoRARequest"](
            lora_name=lora["name"], lora_int_id=lora["id"], lora_path=lora["path"]
        )
    )
    return v["Request"](
        rid,
        list(tokens),
        v["SamplingParams"](
            max_tokens=64, **({} if read_cache else {"skip_reading_prefix_cache": True})
        ),
        None,
        lora_request=lora_request,
        cache_salt=salt,
        block_hasher=v["kv_cache_utils"].get_request_block_hasher(BLOCK_SIZE, v["sha256_cbor"]),
    )


def _batch(v: dict[str, Any], events: list[Any]) -> str:
    """One step's events as vLLM's publisher encodes them (msgpack, hex)."""
    import msgspec

    kv = v["kv_events"]
    batch = kv.KVEventBatch(ts=TS, events=events, data_parallel_rank=0)
    return msgspec.msgpack.Encoder().encode(batch).hex()


def _run_request(v: dict[str, Any], mgr: Any, req: Any, decode: list[int]) -> list[Any]:
    """Prefill ``req`` in one step, then decode ``decode`` one token a step, as vLLM's
    scheduler drives the manager; the non-empty ``take_events()`` of each step."""
    steps: list[Any] = []
    mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens) is not None
    steps.append(mgr.take_events())
    req.num_computed_tokens = req.num_tokens
    for tok in decode:
        req.append_output_token_ids(tok)
        assert mgr.allocate_slots(req, 1) is not None
        steps.append(mgr.take_events())
        req.num_computed_tokens += 1
    return steps


P10 = list(range(1, 11))
DUPLICATES: dict[str, Any] = {
    "num_blocks": 7,
    "requests": {
        "a": {"prompt": P10, "read_cache": True},
        # Skips the prefix cache, as vLLM does for a request with prompt logprobs: vLLM
        # caches a block when it is allocated, so its scheduler would give a second
        # prompt admitted in the same step a hit; kvblocks caches at commit, and computes
        # both (the same blocks twice) as vLLM does here.
        "b": {"prompt": P10, "read_cache": False},
        "c": {"prompt": [50, 51, 52], "read_cache": True},
        "d": {"prompt": [60, 61, 62], "read_cache": True},
        # a's tokens so far: hits its first 2 blocks, recomputes the 3rd (a prompt's
        # last token is always computed) while a's copy is cached.
        "e": {"prompt": [*P10, 901, 902], "read_cache": True},
        "f": {"prompt": list(range(70, 78)), "read_cache": True},
        "g": {"prompt": list(range(80, 89)), "read_cache": True},
        "i": {"prompt": P10, "read_cache": True},
        "j": {"prompt": P10, "read_cache": False},
    },
    # One scheduler step each: preempt (free, computed back to 0), run (prefill or
    # resume everything not computed, else one decode token; then append the sampled
    # token), free (finished), reset_prefix_cache. 6 usable blocks, so from step 4 on
    # every new block evicts the oldest free one.
    "steps": [
        {"run": [["a", 901], ["b", 901]]},  # both store h0, h1
        {"run": [["a", 902], ["b", 902]]},
        {"run": [["a", 903], ["b", 903]], "free": ["b"]},  # both store h2
        {"run": [["c", 950]]},  # evicts b's h2 (a's copy lives)
        {"run": [["d", 951]]},  # evicts b's h1
        {"run": [["e", 952]], "free": ["c", "d"]},  # e hits a's h0, h1; evicts b's h0
        {"preempt": ["a"], "run": [["e", 953]]},  # a's h2 block is free, h0, h1 e's
        {"run": [["f", 954]], "free": ["e"]},  # evicts a's h2 (e's copy lives)
        {"run": [["g", 955]], "free": ["f", "g"]},  # evicts e's h2 and h1: last copies
        {"run": [["a", 904]]},  # a resumes on h0, recomputes h1, h2
        {"free": ["a"], "reset": True},
        {"run": [["i", 901], ["j", 901]]},
        {"free": ["i", "j"], "reset": True},  # copies cached: one AllBlocksCleared
    ],
}


# Two known differences, recorded so the tests pin them (docs/events.md says why).
# A hit on a hash with copies: vLLM claims the oldest copy (a's, free), kvblocks one in
# use (b's), so a's copies stay free and are evicted before f's blocks.
DUPLICATE_CLAIM: dict[str, Any] = {
    "num_blocks": 10,
    "requests": {
        "a": {"prompt": P10, "read_cache": True},
        "b": {"prompt": P10, "read_cache": False},
        "e": {"prompt": P10, "read_cache": True},
        "f": {"prompt": list(range(70, 78)), "read_cache": True},
        "g": {"prompt": list(range(80, 89)), "read_cache": True},
    },
    "steps": [
        {"run": [["a", 901], ["b", 901]], "free": ["a"]},
        {"run": [["e", 901]]},
        {"run": [["f", 950]], "free": ["f"]},
        {"free": ["e"]},
        {"run": [["g", 951]]},  # vLLM evicts f's 2nd block, kvblocks a's h1 copy
    ],
}
# Two sequences in one step, the first filling a block and the second evicting: vLLM
# caches at allocation (Stored, then Removed), kvblocks at commit, after every
# allocation of the step (Removed, then Stored).
STEP_ORDER: dict[str, Any] = {
    "num_blocks": 4,
    "requests": {
        "a": {"prompt": [1, 2, 3], "read_cache": True},
        "f": {"prompt": list(range(70, 78)), "read_cache": True},
        "c": {"prompt": [50, 51, 52], "read_cache": True},
    },
    "steps": [
        {"run": [["a", 901]]},
        {"run": [["f", 950]], "free": ["f"]},
        {"run": [["a", 902], ["c", 903]]},
    ],
}

# A sliding-window group (5 tokens): the block a sequence's next query no longer sees is
# released by kvblocks at the commit that moved the window past it, by vLLM at the
# sequence's next allocation; freed in between, x's blocks queue behind a's in kvblocks,
# before it in vLLM, so c's block evicts a's first block in kvblocks, x's last in vLLM.
WINDOW_RELEASE: dict[str, Any] = {
    "num_blocks": 6,
    "sliding_window": 5,
    "requests": {
        "a": {"prompt": list(range(1, 10)), "read_cache": True},
        "x": {"prompt": list(range(70, 78)), "read_cache": True},
        "c": {"prompt": [50, 51, 52], "read_cache": True},
    },
    "steps": [
        {"run": [["a", 901], ["x", 950]], "free": ["x"]},
        {"run": [["c", 951]]},
        {"run": [["a", 952]]},
    ],
}


def _drive(v: dict[str, Any], scenario: dict[str, Any]) -> list[str]:
    """Run ``scenario``'s steps on vLLM's manager as its scheduler does; every step's
    ``take_events()`` batch, empty ones included."""
    mgr = _manager(v, num_blocks=scenario["num_blocks"], window=scenario.get("sliding_window"))
    status = v["RequestStatus"]
    reqs: dict[str, Any] = {}
    batches = []
    for step in scenario["steps"]:
        for rid in step.get("preempt", []):
            req = reqs[rid]
            mgr.free(req)
            req.status = status.PREEMPTED
            req.num_computed_tokens = 0
        scheduled = []
        for rid, tok in step.get("run", []):
            if rid not in reqs:
                spec = scenario["requests"][rid]
                reqs[rid] = _request(v, rid, spec["prompt"], None, None, spec["read_cache"])
            req = reqs[rid]
            if req.num_computed_tokens == 0:
                blocks, hit, _ = mgr.get_computed_blocks(req)
                n = req.num_tokens - hit
                assert mgr.allocate_slots(req, n, hit, blocks) is not None
                req.num_computed_tokens = hit
                req.status = status.RUNNING
            else:
                n = req.num_tokens - req.num_computed_tokens
                assert mgr.allocate_slots(req, n) is not None
            scheduled.append((req, n, tok))
        for req, n, tok in scheduled:
            req.num_computed_tokens += n
            if tok is not None:
                req.append_output_token_ids(tok)
        for rid in step.get("free", []):
            mgr.free(reqs.pop(rid))
        if step.get("reset"):
            assert mgr.reset_prefix_cache()
        batches.append(_batch(v, mgr.take_events()))
    return batches


def _scenarios(v: dict[str, Any]) -> dict[str, Any]:
    variants = []
    for salt in SALTS:
        for lora in LORAS:
            for n in PROMPT_LENS:
                mgr = _manager(v, num_blocks=32)
                prompt = [100 + 7 * i for i in range(n)]
                req = _request(v, "r", prompt, salt, lora)
                steps = _run_request(v, mgr, req, DECODE)
                variants.append(
                    {
                        "cache_salt": salt,
                        "lora": lora,
                        "prompt": prompt,
                        "decode": DECODE,
                        "batches": [_batch(v, ev) for ev in steps if ev],
                    }
                )

    # 5 blocks, the null block included: B's 4 blocks evict all of A's cached ones.
    mgr = _manager(v, num_blocks=5)
    a = _request(v, "a", list(range(1, 9)), None, None)
    batches = [_run_request(v, mgr, a, [])[0]]
    mgr.free(a)
    b = _request(v, "b", list(range(50, 66)), None, None)
    batches.append(_run_request(v, mgr, b, [])[0])
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    batches.append(mgr.take_events())
    evict = {
        "num_blocks": 5,
        "prompts": [list(range(1, 9)), list(range(50, 66))],
        "batches": [_batch(v, ev) for ev in batches],
    }

    mgr = _manager(v, num_blocks=32, window=8)
    sw = _request(v, "w", list(range(1, 14)), None, None)
    window = {
        "sliding_window": 8,
        "prompt": list(range(1, 14)),
        "decode": DECODE,
        "batches": [_batch(v, ev) for ev in _run_request(v, mgr, sw, DECODE) if ev],
    }
    return {
        "variants": variants,
        "evict_and_reset": evict,
        "sliding_window": window,
        **{
            name: {**scenario, "batches": _drive(v, scenario)}
            for name, scenario in (
                ("duplicates", DUPLICATES),
                ("duplicate_claim", DUPLICATE_CLAIM),
                ("step_order", STEP_ORDER),
                ("window_release", WINDOW_RELEASE),
            )
        },
    }


def _replay(v: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's ZmqEventPublisher answers a DEALER's replay request with."""
    import zmq

    kv = v["kv_events"]
    pub = kv.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@pod",
    )
    try:
        batch = kv.KVEventBatch(ts=TS, events=[kv.AllBlocksCleared()], data_parallel_rank=0)
        pub.publish(batch)
        time.sleep(0.5)  # the publisher thread sends and buffers it
        endpoint = pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            frames = dealer.recv_multipart()
            replies.append([f.hex() for f in frames])
            if frames[-2] == kv.ZmqEventPublisher.END_SEQ:
                break
        dealer.close(linger=0)
    finally:
        pub.shutdown()
    return {"topic": "kv@pod", "request": ["", (0).to_bytes(8, "big").hex()], "replies": replies}


def main(out: str) -> None:
    """Record every scenario with both hash formats and write the JSON."""
    v = _vllm()
    doc: dict[str, Any] = {
        "source": f"vllm {version('vllm')}: vllm.v1.core.kv_cache_manager.KVCacheManager "
        "with vllm.v1.request.Request (sha256_cbor), vllm.distributed.kv_events "
        "(recorded by record_vllm_events.py)",
        "block_size": BLOCK_SIZE,
        "ts": TS,
        "hash_formats": {},
    }
    saved = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    try:
        for name, flag in (("int", "1"), ("bytes", "0")):
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = flag
            doc["hash_formats"][name] = _scenarios(v)
    finally:
        if saved is None:
            os.environ.pop("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)
        else:
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = saved
    doc["replay"] = _replay(v)
    with open(out, "w") as f:
        json.dump(doc, f, indent=None, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
