"""Hostile arguments to the ops' Python front-ends, on CPU tensors.

Each row is a call with one bad argument; it must raise InvalidArgumentError naming that
argument (never an AttributeError, OverflowError, a torch error from inside, or silent
acceptance), and a DecodeAttention that rejected a call must still run its last plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_abi import AbiLauncher
from ops_cases import make_case, ref_decode, ref_prefill, tolerance

import kvblocks.ops as ops
from kvblocks.errors import InvalidArgumentError
from kvblocks.ops import prefill_launch as pl
from kvblocks.ops.decode_plan import plan_decode

BIG = 2**70
NAN = float("nan")
INF = float("inf")

# One decode case (fp16, GQA 2, two sequences) shared by every row: rows only read it.
CASE = make_case(7, [20, 40], [1, 1], num_kv_heads=2, group=2, head_size=64,
                 dtype=torch.float16)  # fmt: skip
PREFILL = make_case(8, [20, 40], [3, 2], num_kv_heads=2, group=2, head_size=64,
                    dtype=torch.float16)  # fmt: skip


def _decode(**kw):
    args = {
        "query": CASE.query, "key_cache": CASE.key_cache, "value_cache": CASE.value_cache,
        "block_tables": CASE.block_tables, "seq_lens": CASE.seq_lens,
    }  # fmt: skip
    args.update(kw)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
    positional = [args.pop(k) for k in names]
    return ops.paged_attention(*positional, **args)


def _prefill(**kw):
    names = ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")
    args = {name: getattr(PREFILL, name) for name in names}
    args.update(kw)
    positional = [args.pop(k) for k in names]
    return ops.paged_prefill_attention(*positional, **args)


def _decoder(**kw):
    args = {
        "num_heads": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16,
        "dtype": torch.float16, "device": "cpu", "max_seqs": 4, "launcher": AbiLauncher(),
    }  # fmt: skip
    args.update(kw)
    return ops.DecodeAttention(**args)


_PLAN = {"dtype": torch.float16, "head_size": 64, "num_heads": 4, "num_kv_heads": 2,
         "num_seqs": 2, "max_query_len": 5}  # fmt: skip
_LAUNCH = {
    "out": 16, "query": 16, "key_cache": 16, "value_cache": 16, "block_tables": 16,
    "seq_lens": 16, "query_start_loc": 16, "num_tokens": 5, "num_heads": 4,
    "num_kv_heads": 2, "block_size": 16, "max_blocks": 4, "num_blocks": 8, "scale": 0.125,
    "soft_cap": None, "sliding_window": None,
}  # fmt: skip


def _launch(**kw):
    return pl.prefill_launch(pl.plan_prefill(**_PLAN), **{**_LAUNCH, **kw})


_CACHES = ops.allocate_kv_cache(1, 6, 16, 2, 64, torch.float32, "cpu")
_BLOCKS = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)


def _alloc(**kw):
    args = {"num_layers": 1, "num_blocks": 4, "block_size": 16, "num_kv_heads": 2,
            "head_size": 64, "dtype": torch.float16, "device": "cpu"}  # fmt: skip
    return ops.allocate_kv_cache(**{**args, **kw})


def _swap_within(mapping):
    """``swap_blocks`` with ``src`` and ``dst`` the same tensor; must leave it unchanged."""
    cache = _BLOCKS.clone()
    try:
        ops.swap_blocks(cache, cache, mapping)
    finally:
        assert torch.equal(cache, _BLOCKS)


def _swap_views(shift, mapping):
    """``swap_blocks`` between two views of one storage ``shift`` elements apart."""
    flat = _BLOCKS.clone().reshape(-1)
    ops.swap_blocks(flat[:40].view(5, 8), flat[shift : 40 + shift].view(5, 8), mapping)


LENS = np.array([5, 300], dtype=np.int32)
NOT_TENSOR = CASE.key_cache.numpy()

# (row id, call, a word the message must contain)
ROWS = [
    # paged_attention / paged_prefill_attention
    ("pa key_cache None", lambda: _decode(key_cache=None), "key_cache"),
    ("pa value_cache ndarray", lambda: _decode(value_cache=NOT_TENSOR), "value_cache"),
    ("pa sliding_window True", lambda: _decode(sliding_window=True), "sliding_window"),
    ("pa sliding_window 0", lambda: _decode(sliding_window=0), "sliding_window"),
    ("pa sliding_window -1", lambda: _decode(sliding_window=-1), "sliding_window"),
    ("pa sliding_window 2^70", lambda: _decode(sliding_window=BIG), "sliding_window"),
    ("pa scale nan", lambda: _decode(scale=NAN), "scale"),
    ("pa scale str", lambda: _decode(scale="0.1"), "scale"),
    ("pa scale True", lambda: _decode(scale=True), "scale"),
    ("pa soft_cap inf", lambda: _decode(soft_cap=INF), "soft_cap"),
    ("pa soft_cap str", lambda: _decode(soft_cap="30"), "soft_cap"),
    ("pa sinks list", lambda: _decode(sinks=[0.0] * 4), "sinks"),
    ("pa sinks per kv head", lambda: _decode(sinks=torch.zeros(2)), "sinks"),
    ("pa sinks 2-D", lambda: _decode(sinks=torch.zeros(1, 4)), "sinks"),
    ("pa sinks int", lambda: _decode(sinks=torch.zeros(4, dtype=torch.int32)), "sinks"),
    ("pa sinks nan", lambda: _decode(sinks=torch.tensor([0.0, NAN, 0.0, 0.0])), "sinks"),
    ("pa sinks inf", lambda: _decode(sinks=torch.tensor([0.0, 0.0, INF, 0.0])), "sinks"),
    ("pa sinks on meta", lambda: _decode(sinks=torch.zeros(4, device="meta")), "sinks"),
    ("pp sinks per kv head", lambda: _prefill(sinks=torch.zeros(2)), "sinks"),
    ("pa seq_lens_host short", lambda: _decode(seq_lens_host=np.array([20])), "seq_lens_host"),
    (
        "pa seq_lens_host float",
        lambda: _decode(seq_lens_host=np.array([20.0, 40.0])),
        "seq_lens_host",
    ),
    ("pa seq_lens_host list", lambda: _decode(seq_lens_host=[20, 40]), "seq_lens_host"),
    ("pa seq_lens int64", lambda: _decode(seq_lens=CASE.seq_lens.long()), "seq_lens"),
    (
        "pa block_tables noncontiguous",
        lambda: _decode(block_tables=CASE.block_tables.t().contiguous().t()),
        "block_tables",
    ),
    (
        "pa key_cache noncontiguous",
        lambda: _decode(key_cache=CASE.key_cache.transpose(0, 1)),
        "key_cache",
    ),
    ("pa query on meta", lambda: _decode(query=CASE.query.to("meta")), "query"),
    ("pp sliding_window True", lambda: _prefill(sliding_window=True), "sliding_window"),
    ("pp key_cache None", lambda: _prefill(key_cache=None), "key_cache"),
    ("pp seq_lens None", lambda: _prefill(seq_lens=None), "seq_lens"),
    ("pp scale nan", lambda: _prefill(scale=NAN), "scale"),
    # plan_decode
    (
        "plan_decode sliding_window 2^70",
        lambda: plan_decode(LENS, target_items=4, sliding_window=BIG),
        "sliding_window",
    ),
    (
        "plan_decode granularity 2^70",
        lambda: plan_decode(LENS, target_items=4, granularity=BIG),
        "granularity",
    ),
    (
        "plan_decode min_chunk_tokens 2^70",
        lambda: plan_decode(LENS, target_items=4, min_chunk_tokens=BIG),
        "min_chunk_tokens",
    ),
    (
        "plan_decode max_items float",
        lambda: plan_decode(LENS, target_items=4, max_items=2.5),
        "max_items",
    ),
    (
        "plan_decode max_items str",
        lambda: plan_decode(LENS, target_items=4, max_items="8"),
        "max_items",
    ),
    (
        "plan_decode sliding_window True",
        lambda: plan_decode(LENS, target_items=4, sliding_window=True),
        "sliding_window",
    ),
    # DecodeAttention constructor
    ("DecodeAttention scale True", lambda: _decoder(scale=True), "scale"),
    ("DecodeAttention soft_cap inf", lambda: _decoder(soft_cap=INF), "soft_cap"),
    ("DecodeAttention launcher str", lambda: _decoder(launcher="emu"), "launcher"),
    ("DecodeAttention device bogus", lambda: _decoder(device="bogus"), "device"),
    ("DecodeAttention device int", lambda: _decoder(device=[0]), "device"),
    ("DecodeAttention cuda_graph str", lambda: _decoder(cuda_graph="no"), "cuda_graph"),
    ("DecodeAttention granularity 2^70", lambda: _decoder(granularity=BIG), "granularity"),
    (
        "DecodeAttention min_chunk_tokens 2^70",
        lambda: _decoder(min_chunk_tokens=BIG),
        "min_chunk_tokens",
    ),
    ("DecodeAttention max_seqs 2^40", lambda: _decoder(max_seqs=2**40), "max_items"),
    ("DecodeAttention max_items 2^40", lambda: _decoder(max_items=2**40 - 1), "max_items"),
    # plan_prefill / prefill_launch
    (
        "plan_prefill num_kv_heads 0",
        lambda: pl.plan_prefill(**{**_PLAN, "num_kv_heads": 0}),
        "num_kv_heads",
    ),
    ("plan_prefill num_heads 3", lambda: pl.plan_prefill(**{**_PLAN, "num_heads": 3}), "num_heads"),
    (
        "plan_prefill num_heads True",
        lambda: pl.plan_prefill(**{**_PLAN, "num_heads": True}),
        "num_heads",
    ),
    (
        "plan_prefill head_size 63",
        lambda: pl.plan_prefill(**{**_PLAN, "head_size": 63}),
        "head_size",
    ),
    ("plan_prefill num_seqs -1", lambda: pl.plan_prefill(**{**_PLAN, "num_seqs": -1}), "num_seqs"),
    (
        "plan_prefill max_query_len -1",
        lambda: pl.plan_prefill(**{**_PLAN, "max_query_len": -1}),
        "max_query_len",
    ),
    ("prefill_launch plan None", lambda: pl.prefill_launch(None, **_LAUNCH), "plan"),
    ("prefill_launch out -1", lambda: _launch(out=-1), "out"),
    ("prefill_launch query 2^70", lambda: _launch(query=BIG), "query"),
    ("prefill_launch out None", lambda: _launch(out=None), "out"),
    ("prefill_launch num_tokens -1", lambda: _launch(num_tokens=-1), "num_tokens"),
    ("prefill_launch num_tokens 2^40", lambda: _launch(num_tokens=2**40), "num_tokens"),
    ("prefill_launch scale nan", lambda: _launch(scale=NAN), "scale"),
    ("prefill_launch scale inf", lambda: _launch(scale=INF), "scale"),
    ("prefill_launch scale str", lambda: _launch(scale="0.1"), "scale"),
    ("prefill_launch soft_cap nan", lambda: _launch(soft_cap=NAN), "soft_cap"),
    ("prefill_launch sliding_window True", lambda: _launch(sliding_window=True), "sliding_window"),
    ("prefill_launch sliding_window -1", lambda: _launch(sliding_window=-1), "sliding_window"),
    ("prefill_launch block_size 7", lambda: _launch(block_size=7), "block_size"),
    ("prefill_launch sinks -1", lambda: _launch(sinks=-1), "sinks"),
    ("prefill_launch sinks tensor", lambda: _launch(sinks=torch.zeros(4)), "sinks"),
    ("prefill_launch sinks, plan without", lambda: _launch(sinks=16), "sinks"),
    (
        "prefill_launch plan with sinks, none",
        lambda: pl.prefill_launch(pl.plan_prefill(**_PLAN, sinks=True), **_LAUNCH),
        "sinks",
    ),
    # swap_blocks within one storage: pairs that chain or overlap (copy_blocks' rule)
    ("swap_blocks same tensor chained", lambda: _swap_within([(0, 1), (1, 2)]), "copy_blocks"),
    ("swap_blocks same tensor reversed", lambda: _swap_within([(2, 1), (3, 2)]), "copy_blocks"),
    ("swap_blocks same tensor unmerged", lambda: _swap_within([(5, 0), (0, 3)]), "copy_blocks"),
    ("swap_blocks same tensor dst twice", lambda: _swap_within([(1, 4), (2, 4)]), "copy_blocks"),
    ("swap_blocks views, shifted blocks", lambda: _swap_views(4, [(0, 0)]), "copy_blocks"),
    ("swap_blocks views, shifted halves", lambda: _swap_views(2, [(1, 0)]), "copy_blocks"),
    # copy_blocks: the rule its docstring states (on CUDA a chain is a race)
    ("copy_blocks chained", lambda: ops.copy_blocks(_CACHES, [[1, 2], [2, 3]]), "copy_blocks"),
    ("copy_blocks dst twice", lambda: ops.copy_blocks(_CACHES, [[1, 4], [2, 4]]), "copy_blocks"),
    # allocate_kv_cache: bools were counts, floats and arrays torch's TypeError/ValueError,
    # sizes it cannot allocate its RuntimeError
    ("alloc num_blocks True", lambda: _alloc(num_blocks=True), "num_blocks"),
    ("alloc num_layers True", lambda: _alloc(num_layers=True), "num_layers"),
    ("alloc num_blocks 2^70", lambda: _alloc(num_blocks=BIG), "num_blocks|allocated"),
    ("alloc num_blocks 2^31", lambda: _alloc(num_blocks=2**31, num_layers=64), "allocated"),
    ("alloc block_size 16.0", lambda: _alloc(block_size=16.0), "block_size"),
    ("alloc head_size array", lambda: _alloc(head_size=np.array([64, 64])), "head_size"),
    ("alloc device float", lambda: _alloc(device=2.7), "device"),
    ("alloc device bogus", lambda: _alloc(device="bogus"), "device"),
    ("alloc pin_memory str", lambda: _alloc(pin_memory="yes"), "pin_memory"),
    ("alloc dtype array", lambda: _alloc(dtype=np.array([1, 2])), "dtype"),
    # copy_blocks: caches that are no list of layers, a mapping without data
    ("copy_blocks kv_caches str", lambda: ops.copy_blocks("kv", [[1, 2]]), "kv_caches"),
    ("copy_blocks kv_caches int", lambda: ops.copy_blocks(np.int64(3), [[1, 2]]), "kv_caches"),
    ("copy_blocks kv_caches array", lambda: ops.copy_blocks(np.ones(2), [[1, 2]]), "kv_caches"),
    (
        "copy_blocks mapping on meta",
        lambda: ops.copy_blocks(_CACHES, torch.tensor([[1, 2]], device="meta")),
        "block_mapping",
    ),
    # precompile: every row fails before anything is compiled
    ("precompile archs str", lambda: ops.precompile("sm_90"), "archs"),
    (
        "precompile head_sizes 64.0",
        lambda: ops.precompile(["sm_90"], head_sizes=[64.0]),
        "head size",
    ),
    ("precompile head_sizes int", lambda: ops.precompile(["sm_90"], head_sizes=64), "head_sizes"),
    ("precompile dtypes dtype", lambda: ops.precompile(["sm_90"], dtypes=torch.float16), "dtypes"),
    ("precompile dtypes str", lambda: ops.precompile(["sm_90"], dtypes=["float16"]), "dtype"),
]


@pytest.mark.parametrize(("call", "word"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_argument_is_named(call, word):
    with pytest.raises(InvalidArgumentError, match=word):
        call()


def test_valid_edges_still_accepted():
    """What the checks must not refuse: numpy scalars, a window of 2^31 - 1, address 0."""
    got = _decode(scale=np.float32(0.125), sliding_window=2**31 - 1, soft_cap=np.float64(30.0))
    want = ref_decode(CASE, scale=0.125, soft_cap=30.0)
    torch.testing.assert_close(got, want, **tolerance(torch.float16))
    torch.testing.assert_close(
        _prefill(sliding_window=2**31 - 1), ref_prefill(PREFILL), **tolerance(torch.float16)
    )
    assert _launch(out=0, sliding_window=2**31 - 1).args[-2] == 2**31 - 1
    assert pl.plan_prefill(**{**_PLAN, "max_query_len": BIG}).q_tiles == pl.MAX_GRID_YZ


def test_swap_blocks_within_one_storage_when_pairs_do_not_overlap():
    """One tensor (or views of one storage) as both sides: disjoint pairs and pairs that
    copy a block onto itself still run; only overlapping ones are refused."""
    cache = _BLOCKS.clone()
    ops.swap_blocks(cache, cache, [(0, 3), (1, 4), (2, 2)])
    assert torch.equal(cache[3:5], _BLOCKS[0:2]) and torch.equal(cache[:3], _BLOCKS[:3])
    flat = _BLOCKS.clone().reshape(-1)
    ops.swap_blocks(flat[:32].view(4, 8), flat[16:48].view(4, 8), [(0, 2)])  # 0 -> 4
    assert torch.equal(flat.view(6, 8)[4], _BLOCKS[0])
    ops.copy_blocks(_CACHES, [[1, 1], [2, 4], [2, 5]])  # a self-copy; one source twice


def test_decode_attention_rejected_calls_keep_the_plan():
    """Bad plan()/run() arguments raise named errors and leave the last plan runnable."""
    dec = _decoder(max_seqs=2)
    lens = np.array([20, 40], dtype=np.int32)
    dec.plan(lens, CASE.block_tables)
    plan = dec.last_plan
    bad_calls = [
        (lambda: dec.run(CASE.query, None, None), "key_cache"),
        (lambda: dec.run(CASE.query, NOT_TENSOR, NOT_TENSOR), "key_cache"),
        (lambda: dec.run(None, CASE.key_cache, CASE.value_cache), "query"),
        (lambda: dec.run(CASE.query, CASE.key_cache, CASE.value_cache, out=np.zeros(3)), "out"),
        (lambda: dec.plan(np.array([20.0, 40.0]), CASE.block_tables), "seq_lens"),
        (lambda: dec.plan(np.array([20, -1], dtype=np.int32), CASE.block_tables), "seq_lens"),
        (lambda: dec.plan(np.array([20, 2**20], dtype=np.int32), CASE.block_tables), "seq_lens"),
        (lambda: dec.plan(np.ones(3, np.int32), CASE.block_tables), "max_seqs"),
        (lambda: dec.plan(lens, CASE.block_tables.long()), "block_tables"),
        (lambda: dec.plan(lens, None), "block_tables"),
    ]
    for call, word in bad_calls:
        with pytest.raises(InvalidArgumentError, match=word):
            call()
        assert dec.last_plan is plan
    got = dec.run(CASE.query, CASE.key_cache, CASE.value_cache)
    torch.testing.assert_close(got, ref_decode(CASE), **tolerance(torch.float16))
