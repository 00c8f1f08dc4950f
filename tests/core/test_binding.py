"""Binding-specific behaviour of ``kvblocks._core``: argument conversion, result types,
error classes, thread safety."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvblocks
from kvblocks import InvalidArgumentError, KVCacheManager
from kvblocks.errors import KVBlocksError


@pytest.mark.parametrize(
    "dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
)
def test_every_integer_dtype_is_accepted(dtype: str) -> None:
    m = KVCacheManager(16, 4)
    m.add_sequence(1, np.arange(6, dtype=dtype))
    assert m.token_ids(1).tolist() == list(range(6))
    assert (
        m.allocate_slots_batch(np.array([1], dtype=dtype), np.array([6], dtype=dtype)).num_served
        == 1
    )
    m.commit_batch(np.array([1], dtype=dtype), np.array([6], dtype=dtype))
    assert m.block_tables(np.array([1], dtype=dtype)).tolist() == [[1, 2]]


def test_non_contiguous_and_numpy_scalar_arguments() -> None:
    m = KVCacheManager(16, 4)
    tokens = np.arange(20, dtype=np.int64)[::2]  # strided view
    m.add_sequence(np.int64(3), tokens)
    assert m.token_ids(3).tolist() == list(range(0, 20, 2))
    assert m.allocate_slots(np.uint8(3), np.int32(10)) is not None
    ids = np.array([[3, 3]], dtype=np.int64)[:, 0]
    assert m.slot_mapping(ids, np.array([2, 9])[:1]).tolist() == [4, 5]


def test_lists_tuples_and_ranges() -> None:
    m = KVCacheManager(16, 4)
    m.add_sequence(1, (5, 6, 7))
    m.add_sequence(2, range(3))
    assert m.allocate_slots_batch((1, 2), [3, 3]).num_served == 2
    m.commit_batch(range(1, 3), 3, [8, -1])
    assert m.token_ids(1).tolist() == [5, 6, 7, 8]
    m.add_sequence(3, np.array([], dtype=np.float64))  # an empty array of any dtype is empty
    assert m.num_tokens(3) == 0


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2.5],
        [1, "2"],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array([[1, 2]]),
        np.array(3),
        b"\x01\x02",
        None,
        [2**64],
        [-(2**64)],
    ],
)
def test_bad_token_arrays_raise_invalid_argument(bad: object) -> None:
    m = KVCacheManager(16, 4)
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        m.add_sequence(1, bad)
    assert len(m) == 0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.array([[1]]), "priority must be an int, got ndarray"),
        (np.array([1, 2]), "priority must be an int, got ndarray"),
        (np.array(2**63, dtype=np.uint64), f"priority must be in \\[0, 100\\], got {2**63}"),
        (2**64, "priority = 18446744073709551616 is out of range"),
        (101, "priority must be in \\[0, 100\\], got 101"),
    ],
)
def test_bad_scalar_messages_say_what_was_wrong(bad: object, message: str) -> None:
    """An array where an int belongs is named as such, not as an out-of-range int, and
    an out-of-range value is printed as given."""
    m = KVCacheManager(16, 4)
    m.add_sequence(1, [1, 2], retention_priority=7)
    with pytest.raises(InvalidArgumentError, match=message):
        m.set_retention_priority(1, bad)
    assert m.retention_priority(1) == 7


@pytest.mark.parametrize("bad", [-1, 2**63, 2**70, 1.0, "1", True, None])
def test_bad_seq_ids_raise_invalid_argument(bad: object) -> None:
    m = KVCacheManager(16, 4)
    with pytest.raises(InvalidArgumentError, match="seq_id"):
        m.add_sequence(bad, [1])
    with pytest.raises(InvalidArgumentError, match="seq_ids"):
        m.block_tables([bad])
    assert bad not in m


def test_largest_ids_round_trip() -> None:
    m = KVCacheManager(16, 4)
    big = 2**63 - 1
    m.add_sequence(big, [2**32 - 1])
    assert m.seq_ids().tolist() == [big]
    assert m.token_ids(big).tolist() == [2**32 - 1]
    assert m.probe_prefixes(np.array([big], dtype=np.uint64)).tolist() == [0]


def test_errors_are_the_python_classes() -> None:
    m = KVCacheManager(16, 4)
    with pytest.raises(kvblocks.UnknownSequenceError) as info:
        m.free(5)
    assert type(info.value) is kvblocks.errors.UnknownSequenceError
    assert isinstance(info.value, KeyError) and isinstance(info.value, KVBlocksError)
    assert str(info.value) == "unknown sequence id 5"


def test_result_types() -> None:
    m = KVCacheManager(16, 4, num_cpu_blocks=4)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    assert isinstance(m.add_sequence(2, [1]), int)
    blocks = m.allocate_slots(1, 5)
    assert isinstance(blocks, np.ndarray) and blocks.dtype == np.int32 and blocks.ndim == 1
    m.commit(1, 5)
    assert m.swap_out([1]).dtype == np.int64
    assert m.swap_in([1]).shape == (2, 2)
    assert m.block_tables([1, 2]).flags.c_contiguous
    assert isinstance(m.stats()["usage"], float) and isinstance(m.stats()["evictions"], int)
    assert isinstance(m.can_allocate(2), kvblocks.AllocStatus)


def test_objects_are_frozen() -> None:
    m = KVCacheManager(16, 4)
    with pytest.raises(AttributeError):
        m.block_size = 8  # type: ignore[misc]
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.allocate_slots(1, 5)
    m.commit(1, 5)
    (event,) = m.take_events()
    with pytest.raises(AttributeError):
        event.block_size = 3  # type: ignore[misc]
    assert "BlockStored" in repr(event)


def test_hash_algorithms_digest_sizes() -> None:
    for algo, size in (("blake3", 32), ("xxh3_128", 16), ("sha256_cbor", 32)):
        m = KVCacheManager(16, 2, hash_algo=algo)
        m.add_sequence(1, [1, 2, 3])
        m.allocate_slots(1, 3)
        m.commit(1, 3)
        (event,) = m.take_events()
        assert [len(h) for h in event.block_hashes] == [size]


def test_threads_hammering_one_manager() -> None:
    """Several threads drive disjoint sequences of one manager; no "already borrowed",
    no lost updates, invariants hold afterwards."""
    m = KVCacheManager(1 << 17, 4, num_cpu_blocks=256)
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(60):
                sid = base + i
                m.add_sequence(sid, np.arange(i % 7, i % 7 + 9, dtype=np.int64))
                new = m.num_tokens(sid) - m.num_computed_tokens(sid)
                assert m.allocate_slots(sid, new) is not None
                m.commit(sid, m.num_tokens(sid) - m.num_computed_tokens(sid), [1])
                if i % 3 == 0:
                    m.fork(sid, sid + 500)
                    m.free(sid + 500)
                if i % 5 == 0:
                    m.swap_out([sid])
                    m.swap_in([sid])
                m.block_tables([sid])
                m.stats()
                if i % 2:
                    m.free(sid)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    def batch_worker(base: int) -> None:
        """Long prompts and large batches: these calls lock with the GIL released."""
        try:
            ids = np.arange(base, base + 80, dtype=np.int64)
            for sid in ids.tolist():
                m.add_sequence(sid, np.full(3000, sid % 11, dtype=np.uint32))
            for _ in range(5):
                news = m.probe_prefixes(ids)
                assert (news >= 0).all()
            assert m.allocate_slots_batch(ids, 3000 - m.probe_prefixes(ids)).num_served == 80
            m.commit_batch(ids, 3000 - m.probe_prefixes(ids), np.ones(80, dtype=np.int64))
            assert m.block_tables(ids).shape[0] == 80
            for sid in ids.tolist():
                m.free(sid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t * 1000,)) for t in range(6)]
    threads += [threading.Thread(target=batch_worker, args=(10_000 + t * 100,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(m) == 6 * 30
    m.check_invariants()


def test_long_calls_release_the_gil() -> None:
    """While one thread hashes a huge prompt, the main thread keeps running Python.

    If ``add_sequence`` held the GIL, the main loop could not run between the worker's
    ``started.set()`` and the end of its call, so it would count (almost) nothing.
    """
    m = KVCacheManager(1 << 18, 16)
    prompt = np.arange(1 << 22, dtype=np.uint32) % 50_000
    started, done = threading.Event(), threading.Event()
    ticks = 0

    def hash_prompt() -> None:
        started.set()
        m.add_sequence(1, prompt)
        done.set()

    t = threading.Thread(target=hash_prompt)
    t.start()
    started.wait()
    while not done.is_set():
        ticks += 1
    t.join()
    assert m.num_tokens(1) == 1 << 22
    assert ticks > 100
