"""Run a selection of emulation tests in a pytest subprocess under a sanitizer.

The subprocess preloads the sanitizer runtime and loads the matching build of the
emulation harness (``KVB_EMU_FLAVOR``, see emu_runtime.py). ASan/UBSan catch
out-of-bounds or misaligned accesses and UB; TSan sees each CUDA thread as an OS thread
and barriers as condition variables, so an unordered shared-memory write/read races.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from emu_runtime import build_library
from sanitized_kernels import KERNELS, is_attention, squeeze

HERE = Path(__file__).resolve().parent

# flavor -> (runtime library to preload, its options)
SANITIZERS: dict[str, tuple[str, dict[str, str]]] = {
    "asan": (
        "libasan.so",
        {
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        },
    ),
    "tsan": ("libtsan.so", {"TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0"}),
}


def _runtime(name: str) -> str:
    out = subprocess.run(
        [os.environ.get("CXX", "g++"), f"-print-file-name={name}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not os.path.isabs(out):
        pytest.skip(f"g++ has no {name}")
    return out


def run_sanitized(
    flavor: str, test_file: str, selection: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``-k selection`` of ``tests/ops/test_file`` under ``flavor`` ("asan"/"tsan").

    Asserts that the run passed (the tail of its output as the message) and that the
    attention kernels it looked up are the ones sanitized_kernels.py lists for it (the
    build holds only those), and returns it.
    """
    runtime, options = SANITIZERS[flavor]
    build_library(flavor)
    with tempfile.TemporaryDirectory() as tmp:
        used_log = Path(tmp) / "used.txt"
        env = dict(os.environ, KVB_EMU_FLAVOR=flavor, LD_PRELOAD=_runtime(runtime), **options)
        env.update(extra_env or {}, KVB_EMU_USED_LOG=str(used_log))
        proc = subprocess.run(
            # -s: the sanitizer report goes to stderr, which capture would swallow on abort.
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-x",
             str(HERE / test_file), "-k", selection],
            env=env, capture_output=True, text=True, timeout=3600, cwd=HERE.parents[1],
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
        assert " passed" in proc.stdout
        used = sorted(
            {name for name in used_log.read_text().split() if is_attention(name)}
            if used_log.exists()
            else set()
        )
    listed = sorted(squeeze(name) for name in KERNELS[flavor].get(test_file, ()))
    entry = tuple(name.replace(",", ", ") for name in used)
    assert used == listed, (
        f"the {flavor} run of {test_file} looks up other attention kernels than "
        f"tests/ops/sanitized_kernels.py lists for it; make its entry {entry!r}"
    )
    return proc
