"""Run selections of emulation tests in one pytest subprocess under a sanitizer.

The subprocess preloads the sanitizer runtime and loads the matching build of the
emulation harness (``KVB_EMU_FLAVOR``, see emu_runtime.py). ASan/UBSan catch
out-of-bounds or misaligned accesses and UB; TSan sees each CUDA thread as an OS thread
and barriers as condition variables, so an unordered shared-memory write/read races.
One subprocess per flavor for all its files: its start-up (Python, torch, collection
under the sanitizer runtime) alone costs ~8 CPU-s under ASan and ~13 under TSan.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

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


def selection_expression(selections: dict[str, str]) -> str:
    """One ``-k`` expression for ``{test file: its -k selection}``: each file's selection
    ANDed with its module name (a -k name matches the names of a test's parents too, the
    module's among them), so each file's selection picks what it picks run alone."""
    return " or ".join(
        f"({Path(test_file).stem} and ({selection}))"
        for test_file, selection in sorted(selections.items())
    )


def _passed_per_file(report: Path, test_files: list[str]) -> dict[str, int]:
    """``{test file: its passed tests}`` from a JUnit XML report (whose ``classname`` is
    the dotted module path, a test class's name appended)."""
    passed = dict.fromkeys(test_files, 0)
    for case in ElementTree.parse(report).iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            continue
        for part in case.get("classname", "").split("."):
            if f"{part}.py" in passed:
                passed[f"{part}.py"] += 1
    return passed


def run_sanitized(
    flavor: str, selections: dict[str, str], extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``-k selection`` of each ``tests/ops/test_file`` in ``{test_file: selection}``
    under ``flavor`` ("asan"/"tsan"), all in one pytest subprocess.

    Asserts that the run passed (the tail of its output as the message, which names the
    test that failed or was running when the sanitizer aborted), that each file's
    selection ran at least one test, and that the attention kernels the run looked up are
    the ones sanitized_kernels.py lists for the flavor (the build holds only those), and
    returns it.
    """
    runtime, options = SANITIZERS[flavor]
    build_library(flavor)
    with tempfile.TemporaryDirectory() as tmp:
        used_log = Path(tmp) / "used.txt"
        report = Path(tmp) / "report.xml"
        env = dict(os.environ, KVB_EMU_FLAVOR=flavor, LD_PRELOAD=_runtime(runtime), **options)
        # Unbuffered, so the name -v prints as a test starts is not lost when it aborts.
        env.update(extra_env or {}, KVB_EMU_USED_LOG=str(used_log), PYTHONUNBUFFERED="1")
        proc = subprocess.run(
            # -s: the sanitizer report goes to stderr, which capture would swallow on abort.
            [sys.executable, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", "-x",
             f"--junitxml={report}", *(str(HERE / name) for name in sorted(selections)),
             "-k", selection_expression(selections)],
            env=env, capture_output=True, text=True, timeout=3600, cwd=HERE.parents[1],
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
        passed = _passed_per_file(report, list(selections))
        used = sorted(
            {name for name in used_log.read_text().split() if is_attention(name)}
            if used_log.exists()
            else set()
        )
    for test_file in selections:
        assert passed[test_file] > 0, (
            f"the {flavor} selection of {test_file} ran no test: {selections[test_file]!r}"
        )
    listed = sorted(squeeze(name) for name in KERNELS[flavor])
    entry = tuple(name.replace(",", ", ") for name in used)
    assert used == listed, (
        f"the {flavor} run looks up other attention kernels than "
        f"tests/ops/sanitized_kernels.py lists for it (missing: "
        f"{sorted(set(used) - set(listed))}, unused: {sorted(set(listed) - set(used))}); "
        f"make its {flavor!r} entry {entry!r}"
    )
    return proc
