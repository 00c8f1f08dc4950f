"""No Python input may kill the interpreter (issue 7, defect 3).

Each case runs in a subprocess, because what it guards against is an abort (a failed
huge allocation, SIGABRT) or a Rust panic surfacing as ``PanicException``, neither of
which a test in this process could survive or catch reliably. A case passes when the
call returns or raises a ``KVBlocksError`` (or ``TypeError``/``ValueError``) and the
process exits normally.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

PRELUDE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import kvblocks
    import kvblocks.hashing

    class Lying:
        '''An iterable whose __len__ claims far more items than it yields.'''
        def __init__(self, n, items=(1, 2, 3)):
            self.n, self.items = n, items
        def __len__(self):
            return self.n
        def __iter__(self):
            return iter(self.items)

    m = kvblocks.KVCacheManager(16, 4, num_cpu_blocks=4)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.allocate_slots(1, 5)

    def attempt(call):
        try:
            call()
        except (kvblocks.KVBlocksError, TypeError, ValueError):
            pass
        except BaseException as e:  # PanicException derives from BaseException
            print(f"ESCAPED {type(e).__module__}.{type(e).__name__}: {e}")
            sys.exit(3)
    """
)

CASES = {
    "max_blocks=2**33": "m.block_tables([1], max_blocks=2**33)",
    "max_blocks=2**61": "m.block_tables([1], max_blocks=2**61)",
    "max_blocks=2**63-1": "m.block_tables([1], max_blocks=2**63 - 1)",
    "len 2**40 tokens": "m.add_sequence(2, Lying(2**40))",
    "len maxsize tokens": "m.add_sequence(3, Lying(sys.maxsize))",
    "len maxsize ids": "m.block_tables(Lying(sys.maxsize, (1,)))",
    "len maxsize commit": "m.commit(1, 0, Lying(sys.maxsize))",
    "len maxsize batch counts": "m.slot_mapping([1], Lying(sys.maxsize, (1,)))",
    "lookahead 2**62": "m.allocate_slots(1, 0, num_lookahead_tokens=2**62)",
    "can_allocate lookahead 2**63-1": (
        "m.add_sequence(4, [1]); m.can_allocate(4, num_lookahead_tokens=2**63 - 1)"
    ),
    "huge pool": "kvblocks.KVCacheManager(2**62, 2**62)",
    "slot_mapping 2**62": "m.slot_mapping([1], [2**62])",
    "huge host tier": "kvblocks.KVCacheManager(16, 4, host_cache_blocks=2**62)",
    "host tier 2**64": "kvblocks.KVCacheManager(16, 4, host_cache_blocks=2**64)",
    "host_offload bytes": "kvblocks.KVCacheManager(16, 4, host_cache_blocks=1, host_offload=b'x')",
    # A tier whose every slot stays pinned (nothing ever confirmed) must only skip offloads.
    "host tier never confirmed": (
        "t = kvblocks.KVCacheManager(6, 2, host_cache_blocks=1, watermark=0.0)\n"
        "for i in range(300):\n"
        "    t.add_sequence(i, [i % 7, i % 5, i % 3, 1, 2])\n"
        "    t.allocate_slots(i, 5 - t.num_computed_tokens(i))\n"
        "    t.commit(i, 5 - t.num_computed_tokens(i))\n"
        "    t.free(i)\n"
        "    t.take_memory_ops()\n"
        "t.check_invariants()\n"
        "assert t.stats()['host_offloads_skipped'] > 0"
    ),
    # checkpoint_every_blocks * block_size wrapped to 0 (2**62 * 8 = 2**65) and a step's
    # state writes divided by it: a Rust panic (PanicException) from can_allocate,
    # allocate_slots or state_mapping. No checkpoint is that far: only the end is saved.
    "recurrent stride overflow": (
        "for k, bs in [(2**62, 8), (2**61, 8), (2**63 - 1, 4), (2**60, 16)]:\n"
        "    g = [kvblocks.GroupSpec.full_attention(), kvblocks.GroupSpec.recurrent(k)]\n"
        "    r = kvblocks.KVCacheManager(16, bs, groups=g, watermark=0.0)\n"
        "    r.add_sequence(1, list(range(20)))\n"
        "    assert r.can_allocate(1, num_new_tokens=20) == kvblocks.AllocStatus.OK\n"
        "    assert r.allocate_slots(1, 20) is not None\n"
        "    assert r.state_mapping([1], group=1).write_positions.tolist() == [20]\n"
        "    r.commit(1, 20)\n"
        "    r.check_invariants()"
    ),
    # A str with a lone surrogate has no UTF-8: it raised UnicodeEncodeError, not a
    # KVBlocksError, wherever the binding takes a str.
    "lone surrogates": (
        "global s, h\n"
        "s = '\\ud800'\n"
        "h = kvblocks.hashing.BlockHasher(4)\n"
        "calls = [lambda: m.add_sequence(9, [1, 2], cache_salt=s), lambda: m.register_lora(1, s),\n"
        "         lambda: m.register_lora(2, 'n', s), lambda: h.block_hashes([1], cache_salt=s),\n"
        "         lambda: h.register_lora(1, s),\n"
        "         lambda: kvblocks.KVCacheManager(8, 4, hash_algo=s),\n"
        "         lambda: kvblocks.hashing.BlockHasher(4, hash_algo='sha256_cbor', hash_seed=s),\n"
        "         lambda: kvblocks.KVCacheManager(8, 4, host_cache_blocks=1, host_offload=s)]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except BaseException as e:\n"
        "        ok = isinstance(e, kvblocks.InvalidArgumentError) and 'surrogate' in str(e)\n"
        "        assert ok, repr(e)  # an AssertionError escapes attempt()\n"
        "    else:\n"
        "        raise AssertionError('accepted')\n"
        "assert 9 not in m"
    ),
    # Imports from a remote store: hostile hash lists and slot ids, state unchanged.
    "tier imports": (
        # exec'd in a function: the lambdas below only see globals.
        "global t, v\n"
        "t = kvblocks.KVCacheManager(8, 4, host_cache_blocks=2)\n"
        "before = dict(t.stats())\n"
        "bad = [None, 1, 'x', b'x' * 32, [b'x' * 31], [b'x' * 2**16], ['a' * 32], [1],\n"
        "       Lying(2**62, (b'x' * 32, 'y')), np.array([1, 2]), [bytearray(32)]]\n"
        "for v in bad:\n"
        "    attempt(lambda: t.import_tier_blocks(v))\n"
        "    attempt(lambda: t.num_cached_prefix_blocks(v))\n"
        "assert dict(t.stats()) == before, (dict(t.stats()), before)\n"
        "for v in [None, 'x', b'x', [2**64], [-2**63], np.array([2**62]), Lying(2**62), [1.5]]:\n"
        "    attempt(lambda: t.tier_slot_hashes(v))\n"
        "attempt(lambda: m.import_tier_blocks([b'x' * 32]))\n"
        "assert list(t.import_tier_blocks([b'x' * 32] * 4)) == [0, -1, -1, -1]\n"
        "t.check_invariants()"
    ),
}


