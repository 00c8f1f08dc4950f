"""Full observable state of a block manager, for "a failing call changes nothing" checks.

Works on both :class:`kvblocks.KVCacheManager` and
:class:`oracle.reference_manager.ReferenceKVCacheManager`.
"""

from __future__ import annotations

from typing import Any

from kvblocks import KVBlocksError


def snapshot(m: Any) -> dict[str, Any]:
    """Everything a caller can observe without changing the manager.

    Events and copy-on-write pairs are drainable queues, so they are not part of the
    snapshot: drain them before the call under test and check they stay empty with
    :func:`assert_no_side_effects`.
    """
    seqs = {}
    for sid in m.seq_ids().tolist():
        swapped = m.is_swapped(sid)
        seqs[sid] = {
            "tokens": m.token_ids(sid).tolist(),
            "num_tokens": m.num_tokens(sid),
            "computed": m.num_computed_tokens(sid),
            "cached": m.num_cached_tokens(sid),
            "swapped": swapped,
            "table": None if swapped else m.block_table(sid).tolist(),
        }
    gpu_free, cpu_free = m._debug_free_queues()
    return {
        "len": len(m),
        "seqs": seqs,
        "free": m.num_free_blocks(),
        "free_cpu": m.num_free_cpu_blocks(),
        "gpu_queue": gpu_free.tolist(),
        "cpu_queue": cpu_free.tolist(),
        "stats": m.stats(),
    }


def drain(m: Any) -> None:
    """Empty the event and copy-on-write queues."""
    m.take_events()
    m.take_copy_on_writes()


def assert_no_side_effects(m: Any, before: dict[str, Any]) -> None:
    """The manager is exactly as ``before`` and queued nothing new; invariants hold."""
    assert snapshot(m) == before
    assert m.take_events() == []
    assert m.take_copy_on_writes().shape == (0, 2)
    m.check_invariants()


def expect_error(m: Any, error: type[KVBlocksError], call: Any, match: str | None = None) -> str:
    """Run ``call(m)``; it must raise ``error`` and leave the manager untouched."""
    import pytest

    drain(m)
    before = snapshot(m)
    with pytest.raises(error, match=match) as info:
        call(m)
    assert isinstance(info.value, KVBlocksError)
    assert_no_side_effects(m, before)
    return str(info.value)
