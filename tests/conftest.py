"""Shared pytest configuration: the ``gpu`` marker skips cleanly on machines without a GPU,
and the sanitizer builds of the CUDA emulator start in the background when a session will
need them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EMU_RUNTIME = Path(__file__).resolve().parent / "ops" / "emu_runtime.py"
#: Emulator flavors built ahead, longest first: the ASan build takes ~40 s of one core on
#: a fresh clone (only the kernels its tests launch, tests/ops/sanitized_kernels.py), which
#: the session otherwise waits for when it reaches the sanitizer tests; built beside the
#: tests it uses the second core instead.
PREBUILT_FLAVORS = ("asan", "tsan")
#: The default (``opt``) build every emulation test loads: ~60 CPU-s of g++ on a fresh
#: clone. Built on demand, the first emulation test of each pytest worker waited for it (the
#: fresh-clone profile: 119 s and 107 s for the two "every instantiation is in the harness"
#: tests, on two workers at once: one core idle); started at collection it is built beside
#: the tests that come first. Built before the sanitizer flavors: far more tests load it.
EMU_FLAVOR = "opt"
_prebuild: subprocess.Popen[bytes] | None = None


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("cupy") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.fixture(autouse=True, scope="session")
def _weights_digest_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Checkpoint digests (``kvblocks.tiers.weights``) are cached in a directory of this
    session, never in the user's ~/.cache; subprocesses inherit it."""
    name = "KVBLOCKS_WEIGHTS_CACHE"
    old = os.environ.get(name)
    os.environ[name] = str(tmp_path_factory.mktemp("weights-cache"))
    yield
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


#: Seconds each of the slowest test files takes on two cores (``make test`` on a fresh
#: clone, per-test wall times summed; measured 2026-11-29), for
#: :func:`pytest_collection_modifyitems`: under ``--dist loadfile`` each file runs on one
#: worker, and a heavy file handed out last keeps one worker busy while the other idles, so
#: the files go out heaviest first (files not listed follow, in collection order). Only the
#: order depends on these numbers: a stale entry costs balance, never coverage.
FILE_SECONDS = {
    "ops/test_ops_nvrtc.py": 186,
    "ops/test_ops_emulation_scale.py": 186,
    "ops/test_sanitizers.py": 35,
    "cli/test_generate_tiers.py": 33,
    "cli/test_simulate.py": 28,
    "distribution/test_wheel.py": 26,
    "scheduler/test_content_oracle.py": 18,
    "ops/test_prefill_kernel_emulation.py": 16,
    "ops/test_kernel_model.py": 12,
    "engine/test_remote_tier_async.py": 11,
    "ops/test_ops_kernel_cache.py": 11,
    "engine/test_families.py": 9,
    "scheduler/test_content_oracle_state.py": 9,
    "engine/test_emulated_cuda.py": 8,
    "core/test_content_oracle.py": 8,
    "simulate/test_cli.py": 7,
    "core/test_content_oracle_state.py": 7,
    "engine/test_random_hybrid_workloads.py": 7,
    "ops/test_decode_kernel_emu.py": 7,
    "ops/test_ops_emulation.py": 7,
    "core/test_state_machine.py": 7,
    "simulate/test_capacity.py": 7,
    "ops/test_ops_emu_runtime.py": 6,
    "core/test_content_oracle_groups.py": 6,
    "cli/test_generate.py": 6,
    "engine/test_disk_tier_engine.py": 6,
    "engine/test_attention_groups.py": 5,
    "simulate/test_fleet_cli.py": 4,
    "engine/test_llm.py": 4,
    "events/test_scheduler_events.py": 4,
    "core/test_content_oracle_host_tier.py": 4,
    "core/test_stubs.py": 4,
}
TESTS_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--dist loadfile`` the files go to the workers in the order the workers
    collected them (:func:`pytest_collection_modifyitems`), not in xdist's default order
    (most tests first, which hands the heavy files of one to five tests out last)."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def _file_seconds(item: pytest.Item) -> int:
    try:
        name = item.path.relative_to(TESTS_DIR).as_posix()
    except ValueError:
        return 0
    return FILE_SECONDS.get(name, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker (whose collection order is the order its controller hands the
    tests out in), order the files heaviest first (the tests of a file keep their order;
    see :data:`FILE_SECONDS`); skip ``@pytest.mark.gpu`` tests unless torch sees a CUDA
    device and CuPy is installed."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: -_file_seconds(item))  # stable: files stay contiguous
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with torch and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _uses_emulator(item: pytest.Item) -> bool:
    """Whether ``item``'s module imported the emulator's runtime (``tests/ops/emu_runtime``)
    or something from it."""
    module = getattr(item, "module", None)
    return module is not None and any(
        getattr(value, "__name__", None) == "emu_runtime"
        or getattr(value, "__module__", None) == "emu_runtime"
        for value in vars(module).values()
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the emulator's flavors that the collected tests will load: the
    ``opt`` build when a collected test's module uses the emulator, the sanitizer flavors
    when a collected test runs under one.

    The builder takes each flavor's build lock, so a test that needs a flavor waits for
    the build in progress rather than starting its own; a build it finds done is reused.
    A sanitizer run's own pytest (``KVB_EMU_FLAVOR`` set) finds its flavor built already.
    """
    global _prebuild
    if session.config.option.collectonly or shutil.which("g++") is None:
        return
    if "KVB_EMU_FLAVOR" in os.environ:
        return
    flavors = [EMU_FLAVOR] if any(_uses_emulator(item) for item in session.items) else []
    if any("sanitizer" in item.nodeid for item in session.items):
        flavors += PREBUILT_FLAVORS
    if not flavors:
        return
    _prebuild = subprocess.Popen(
        [sys.executable, str(EMU_RUNTIME), *flavors],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: stopping it stops its g++ too
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop a background build the session no longer needs (a build is renamed into place
    only when complete, so stopping it leaves no half-written library)."""
    if _prebuild is not None and _prebuild.poll() is None:
        os.killpg(_prebuild.pid, signal.SIGTERM)
        _prebuild.wait()
