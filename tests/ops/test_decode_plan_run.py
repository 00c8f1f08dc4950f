"""DecodeAttention's host path end to end: plan -> device buffers -> packed launches.

The launcher executes each launch per the kernel ABI in torch, reading the buffers
through the raw addresses it was given (``decode_abi.py``), so what is checked is what a
kernel would see: the items and count in the plan buffer, the partial workspace, the
pointers and scalars in the argument list. A CUDA-graph replay is emulated by
re-issuing the launches recorded at "capture" after plan() rewrote the buffers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from decode_abi import AbiLauncher
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_cases import make_case, tolerance
from ops_cases import ref_decode as want

import kvblocks.ops as ops
from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import decode_plan, kernel_driver


def make_decoder(case, launcher, **kwargs):
    _, num_kv_heads, block_size, head_size = case.key_cache.shape
    args = {
        "num_heads": case.query.shape[1], "num_kv_heads": num_kv_heads,
        "head_size": head_size, "block_size": block_size, "dtype": case.query.dtype,
        "device": "cpu", "max_seqs": 8, "target_ctas": 64, "launcher": launcher,
        "min_chunk_tokens": 64,
    }  # fmt: skip
    args.update(kwargs)
    return ops.DecodeAttention(**args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (500, None), (None, 30.0)])
def test_mixed_lengths_gqa8(dtype, window, soft_cap):
    lens = [8192, 37, 1, 0, 300, 16]
    case = make_case(3, lens, [1] * len(lens), num_kv_heads=2, group=8, head_size=128,
                     dtype=dtype)  # fmt: skip
    launcher = AbiLauncher()
    dec = make_decoder(case, launcher, sliding_window=window, soft_cap=soft_cap)
    plan = dec.plan(np.array(lens, dtype=np.int32), case.block_tables)
    assert np.bincount(plan.items[:, 0])[0] > 1, "the 8k sequence is split"
    got = dec.run(case.query, case.key_cache, case.value_cache)
    torch.testing.assert_close(
        got, want(case, sliding_window=window, soft_cap=soft_cap), **tolerance(dtype)
    )
    names = [launch.name for launch in launcher.launches]
    assert names == [
        f"decode_attention_kernel<{'__half' if dtype == torch.float16 else '__nv_bfloat16'}, "
        "128, 16, 8>",
        f"merge_partials_kernel<{'__half' if dtype == torch.float16 else '__nv_bfloat16'}, 128>",
    ]
    assert launcher.launches[0].grid == (plan.num_items, 2, 1)


def test_unsplit_batch_launches_no_merge():
    lens = [40, 3, 100]
    case = make_case(4, lens, [1] * 3, num_kv_heads=2, group=4, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    launcher = AbiLauncher()
    dec = make_decoder(case, launcher, min_chunk_tokens=128)
    dec.plan(np.array(lens), case.block_tables)
    got = dec.run(case.query, case.key_cache, case.value_cache)
    torch.testing.assert_close(got, want(case), **tolerance(torch.float16))
    assert [launch.name.split("<")[0] for launch in launcher.launches] == [
        "decode_attention_kernel"
    ]


def test_graph_replay_with_longer_sequences_than_captured():
    """Capture with short lengths, then plan() longer ones and replay the same launches."""
    long_lens = [6000, 700, 2500, 0]
    case = make_case(5, long_lens, [1] * 4, num_kv_heads=2, group=8, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    launcher = AbiLauncher()
    dec = make_decoder(case, launcher, cuda_graph=True)
    out = torch.empty_like(case.query)
    short = np.array([50, 10, 60, 0], dtype=np.int32)
    assert dec.plan(short, case.block_tables).num_slots == 0, "captured without a split"
    dec.run(case.query, case.key_cache, case.value_cache, out=out)
    captured = list(launcher.launches)
    assert captured[0].grid[0] == dec.max_items and len(captured) == 2, "fixed grid + merge"
    short_case = make_case(5, long_lens, [1] * 4, num_kv_heads=2, group=8, head_size=64,
                           dtype=torch.bfloat16)  # fmt: skip
    short_case.seq_lens = torch.from_numpy(short)
    torch.testing.assert_close(out, want(short_case), **tolerance(torch.bfloat16))
    for lens in (np.array(long_lens, dtype=np.int32), short, np.array([3000, 3000, 1, 9])):
        dec.plan(lens, case.block_tables)
        out.fill_(float("nan"))
        for launch in captured:  # the replay: same kernels, same arguments
            launcher(launch)
        case.seq_lens = torch.from_numpy(lens.astype(np.int32))
        torch.testing.assert_close(out, want(case), **tolerance(torch.bfloat16))


def test_replay_without_graph_mode_would_drop_items():
    """The check above can fail: a non-graph launch sizes its grid to the captured plan."""
    long_lens = [6000, 700]
    case = make_case(6, long_lens, [1, 1], num_kv_heads=2, group=8, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    launcher = AbiLauncher()
    dec = make_decoder(case, launcher, cuda_graph=False)
    out = torch.empty_like(case.query)
    dec.plan(np.array([100, 700]), case.block_tables)
    dec.run(case.query, case.key_cache, case.value_cache, out=out)
    captured = list(launcher.launches)
    dec.plan(np.array(long_lens), case.block_tables)
    for launch in captured:
        launcher(launch)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, want(case), **tolerance(torch.float16))


def test_plans_are_cached_and_uploaded_once(monkeypatch):
    lens = [3000, 20]
    case = make_case(7, lens, [1, 1], num_kv_heads=2, group=4, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    dec = make_decoder(case, AbiLauncher())
    calls = {"plan": 0, "upload": 0}
    real_plan, real_upload = decode_plan.plan_decode, dec._upload

    def counting_plan(*a, **k):
        calls["plan"] += 1
        return real_plan(*a, **k)

    def counting_upload(items):
        calls["upload"] += 1
        real_upload(items)

    monkeypatch.setattr("kvblocks.ops.decode_attention.plan_decode", counting_plan)
    monkeypatch.setattr(dec, "_upload", counting_upload)
    a, b = np.array(lens), np.array([3001, 21])
    first = dec.plan(a, case.block_tables)
    for _ in range(3):  # the other layers of the step
        assert dec.plan(a.copy(), case.block_tables) is first
    assert calls == {"plan": 1, "upload": 1}
    dec.plan(b, case.block_tables)
    dec.plan(a, case.block_tables)  # seen before: no planning, one copy
    assert calls == {"plan": 2, "upload": 3}
    got = dec.run(case.query, case.key_cache, case.value_cache)
    torch.testing.assert_close(got, want(case), **tolerance(torch.float16))


def test_run_checks_its_arguments():
    lens = [30, 20]
    case = make_case(8, lens, [1, 1], num_kv_heads=2, group=4, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    dec = make_decoder(case, AbiLauncher())
    with pytest.raises(InvalidArgumentError, match="plan"):
        dec.run(case.query, case.key_cache, case.value_cache)
    dec.plan(np.array(lens), case.block_tables)
    q, kc, vc = case.query, case.key_cache, case.value_cache
    bad_calls = [
        (q[:1], kc, vc), (q.float(), kc, vc), (q.transpose(0, 1).contiguous(), kc, vc),
        (q, kc[:, :1].contiguous(), vc), (q, kc, vc.float()), (q, kc.transpose(2, 3), vc),
        ("q", kc, vc),
    ]  # fmt: skip
    for args in bad_calls:
        with pytest.raises(InvalidArgumentError):
            dec.run(*args)
    with pytest.raises(InvalidArgumentError):
        dec.run(q, kc, vc, out=torch.empty(3, 8, 64, dtype=torch.float16))
    for bad in (np.array([30]), np.array([30.0, 2.0]), np.array([30, 10_000]), [30, 20]):
        with pytest.raises(InvalidArgumentError):
            dec.plan(bad, case.block_tables)
    with pytest.raises(InvalidArgumentError):
        dec.plan(np.array(lens), case.block_tables.long())
    with pytest.raises(InvalidArgumentError):
        dec.plan(np.arange(9), torch.zeros(9, 4, dtype=torch.int32))  # over max_seqs
    with pytest.raises(InvalidArgumentError):
        make_decoder(case, AbiLauncher(), dtype=torch.float32)
    with pytest.raises(InvalidArgumentError):
        make_decoder(case, None)  # a CPU object needs a launcher
    # After all that, the object still works.
    got = dec.run(q, kc, vc)
    torch.testing.assert_close(got, want(case), **tolerance(torch.float16))


def test_scale_and_empty_batch():
    lens = [300, 5]
    case = make_case(9, lens, [1, 1], num_kv_heads=1, group=2, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    launcher = AbiLauncher()
    dec = make_decoder(case, launcher, scale=0.05)
    dec.plan(np.array(lens), case.block_tables)
    torch.testing.assert_close(
        dec.run(case.query, case.key_cache, case.value_cache), want(case, scale=0.05),
        **tolerance(torch.bfloat16),
    )  # fmt: skip
    launcher.launches.clear()
    dec.plan(np.zeros(0, dtype=np.int32), torch.zeros(0, 3, dtype=torch.int32))
    assert dec.run(case.query[:0], case.key_cache, case.value_cache).shape == (0, 2, 64)
    assert launcher.launches == []
    assert math.isclose(dec.scale, 0.05)


def test_functional_path_shares_one_plan_across_layers(monkeypatch):
    lens = [2500, 9, 0, 400]
    case = make_case(10, lens, [1] * 4, num_kv_heads=2, group=8, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    launcher = AbiLauncher()
    kernel_driver._DECODERS.clear()
    planned = []
    real = decode_plan.plan_decode
    monkeypatch.setattr(
        "kvblocks.ops.decode_attention.plan_decode",
        lambda *a, **k: planned.append(1) or real(*a, **k),
    )
    host = np.array(lens, dtype=np.int32)
    for _layer in range(3):
        got = kernel_driver.run_decode(
            launcher, case.query, case.key_cache, case.value_cache, case.block_tables, host,
            scale=None, sliding_window=None, soft_cap=None, target_ctas=16,
        )  # fmt: skip
        torch.testing.assert_close(got, want(case), **tolerance(torch.bfloat16))
    assert len(planned) == 1 and len(kernel_driver._DECODERS) == 1
    kernel_driver._DECODERS.clear()


@pytest.mark.parametrize("bad", [[3, 4], np.array([3.0, 4.0]), np.array([3]), np.array([[3, 4]])])
def test_front_end_rejects_a_bad_seq_lens_host(bad):
    case = make_case(11, [3, 4], [1, 1], num_kv_heads=1, group=2, head_size=64,
                     dtype=torch.float16)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="seq_lens_host"):
        ops.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                            case.seq_lens, seq_lens_host=bad)  # fmt: skip
    # On the CPU the reference runs; a valid host copy is accepted and changes nothing.
    got = ops.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                              case.seq_lens, seq_lens_host=np.array([3, 4]))  # fmt: skip
    torch.testing.assert_close(got, want(case))


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 3000), min_size=1, max_size=6), min_size=1, max_size=12),
    repeat=st.lists(st.integers(0, 11), max_size=8),
)
def test_plan_buffer_holds_the_current_plan(steps, repeat):
    """Whatever order plans arrive in (new, cached, repeated), the device buffer the kernel
    reads holds exactly the last plan: its count, items and merge ranges."""
    dec = ops.DecodeAttention(
        num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float16,
        device="cpu", max_seqs=6, target_ctas=16, launcher=AbiLauncher(), min_chunk_tokens=64,
    )  # fmt: skip
    order = [*steps, *[steps[i % len(steps)] for i in repeat]]
    for lens in order:
        arr = np.array(lens, dtype=np.int32)
        tables = torch.zeros((len(lens), 200), dtype=torch.int32)
        plan = dec.plan(arr, tables)
        buf = dec._plan_buf.numpy()
        assert buf[0] == plan.num_items
        items = buf[dec._items_at : dec._items_at + 4 * plan.num_items].reshape(-1, 4)
        assert np.array_equal(items, plan.items)
        indptr = buf[dec._indptr_at : dec._indptr_at + len(lens) + 1]
        assert np.array_equal(indptr, plan.merge_indptr)
        assert np.array_equal(plan.items, decode_plan.plan_decode(
            arr, target_items=dec.target_items, max_items=dec.max_items, min_chunk_tokens=64
        ).items)  # fmt: skip


def test_plan_keeps_a_temporary_block_table_alive():
    """The packed launch holds the table's address: a temporary passed to plan() must not
    be freed and its memory reused before run() (found by the KV-content oracle)."""
    lens = [300, 46, 54]
    case = make_case(12, lens, [1] * 3, num_kv_heads=2, group=2, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    dec = make_decoder(case, AbiLauncher())
    dec.plan(np.array(lens), case.block_tables.clone())
    junk = [torch.full_like(case.block_tables, 7) for _ in range(8)]  # reuses freed memory
    got = dec.run(case.query, case.key_cache, case.value_cache)
    torch.testing.assert_close(got, want(case), **tolerance(torch.bfloat16))
    assert len(junk) == 8


def test_run_takes_sinks_per_layer_and_checks_them():
    """``run(sinks=...)``: the layer's fp32 sink logits reach both launches by address (the
    ABI executor adds them where a row is normalized: merged rows and whole items alike);
    another layer's sinks or none share the step's plan; a bad tensor is refused by name."""
    lens = [2000, 37, 0]
    case = make_case(9, lens, [1] * 3, num_kv_heads=2, group=4, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    launcher = AbiLauncher()
    dec = make_decoder(case, launcher)
    dec.plan(np.array(lens), case.block_tables)
    for seed in (1, 2):
        sinks = torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 3
        got = dec.run(case.query, case.key_cache, case.value_cache, sinks=sinks)
        torch.testing.assert_close(got, want(case, sinks=sinks), **tolerance(torch.bfloat16))
        assert launcher.launches[-2].args[-1] == launcher.launches[-1].args[-1] == sinks.data_ptr()
    torch.testing.assert_close(dec.run(case.query, case.key_cache, case.value_cache),
                               want(case), **tolerance(torch.bfloat16))  # fmt: skip
    assert launcher.launches[-1].args[-1] == 0  # a null pointer: no sinks
    for bad in (sinks.half(), torch.zeros(4), torch.zeros(16)[::2], sinks.numpy()):
        with pytest.raises(InvalidArgumentError, match="sinks must be a contiguous float32"):
            dec.run(case.query, case.key_cache, case.value_cache, sinks=bad)
