"""Fixtures of the tier benchmarks: one torch thread, and a real Valkey server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tiers.valkey_server import ServerProcess, running_server


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Every side on one thread: the comparisons are per core, and on a loaded machine
    OpenMP's team for a 512 KiB copy waits for preempted workers (medians of 10+ ms
    instead of microseconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for a bench module (skips when the client or a binary is missing)."""
    with running_server() as proc:
        yield proc
