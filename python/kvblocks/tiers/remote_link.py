"""A shared remote tier (e.g. :class:`~kvblocks.tiers.valkey_tier.ValkeyTier` or a
:class:`~kvblocks.tiers.disk.DiskTier` directory) below the engine's host tier.

The core decides, this module moves bytes. Every block the core offloads to the host tier
is also written to the remote store, keyed by its block hash (with several KV cache
groups, by group and hash: :mod:`kvblocks.tiers.remote_groups`), once the step's ops have
copied it into the host pool (write-through, ``host_offload="commit"``, makes every
computed block reach the store). Before a request is scheduled, the blocks of its prompt
past what the instance holds (GPU prefix cache + host tier) are read from the store; the
longest hit they give (one group: the leading run of hits; several: by the core's hit
rule) is imported into host-tier slots (``KVCacheManager.import_tier_blocks``),
their payloads written into the host pool and confirmed, so the scheduler's claim loads
them instead of recomputing them. A request preempted by recompute is probed again before
it is re-admitted (its blocks may have reached the store meanwhile).

**Off the step path** (``RemoteTierOptions(async_io=True)``, the default): one background
thread does every store call. A write-back copies the offloaded rows out of the host pool
into a staging tensor on the step thread (the GPU-to-host copy of the ``"offload"`` op has
completed by then, and the slots are still pinned), then queues it; the queue is bounded
(``max_pending_write_blocks``) and a write-back that does not fit is dropped and counted
(``dropped_writes``), so a slow or hung store never blocks a step. Reads are queued ahead
of writes. A prefetched payload is written into host-pool slots by the step thread,
between two steps, before the slots are confirmed: a load never reads a slot before its
bytes are there.

The store never fails the engine: an unreachable server reads as misses (the store logs a warning
once) and a value that fails its checks is rejected and read as a miss; both mean
recompute. A store call that raises anyway is counted (``worker_errors``) and read as a
miss.

The link's counters are moved by the step thread and the worker thread; they live behind
one lock and :meth:`RemoteTierLink.stats` hands out snapshots. Which requests wait for
their reads is :mod:`kvblocks.tiers.remote_admission`'s business; the thread,
:mod:`kvblocks.tiers.remote_worker`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvblocks._core import KVCacheManager
from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.tiers.layout import KVLayout
from kvblocks.tiers.remote_groups import FetchPlan, group_tags, plan_fetch
from kvblocks.tiers.remote_worker import PendingFetch, Worker
from kvblocks.tiers.store import TierStore
from kvblocks.validation import (
    TOKEN_ID_MAX,
    check_bool,
    check_int,
    check_int_array,
    check_number,
    check_optional_int,
    check_priority,
)

__all__ = [
    "PendingFetch",
    "RemoteTierLink",
    "RemoteTierOptions",
    "RemoteTierStats",
    "TierRead",
    "check_store_layout",
]

# Operational faults (an outage, a disk error) are logged, once, not raised or warned.
logger = logging.getLogger("kvblocks.tiers")

TokenIds = Sequence[int] | npt.NDArray[np.int64]
"""A sequence's token ids (a list or an int64 array)."""


@dataclass(frozen=True)
class RemoteTierOptions:
    """How the engine talks to its remote tier.

    Attributes:
        async_io: store calls on a background thread (writes queued, reads prefetched);
            False makes every call on the step thread, as it happens.
        max_pending_write_blocks: blocks queued for writing at most; a write-back beyond
            it is dropped (``dropped_writes``), never waited for.
        fetch_wait_s: how long a new request waits for its prefetch before it is
            scheduled without it (recompute; ``fetch_timeouts``). While other requests
            run the wait costs no step time; an idle engine waits for the read. A
            request preempted by recompute waits at most this long, once, before its
            re-admission.
        close_timeout_s: how long ``flush``/``close`` wait for queued writes (the end of
            each ``generate`` flushes, so that a call's blocks are in the store when it
            returns).
    """

    async_io: bool = True
    max_pending_write_blocks: int = 256
    fetch_wait_s: float = 1.0
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_bool(self.async_io, "async_io")
        check_int(
            self.max_pending_write_blocks,
            "max_pending_write_blocks",
            minimum=1,
            expected="a positive int",
        )
        for name in ("fetch_wait_s", "close_timeout_s"):
            _check_seconds(name, getattr(self, name))


