"""Record vLLM's own ``sha256_cbor`` block hashes as test vectors for kvblocks.

Run by hand, never by the tests (they read the JSON this writes)::

    pip download vllm --no-deps -d /tmp/vllm   # a wheel; only two modules are used
    pip install --target /tmp/pylib cbor2
    PYTHONPATH=/tmp/pylib python tests/core/data/record_vllm_hashes.py \
        /tmp/vllm/vllm-*.whl tests/core/data/vllm_sha256_cbor_hashes.json

The script loads ``vllm/utils/hashing.py`` and ``vllm/v1/core/kv_cache_utils.py``
straight from the wheel (the rest of vLLM — torch, CUDA — is not needed, so the imports
those two modules make are stubbed) and calls vLLM's ``init_none_hash`` and
``get_request_block_hasher`` on requests built here: vLLM computes every hash below.
"""

from __future__ import annotations

import json
import os
import sys
import types
import zipfile
from typing import Any

HASHING = "vllm/utils/hashing.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"


class _StubModule(types.ModuleType):
    """A module whose every attribute is a placeholder class (for ``from x import y``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _load_vllm(wheel: str) -> tuple[types.ModuleType, types.ModuleType]:
    """Import vLLM's hashing and kv_cache_utils modules from the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        sources = {name: zf.read(name).decode() for name in (HASHING, KV_CACHE_UTILS)}
        version = next(
            (n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA")),
            "unknown",
        )
    for name in (
        "vllm",
        "vllm.envs",
        "vllm.config",
        "vllm.multimodal",
        "vllm.multimodal.utils",
        "vllm.utils",
        "vllm.utils.math_utils",
        "vllm.v1",
        "vllm.v1.core",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.kv_cache_spec_registry",
        "vllm.v1.request",
        "vllm.v1.utils",
    ):
        sys.modules[name] = _StubModule(name)
    logger_mod = types.ModuleType("vllm.logger")
    logger_mod.init_logger = lambda name: __import__("logging").getLogger(name)  # type: ignore[attr-defined]
    sys.modules["vllm.logger"] = logger_mod
    modules = []
    for modname, path in (
        ("vllm.utils.hashing", HASHING),
        ("vllm.v1.core.kv_cache_utils", KV_CACHE_UTILS),
    ):
        mod = types.ModuleType(modname)
        mod.__file__ = path
        sys.modules[modname] = mod
        exec(compile(sources[path], path, "exec"), mod.__dict__)
        modules.append(mod)
    hashing, kcu = modules
    hashing.vllm_version = version  # type: ignore[attr-defined]
    return hashing, kcu


def _request(tokens: list[int], cache_salt: str | None, lora: dict[str, str] | None) -> Any:
    """The fields of vLLM's ``Request`` that the block hasher reads."""
    lora_request = (
        None
        if lora is None
        else types.SimpleNamespace(
            lora_name=lora["name"], lora_path=lora["path"], lora_int_id=lora["id"]
        )
    )
    return types.SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=list(tokens),
        mm_features=[],
        lora_request=lora_request,
        cache_salt=cache_salt,
        prompt_embeds=None,
    )


def _cases() -> list[dict[str, Any]]:
    """Prompts, block sizes, LoRA adapters and cache salts to record."""
    edge = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**32 - 1]
    ramp = list(range(1000, 1000 + 37))
    lora_a = {"id": 1, "name": "sql-adapter", "path": "/adapters/sql"}
    lora_b = {"id": 2, "name": "chat-ü", "path": ""}
    cases = []
    for seed in (None, "0", "12345"):
        for block_size, tokens in (
            (4, edge),
            (16, ramp),
            (1, [7, 7, 7]),
            (16, ramp[:15]),
            (8, ramp),
        ):
            cases.append(
                dict(block_size=block_size, tokens=tokens, cache_salt=None, lora=None, seed=seed)
            )
        cases.append(dict(block_size=4, tokens=edge, cache_salt="tenant-a", lora=None, seed=seed))
        cases.append(dict(block_size=16, tokens=ramp, cache_salt=None, lora=lora_a, seed=seed))
        cases.append(dict(block_size=8, tokens=ramp, cache_salt="s" * 30, lora=lora_b, seed=seed))
    # An empty salt is no salt in vLLM (``if ... and request.cache_salt``).
    cases.append(dict(block_size=4, tokens=edge, cache_salt="", lora=None, seed=None))
    cases.append(dict(block_size=4, tokens=edge, cache_salt="x" * 300, lora=None, seed=None))
    return cases


def main(wheel: str, out: str) -> None:
    """Record every case with vLLM's own functions and write the JSON vectors."""
    hashing, kcu = _load_vllm(wheel)
    saved = os.environ.pop("PYTHONHASHSEED", None)
    records = []
    none_hashes = {}
    try:
        for case in _cases():
            if case["seed"] is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = case["seed"]
            kcu.init_none_hash(hashing.sha256_cbor)
            none_hashes[str(case["seed"])] = kcu.NONE_HASH.hex()
            hasher = kcu.get_request_block_hasher(case["block_size"], hashing.sha256_cbor)
            hashes = hasher(_request(case["tokens"], case["cache_salt"], case["lora"]))
            records.append({**case, "block_hashes": [h.hex() for h in hashes]})
    finally:
        os.environ.pop("PYTHONHASHSEED", None)
        if saved is not None:
            os.environ["PYTHONHASHSEED"] = saved
    doc = {
        "source": f"{hashing.vllm_version}: vllm.v1.core.kv_cache_utils.get_request_block_hasher "
        "with vllm.utils.hashing.sha256_cbor (recorded by record_vllm_hashes.py)",
        "default_seed": kcu.DEFAULT_NONE_HASH_SEED,
        "none_hash": none_hashes,
        "cases": records,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