def run_case(code: str) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + f"\nattempt(lambda: exec({code!r}))\nprint('survived')\n"
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("code", CASES.values(), ids=CASES.keys())
def test_hostile_input_raises_instead_of_aborting(code: str) -> None:
    done = run_case(code)
    assert done.returncode == 0 and "survived" in done.stdout, (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}"
    )


FUZZ = textwrap.dedent(
    """
    import random
    rng = random.Random(7)
    values = [
        -1, 0, 1, 2, 5, 2**31, 2**32, 2**33, 2**61, 2**63 - 1, 2**63, 2**64, -2**63, 10**30,
        1.5, float("nan"), True, None, "x", b"x", [], [1], [1, 1], [-1], [2**40], [[1]],
        np.array([1, 2]), np.array([[1]]), np.array([1.5]), np.array([2**62]),
        np.array([], dtype=np.float64), np.uint64(2**64 - 1), Lying(2**40), Lying(sys.maxsize),
    ]
    methods = {
        "add_sequence": 2, "allocate_slots": 3, "allocate_slots_batch": 3, "commit": 3,
        "commit_batch": 3, "fork": 2, "free": 1, "swap_out": 1, "swap_in": 1,
        "block_table": 1, "block_tables": 1, "slot_mapping": 2, "can_allocate": 1,
        "can_swap_out": 1, "can_swap_in": 1, "refresh_prefixes": 1, "probe_prefixes": 1,
        "num_tokens": 1, "num_computed_tokens": 1, "token_ids": 1, "num_tier_tokens": 1,
        "num_tier_loads": 1,
        "import_tier_blocks": 1, "num_cached_prefix_blocks": 1, "tier_slot_hashes": 1,
        "set_retention_priority": 2, "retention_priority": 1, "limit_tier_loads": 2,
    }
    for _ in range(6000):
        name = rng.choice(sorted(methods))
        args = [rng.choice(values) for _ in range(methods[name])]
        kwargs = {}
        if name == "block_tables" and rng.random() < 0.5:
            kwargs["max_blocks"] = rng.choice(values)
        if name == "add_sequence" and rng.random() < 0.5:
            kwargs["retention_priority"] = rng.choice(values)
        if name in ("allocate_slots", "allocate_slots_batch") and rng.random() < 0.5:
            kwargs["num_lookahead_tokens"] = rng.choice(values)
        attempt(lambda: getattr(m, name)(*args, **kwargs))
    m.check_invariants()
    print('survived')
    """
)


def test_random_hostile_arguments_never_escape() -> None:
    """Every method with random extreme, mistyped and lying arguments."""
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + FUZZ], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "survived" in done.stdout, (
        f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("value", [None, 3, 2.5, object(), np.int64(3), np.array(3), ""])
@pytest.mark.parametrize(
    "method",
    ["tier_slot_hashes", "tier_slot_groups", "num_cached_prefix_blocks", "import_tier_blocks"],
)
def test_tier_lookups_refuse_what_is_no_sequence(method: str, value: object) -> None:
    # A bare TypeError ('int' object is not iterable) escaped; "" hashed as no blocks.
    import kvblocks

    m = kvblocks.KVCacheManager(8, 4, host_cache_blocks=2)
    before = dict(m.stats())
    with pytest.raises(kvblocks.InvalidArgumentError):
        getattr(m, method)(value)
    assert dict(m.stats()) == before


@pytest.mark.parametrize("slots", [[True], [0, False], [np.bool_(True)]])
def test_tier_slot_lookups_refuse_bools(slots: list[object]) -> None:
    # [True] read slot 1.
    import kvblocks

    m = kvblocks.KVCacheManager(8, 4, host_cache_blocks=2)
    for method in (m.tier_slot_hashes, m.tier_slot_groups):
        with pytest.raises(kvblocks.InvalidArgumentError, match="slots"):
            method(slots)