def _check_seconds(name: str, value: object) -> float:
    """``value`` if it is a wait in seconds that threading can wait for: past
    ``threading.TIMEOUT_MAX`` (inf included) a wait raises OverflowError."""
    return check_number(
        value,
        name,
        minimum=0,
        maximum=threading.TIMEOUT_MAX,
        expected=f"a number of seconds in [0, {threading.TIMEOUT_MAX:.0f}]",
    )


def _check_host_pool(pool: object, slots: int, payload_nbytes: int) -> None:
    """Raise InvalidArgumentError unless ``pool`` is a CPU uint8 ``[>= slots, >=
    payload_nbytes]`` tensor: the link reads and writes the tier's slots' rows in it (a
    pool of another shape or dtype failed only in the first fetch's write)."""
    if (
        not isinstance(pool, torch.Tensor)
        or pool.dtype != torch.uint8
        or pool.dim() != 2
        or pool.device.type != "cpu"
        or pool.shape[0] < slots
        or pool.shape[1] < payload_nbytes
    ):
        got = (
            f"{pool.dtype} {tuple(pool.shape)} on {pool.device}"
            if isinstance(pool, torch.Tensor)
            else type(pool).__name__
        )
        raise InvalidArgumentError(
            f"host_pool must be a CPU uint8 [{slots}, {payload_nbytes}] tensor (the host "
            f"tier's slots), got {got}"
        )


def check_store_layout(store_layout: KVLayout, engine_layout: KVLayout) -> None:
    """Raise InvalidArgumentError unless a store of ``store_layout`` may serve an engine of
    ``engine_layout`` (its cache shape and dtype, its ``weights_digest``).

    The shapes and dtype must agree; the store's layout must name the engine's weights by
    their digest (any ``model_id`` is an addition), unless it opts out with
    ``trust_model_id``. A store that names no weights, or other weights, is refused.
    """
    if store_layout.shape_only() != engine_layout.shape_only():
        raise InvalidArgumentError(
            f"remote_tier's layout {store_layout} does not match the engine's KV cache "
            f"{engine_layout.shape_only()} (layers, KV heads, block size, head size, dtype)"
        )
    if store_layout.trust_model_id:
        return
    store_layout.require_identity("remote_tier")
    if store_layout.weights_digest != engine_layout.weights_digest:
        raise InvalidArgumentError(
            f"remote_tier's layout names other weights (weights_digest "
            f"{store_layout.weights_digest[:16]}...) than this engine's "
            f"({engine_layout.weights_digest[:16]}...): build it from the layout the engine "
            "passes to a factory (remote_tier=lambda layout: ...) or from "
            "kvblocks.engine.weights_digest(model)"
        )


@dataclass
class RemoteTierStats:
    """What the engine did with the remote tier.

    ``imported_blocks`` were read and loaded into the host tier (``refetched_blocks`` of
    them for requests preempted by recompute); ``published_blocks`` were handed to the
    store's ``put_many``; ``dropped_writes`` blocks were not, because the write queue was
    full; ``fetch_timeouts`` requests were scheduled before their read came back;
    ``worker_errors`` store calls raised (read as misses / dropped writes).
    """

    imported_blocks: int = 0
    published_blocks: int = 0
    dropped_writes: int = 0
    fetches: int = 0
    fetch_timeouts: int = 0
    refetches: int = 0
    refetched_blocks: int = 0
    worker_errors: int = 0


class _Counters:
    """:class:`RemoteTierStats` moved by two threads (the step thread and the worker's):
    every change and every snapshot under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = RemoteTierStats()

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to counter ``name``; its new value."""
        with self._lock:
            value = getattr(self._stats, name) + amount
            setattr(self._stats, name, value)
            return int(value)

    def snapshot(self) -> RemoteTierStats:
        with self._lock:
            return dataclasses.replace(self._stats)


