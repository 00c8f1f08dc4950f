"""The tensor-core decode instantiations of the ``opt`` emulator build, by optimization level.

The ``opt`` build (emu_runtime.py) holds every instantiation: three tests check each one's
shared memory against the host planner's formula, and a test may launch any of them. But
g++ -O2 spends about 16 CPU-s per 105 decode instantiations, and the suite launches 49 of
the 210 (measured by logging every ``emu_launch`` over the whole suite, 2026-11-29): those
are compiled at -O2 in one shard, the rest at -O0 in another (~6 CPU-s for those 161
against ~16 per 105 at -O2). A kernel missing from :data:`HOT` still runs, checked against the
reference like any other (test_decode_kernel_emu.py launches one, ``COLD``), only slower; add
it here if a test comes to launch it often.
"""

from __future__ import annotations

from sanitized_kernels import kernel_entries

#: The decode-shard kernels the suite launches: compiled at -O2.
HOT: tuple[str, ...] = (
    "decode_attention_kernel<__half, 112, 8, 4>",
    "decode_attention_kernel<__half, 128, 16, 16>",
    "decode_attention_kernel<__half, 128, 16, 4>",
    "decode_attention_kernel<__half, 128, 16, 8>",
    "decode_attention_kernel<__half, 128, 32, 8>",
    "decode_attention_kernel<__half, 128, 8, 8>",
    "decode_attention_kernel<__half, 256, 16, 8, 1>",
    "decode_attention_kernel<__half, 256, 16, 8>",
    "decode_attention_kernel<__half, 256, 32, 1, 1>",
    "decode_attention_kernel<__half, 256, 32, 4>",
    "decode_attention_kernel<__half, 256, 8, 4, 1>",
    "decode_attention_kernel<__half, 64, 16, 16>",
    "decode_attention_kernel<__half, 64, 16, 1>",
    "decode_attention_kernel<__half, 64, 16, 2>",
    "decode_attention_kernel<__half, 64, 16, 4>",
    "decode_attention_kernel<__half, 64, 32, 1>",
    "decode_attention_kernel<__half, 64, 32, 4>",
    "decode_attention_kernel<__half, 64, 8, 1>",
    "decode_attention_kernel<__half, 64, 8, 4>",
    "decode_attention_kernel<__half, 64, 8, 8>",
    "decode_attention_kernel<__half, 80, 16, 2>",
    "decode_attention_kernel<__half, 96, 32, 16>",
    "decode_attention_kernel<__nv_bfloat16, 112, 8, 4>",
    "decode_attention_kernel<__nv_bfloat16, 128, 16, 4>",
    "decode_attention_kernel<__nv_bfloat16, 128, 16, 8>",
    "decode_attention_kernel<__nv_bfloat16, 128, 32, 8>",
    "decode_attention_kernel<__nv_bfloat16, 128, 8, 8>",
    "decode_attention_kernel<__nv_bfloat16, 256, 16, 8, 1>",
    "decode_attention_kernel<__nv_bfloat16, 256, 16, 8>",
    "decode_attention_kernel<__nv_bfloat16, 256, 32, 1, 1>",
    "decode_attention_kernel<__nv_bfloat16, 256, 32, 4>",
    "decode_attention_kernel<__nv_bfloat16, 256, 8, 4, 1>",
    "decode_attention_kernel<__nv_bfloat16, 64, 16, 1>",
    "decode_attention_kernel<__nv_bfloat16, 64, 16, 2>",
    "decode_attention_kernel<__nv_bfloat16, 64, 16, 4>",
    "decode_attention_kernel<__nv_bfloat16, 64, 16, 8>",
    "decode_attention_kernel<__nv_bfloat16, 64, 32, 1>",
    "decode_attention_kernel<__nv_bfloat16, 64, 32, 4>",
    "decode_attention_kernel<__nv_bfloat16, 64, 8, 1>",
    "decode_attention_kernel<__nv_bfloat16, 64, 8, 4>",
    "decode_attention_kernel<__nv_bfloat16, 64, 8, 8>",
    "decode_attention_kernel<__nv_bfloat16, 80, 16, 2>",
    "decode_attention_kernel<__nv_bfloat16, 96, 32, 16>",
    "merge_partials_kernel<__half, 128>",
    "merge_partials_kernel<__half, 256>",
    "merge_partials_kernel<__half, 64>",
    "merge_partials_kernel<__nv_bfloat16, 128>",
    "merge_partials_kernel<__nv_bfloat16, 256>",
    "merge_partials_kernel<__nv_bfloat16, 64>",
)

_DTYPES = ("__half", "__nv_bfloat16")
_BLOCKS = (8, 16, 32)
_GROUPS = (1, 2, 4, 8)


def every_kernel() -> list[str]:
    """Every instantiation of harness.cpp's decode shards (its KVB_DECODE_ALL, both dtypes):
    for head sizes up to 128, each block size with GROUP 1-8 and 16; for 256, GROUP 1-8
    with two K/V buffers and with one (STAGES 1); the merge of each head size.

    Written out, not ``cuda_sources.kernel_names(DECODE_SOURCE)``: ``make test-fast``
    builds the emulator while uv is still installing torch, which that module imports
    (test_decode_kernel_emu.py checks that the two lists agree)."""
    names = []
    for t in _DTYPES:
        for d in (64, 80, 96, 112, 128):
            for b in _BLOCKS:
                names += [f"decode_attention_kernel<{t}, {d}, {b}, {g}>" for g in _GROUPS]
            names += [f"decode_attention_kernel<{t}, {d}, {b}, 16>" for b in _BLOCKS]
            names.append(f"merge_partials_kernel<{t}, {d}>")
        for stages in ("", ", 1"):
            for b in _BLOCKS:
                names += [f"decode_attention_kernel<{t}, 256, {b}, {g}{stages}>" for g in _GROUPS]
        names.append(f"merge_partials_kernel<{t}, 256>")
    return names


def shard_headers() -> tuple[str, str]:
    """harness.cpp's KVB_EMU_DECODE_ENTRIES lines of the -O2 shard (:data:`HOT`) and of the
    -O0 shard (the rest of :func:`every_kernel`)."""
    every = every_kernel()
    unknown = sorted(set(HOT) - set(every))
    if unknown:
        raise ValueError(f"not decode-shard instantiations: {unknown}")
    hot = set(HOT)
    return (
        kernel_entries([n for n in every if n in hot]),
        kernel_entries([n for n in every if n not in hot]),
    )
