"""The background thread that makes every store call of one remote-tier link, reads first.

Two kinds of job, each a typed record that knows how to run and how to settle its
bookkeeping: a :class:`PendingFetch` (a read whose payloads the step thread imports later)
and a write-back of staged rows. Writes are bounded (``max_pending`` blocks queued); a
read that overtakes a queued write of the same block (reads go first) is answered from the
staged rows, so an instance always reads its own writes.

At interpreter exit every worker still running is stopped (what is queued is dropped) and
joined while its store call under way ends: a daemon thread that takes the GIL back during
finalization is ended where it stands (``pthread_exit``), and inside torch's C++ code (a
tensor freed) that is ``std::terminate``, which aborts the process.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from kvblocks.tiers.remote_groups import FetchPlan

__all__ = ["PendingFetch", "StoreCalls", "Worker"]

# How long the exit waits for a store call under way (a hung one is left to its fate).
_EXIT_JOIN_S = 10.0


class PendingFetch:
    """A read of one sequence's blocks past the local hit, queued or done.

    Its payloads are set once, by whichever thread made the read, before :meth:`done`
    turns true; the step thread reads them only after that.
    """

    def __init__(self, plan: FetchPlan, retention_priority: int | None = None) -> None:
        # Which group's block each key is, and the hit rule's inputs.
        self.plan = plan
        # The store keys read (with several KV cache groups: group tag + block hash).
        self.hashes = list(plan.keys)
        # The blocks enter the host tier at the requesting sequence's priority.
        self.retention_priority = retention_priority
        self.payloads: list[torch.Tensor | None] | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        """Whether the read came back."""
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the read; whether it came back."""
        return self._done.wait(max(0.0, timeout))

    def finish(self, payloads: list[torch.Tensor | None] | None) -> None:
        """Set the read's result (None: nothing came back) and wake its waiters."""
        self.payloads = payloads
        self._done.set()


class StoreCalls(Protocol):
    """What the worker asks of its link: the store calls (each catches its own failures)
    and the one counter the worker itself moves."""

    def read_store(self, hashes: list[bytes]) -> list[torch.Tensor | None] | None:
        """``get_many``: each payload or None; None when the call failed."""
        ...

    def write_store(self, hashes: list[bytes], rows: torch.Tensor) -> None:
        """``put_many`` of the rows (one per hash)."""
        ...

    def count_dropped_writes(self, blocks: int) -> None:
        """Blocks dropped without being written."""
        ...


@dataclass(frozen=True)
class _ReadJob:
    fetch: PendingFetch

    def run(self, worker: Worker) -> None:
        self.fetch.finish(worker.read_through_staged(self.fetch.hashes))

    def settle(self, worker: Worker) -> None:
        """Nothing to release: a read holds no queued blocks."""


@dataclass(frozen=True)
class _WriteJob:
    hashes: list[bytes]
    rows: torch.Tensor
    # The per-block views put in the staged map: unstaging compares by identity, and
    # each ``unbind`` makes new view objects.
    views: tuple[torch.Tensor, ...]

    def run(self, worker: Worker) -> None:
        worker.calls.write_store(self.hashes, self.rows)

    def settle(self, worker: Worker) -> None:
        """Release the job's queued blocks and its staged rows (the caller holds the lock)."""
        worker.unstage(self.hashes, self.views)