@dataclass(frozen=True)
class TierRead:
    """What a read from the store is for: a sequence's tokens in its prefix-cache namespace
    (its blocks are hashed as the manager hashes them), and the retention priority its
    imported blocks keep in the host tier (``None``: the manager's default)."""

    token_ids: TokenIds
    cache_salt: str | bytes | None = None
    lora_id: int | None = None
    retention_priority: int | None = None


# One lock per store object: engines of one process may share a store, and a tier is not
# thread-safe. Weak keys: the lock goes with the store.
_STORE_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_STORE_LOCKS_GUARD = threading.Lock()


def _store_lock(store: Any) -> threading.Lock:
    with _STORE_LOCKS_GUARD:
        try:
            lock = _STORE_LOCKS.get(store)
            if lock is None:
                lock = _STORE_LOCKS[store] = threading.Lock()
        except TypeError:  # not weak-referenceable: a lock of its own
            lock = threading.Lock()
        return lock


class RemoteTierLink:
    """Connects one engine's host tier (manager + host pool) to a shared store.

    Args:
        store: a :class:`~kvblocks.tiers.store.TierStore` whose layout has the host pool's
            shape and dtype and names the engine's weights (see :func:`check_store_layout`).
        manager: the engine's manager (with a host tier).
        host_pool: the runner's uint8 ``[slots, payload_nbytes]`` host pool.
        layout: the host pool's layout, with the engine's ``weights_digest``.
        options: synchronous or background I/O and its bounds (default
            :class:`RemoteTierOptions`: background).
    """

    def __init__(
        self,
        store: Any,
        manager: KVCacheManager,
        host_pool: torch.Tensor | None,
        layout: KVLayout,
        options: RemoteTierOptions | None = None,
    ) -> None:
        if not isinstance(store, TierStore):
            raise InvalidArgumentError(
                f"remote_tier must be a TierStore (e.g. ValkeyTier), got {type(store).__name__}"
            )
        if not isinstance(manager, KVCacheManager):
            raise InvalidArgumentError(
                f"manager must be a KVCacheManager, got {type(manager).__name__}"
            )
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if host_pool is None or manager.host_cache_blocks == 0:
            raise InvalidArgumentError("remote_tier needs a host tier (host_cache_blocks > 0)")
        _check_host_pool(host_pool, manager.host_cache_blocks, layout.payload_nbytes)
        check_store_layout(store.layout, layout)
        if options is None:
            options = RemoteTierOptions()
        if not isinstance(options, RemoteTierOptions):
            raise InvalidArgumentError(
                f"remote_tier_options must be RemoteTierOptions, got {type(options).__name__}"
            )
        self.store = store
        self.manager = manager
        self._groups = tuple(manager.groups)
        self._tags = group_tags(self._groups)
        self.host_pool = host_pool
        self.options = options
        self._counters = _Counters()
        self._lock = _store_lock(store)
        self._worker = Worker(self, options.max_pending_write_blocks) if options.async_io else None

    def stats(self) -> RemoteTierStats:
        """A snapshot of what the engine did with the tier (the store keeps its own
        counters: ``store.stats()``)."""
        return self._counters.snapshot()

    # -- store calls (the worker's thread, or the caller's when synchronous) -------------
    def read_store(self, hashes: list[bytes]) -> list[torch.Tensor | None] | None:
        """The store's ``get_many`` (None when the call raised)."""
        try:
            with self._lock:
                return self.store.get_many(hashes)
        except Exception as exc:  # a store must never take the engine down
            self._store_failed("get_many", exc)
            return None

    def write_store(self, hashes: list[bytes], rows: torch.Tensor) -> None:
        """The store's ``put_many`` of ``rows`` (counted as published unless it raised)."""
        try:
            with self._lock:
                self.store.put_many(hashes, list(rows.unbind(0)))
        except Exception as exc:  # a store must never take the engine down
            self._store_failed("put_many", exc)
            return
        self._counters.add("published_blocks", len(hashes))

    def count_dropped_writes(self, blocks: int) -> None:
        """Blocks dropped without being written (a full queue, or left at close)."""
        self._counters.add("dropped_writes", blocks)

    def _store_failed(self, call: str, exc: Exception) -> None:
        if self._counters.add("worker_errors", 1) == 1:
            logger.warning(
                f"remote tier {type(self.store).__name__}.{call} raised {exc!r}: read as a "
                "miss / write dropped (recompute)"
            )

    # -- writes --------------------------------------------------------------------------
    def publish(self, memory_ops: Sequence[tuple[str, object]]) -> None:
        """Write the rows the applied ``"offload"`` ops filled to the store.

        Call after the ops were applied and before ``confirm_memory_ops`` (their slots are
        pinned until then, so each still holds the hash it was offloaded under). The rows
        are copied out of the pool here, so the slots may be reused once this returns;
        with background I/O the copy is queued (or dropped when the queue is full).
        """
        slots = [
            np.asarray(pairs, dtype=np.int64).reshape(-1, 2)[:, 1]
            for kind, pairs in memory_ops
            if kind == "offload"
        ]
        if not slots:
            return
        ids = np.concatenate(slots)
        if not ids.size:
            return
        hashes = self.manager.tier_slot_hashes(ids)
        groups = self.manager.tier_slot_groups(ids) if len(self._tags) > 1 else [0] * len(ids)
        keep = [i for i, h in enumerate(hashes) if h is not None and groups[i] is not None]
        if not keep:
            return
        # Advanced indexing copies: the staging rows own their bytes.
        rows = self.host_pool[torch.as_tensor(ids[keep], dtype=torch.long)]
        # Keyed by group and hash: each group's block of the same tokens is its own.
        chosen = [self._tags[groups[i]] + hashes[i] for i in keep]  # type: ignore[index,operator]
        if self._worker is None:
            self.write_store(chosen, rows)
        else:
            self.count_dropped_writes(self._worker.submit_write(chosen, rows))

    # -- reads ---------------------------------------------------------------------------
    def missing(self, read: TierRead) -> list[bytes]:
        """Store keys of the blocks of ``read``'s tokens a claim could use that this
        instance does not hold (past its GPU and host-tier hit; at most the host tier's
        size), hashed in ``read``'s namespace (cache salt, LoRA) as the manager hashes
        them; with several groups, each group's blocks the hit rule could need, keyed by
        group and hash (:mod:`kvblocks.tiers.remote_groups`)."""
        plan = self._plan(read)
        return [] if plan is None else list(plan.keys)

    def _plan(self, read: TierRead) -> FetchPlan | None:
        if not isinstance(read, TierRead):
            raise InvalidTypeError(f"read must be a TierRead, got {type(read).__name__}")
        # Checked, not cast: np.asarray(..., dtype=np.int64) truncates floats and parses
        # strings, which would read another prompt's blocks.
        try:
            tokens = np.asarray(read.token_ids)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError("token_ids must be a 1-D sequence of ints") from exc
        if tokens.ndim != 1:
            raise InvalidArgumentError(f"token_ids must be 1-D, got shape {tokens.shape}")
        check_int_array(tokens, "token_ids", minimum=0, maximum=TOKEN_ID_MAX)
        if read.retention_priority is not None:
            check_priority(read.retention_priority, "retention_priority")
        check_optional_int(read.lora_id, "lora_id", minimum=0)
        block_size = self.manager.block_size
        # A claim never covers the whole prompt: its last token is always computed.
        limit = (len(tokens) - 1) // block_size
        if limit <= 0:
            return None
        # The manager's own hasher (algorithm, seed, LoRAs), copied now: a LoRA registered
        # since the last prefetch counts.
        prefix = tokens[: limit * block_size].astype(np.int64, copy=False)
        hashes = self.manager.block_hasher().block_hashes(
            prefix, cache_salt=read.cache_salt, lora_id=read.lora_id
        )
        start = self.manager.num_cached_prefix_blocks(hashes)
        plan = plan_fetch(
            self._groups, self._tags, block_size, hashes, start, self.manager.host_cache_blocks
        )
        return plan if plan.keys else None

    def prefetch(self, read: TierRead) -> PendingFetch | None:
        """Start reading the sequence's blocks past the local hit; None when there is
        nothing to read. Synchronous I/O reads here; background I/O queues the read.
        The imported blocks keep ``read.retention_priority`` in the host tier."""
        plan = self._plan(read)
        if plan is None:
            return None
        fetch = PendingFetch(plan, read.retention_priority)
        wanted = fetch.hashes
        self._counters.add("fetches", 1)
        if self._worker is None:
            fetch.finish(self.read_store(wanted))
        else:
            self._worker.submit_read(fetch)
        return fetch

    def complete(self, fetch: PendingFetch) -> int:
        """Import a finished read's hit into host-tier slots; blocks imported.

        The hit is the longest prefix every group serves from what was found (one group:
        the leading run of hits); each group's blocks it needs are imported under that
        group. Call between steps with no op in flight: the imported slots are confirmed
        here. A read that has not come back imports nothing (``fetch_timeouts``).
        """
        payloads = fetch.payloads if fetch.done() else None
        if not fetch.done():
            self._counters.add("fetch_timeouts", 1)
        if not payloads:
            return 0
        plan = fetch.plan
        hit = plan.hit([p is not None for p in payloads])
        if hit <= plan.start:
            return 0
        entries: list[int] = []
        slot_ids: list[int] = []
        try:
            for group, chosen in enumerate(plan.imports(hit)):
                if not chosen:
                    continue
                got = self.manager.import_tier_blocks(
                    [plan.hashes[plan.entries[i][1]] for i in chosen],
                    retention_priority=fetch.retention_priority,
                    group=group,
                )
                for i, slot in zip(chosen, got.tolist(), strict=True):
                    if slot >= 0:
                        entries.append(i)
                        slot_ids.append(slot)
            if entries:
                data = torch.stack([payloads[i] for i in entries])  # type: ignore[misc]
                self.host_pool[torch.as_tensor(slot_ids, dtype=torch.long)] = data
        except BaseException:
            # No reserved slot may become a hit with unwritten bytes: the reservations of
            # every group so far are released empty (a reset of the prefix cache would
            # keep them while any sequence holds blocks).
            self.manager.discard_memory_ops()
            raise
        self.manager.confirm_memory_ops()
        self._counters.add("imported_blocks", len(entries))
        return len(entries)

    def refetch(self, reads: Sequence[TierRead]) -> int:
        """Read and import several sequences' missing blocks now (sequences preempted by
        recompute, before their re-admission): the reads run together and one
        ``fetch_wait_s`` bounds them all; blocks imported. Call between steps."""
        pending = [p for read in reads if (p := self.prefetch(read)) is not None]
        if not pending:
            return 0
        self._counters.add("refetches", len(pending))
        deadline = time.monotonic() + self.options.fetch_wait_s
        imported = 0
        for p in pending:
            p.wait(deadline - time.monotonic())
            imported += self.complete(p)
        self._counters.add("refetched_blocks", imported)
        return imported

    # -- lifetime ------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout``, default ``close_timeout_s``) until every queued write
        reached the store; whether it did (always True for synchronous I/O)."""
        if timeout is not None:
            _check_seconds("timeout", timeout)
        if self._worker is None:
            return True
        return self._worker.flush(self.options.close_timeout_s if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (bounded by ``timeout``, default ``close_timeout_s``) and
        end the background thread; whether it ended in time. Writes still queued then
        are dropped (``dropped_writes``). Later calls are synchronous. The store stays open
        (its owner closes it)."""
        if timeout is not None:
            _check_seconds("timeout", timeout)  # before the worker is let go
        worker, self._worker = self._worker, None
        if worker is None:
            return True
        return worker.stop(self.options.close_timeout_s if timeout is None else timeout)