class Worker:
    """One daemon thread making every store call of a link, reads before writes.

    Args:
        calls: the link's store calls.
        max_pending: blocks queued for writing at most; a write beyond it is dropped.
    """

    def __init__(self, calls: StoreCalls, max_pending: int) -> None:
        self.calls = calls
        self._max_pending = max_pending
        self._cond = threading.Condition()
        self._reads: deque[_ReadJob] = deque()
        self._writes: deque[_WriteJob] = deque()
        # Rows queued for writing, by hash: a read that overtakes their write (reads go
        # first) is answered from them, so an instance always reads its own writes.
        self._staged: dict[bytes, torch.Tensor] = {}
        self._pending_blocks = 0
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvblocks-remote-tier", daemon=True)
        self._thread.start()
        _LIVE.add(self)  # the running thread holds the worker: kept until the thread ends

    def submit_read(self, fetch: PendingFetch) -> None:
        """Queue a read (answered at once with nothing once the worker is stopping)."""
        with self._cond:
            if self._stopping:
                fetch.finish(None)
                return
            self._reads.append(_ReadJob(fetch))
            self._cond.notify_all()

    def submit_write(self, hashes: list[bytes], rows: torch.Tensor) -> int:
        """Queue what fits; how many blocks were dropped."""
        with self._cond:
            room = 0 if self._stopping else self._max_pending - self._pending_blocks
            keep = max(0, min(room, len(hashes)))
            if keep:
                views = rows[:keep].unbind(0)
                self._writes.append(_WriteJob(hashes[:keep], rows[:keep], views))
                self._staged.update(zip(hashes[:keep], views, strict=True))
                self._pending_blocks += keep
                self._cond.notify_all()
            return len(hashes) - keep

    def unstage(self, hashes: list[bytes], views: tuple[torch.Tensor, ...]) -> None:
        """Forget a finished write's staged rows, the views :meth:`submit_write` staged
        (unless a later write restaged a hash)."""
        self._pending_blocks -= len(hashes)
        for h, row in zip(hashes, views, strict=True):
            if self._staged.get(h) is row:
                del self._staged[h]

    def read_through_staged(self, hashes: list[bytes]) -> list[torch.Tensor | None] | None:
        """Each block from the staged rows if queued for writing, else from the store."""
        with self._cond:
            staged = [self._staged.get(h) for h in hashes]
        rest = [h for h, row in zip(hashes, staged, strict=True) if row is None]
        stored = iter(self.calls.read_store(rest) or [None] * len(rest)) if rest else iter(())
        return [row if row is not None else next(stored) for row in staged]

    def flush(self, timeout: float) -> bool:
        """Wait until nothing is queued or running; whether that happened in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._reads or self._writes or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
            return True

    def stop(self, timeout: float) -> bool:
        """Write what is queued (within ``timeout``), then end the thread; whether it ended.

        Writes still queued at the deadline are dropped (counted); a store call still
        running is left to the daemon thread, which ends after it.
        """
        flushed = self.flush(timeout)
        self._halt(drop_writes=not flushed)
        self._thread.join(max(0.0, min(timeout, 1.0)) if not flushed else timeout)
        return not self._thread.is_alive()

    def end_at_exit(self, timeout: float) -> None:
        """Drop what is queued and wait (up to ``timeout``) for the thread to end: the
        interpreter is exiting (see the module docstring)."""
        self._halt(drop_writes=True)
        self._thread.join(timeout)

    def _halt(self, *, drop_writes: bool) -> None:
        """Take no more jobs; answer queued reads with nothing, and drop queued writes
        (counted) when ``drop_writes``."""
        with self._cond:
            self._stopping = True
            if drop_writes:
                self.calls.count_dropped_writes(sum(len(job.hashes) for job in self._writes))
                self._writes.clear()
                self._staged.clear()
                self._pending_blocks = 0
            for job in self._reads:
                job.fetch.finish(None)
            self._reads.clear()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._reads or self._writes or self._stopping):
                    self._cond.wait()
                job: _ReadJob | _WriteJob
                if self._reads:
                    job = self._reads.popleft()
                elif self._writes:
                    job = self._writes.popleft()
                else:
                    return  # stopping with nothing queued
                self._busy = True
            try:
                job.run(self)
            finally:
                with self._cond:
                    self._busy = False
                    job.settle(self)
                    self._cond.notify_all()


_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


@atexit.register
def _end_workers_at_exit() -> None:
    # atexit runs before finalization ends daemon threads (see the module docstring).
    for worker in list(_LIVE):
        worker.end_at_exit(_EXIT_JOIN_S)
