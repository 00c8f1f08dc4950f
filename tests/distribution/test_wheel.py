"""The distributable files: what ``make wheel`` builds installs and runs on a clean machine.

One test builds the sdist and, from the unpacked sdist, the manylinux abi3 wheel
(``.ci/build-dist``, the recipe behind ``make wheel``), installs the wheel into a fresh
virtual environment that has nothing but pip (numpy comes from PyPI or pip's cache), and runs
the README's first example there, outside the source tree. It costs about 30 CPU-s (20-30 s
on two cores), from a fresh clone too: the two crates of the unpacked sdist compile each time,
the crates.io dependencies are the ones ``make build`` compiled into ``target/``. It runs in
``make test``; ``make test-wheel`` runs it alone. The fresh venv gets numpy from PyPI or pip's
cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvblocks._core as tree_core

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# What a build from the sdist needs, relative to its top directory.
_SDIST_REQUIRED = (
    "Cargo.toml",
    "Cargo.lock",
    "pyproject.toml",
    "README.md",
    "rust/kvblocks-core/Cargo.toml",
    "rust/kvblocks-core/src/lib.rs",
    "rust/kvblocks-py/Cargo.toml",
    "rust/kvblocks-py/src/lib.rs",
    "python/kvblocks/__init__.py",
    "python/kvblocks/_core.pyi",
    "python/kvblocks/py.typed",
    "python/kvblocks/ops/_cuda/split_k_attention.cu",
    "python/kvblocks/ops/_cuda/cache_ops.cu",
    "python/kvblocks/ops/_cuda/kv_common.cuh",
)

pytestmark = pytest.mark.wheel


def _first_readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "README.md has no python example"
    assert "KVCacheManager" in blocks[0], "the README's first example is the block-manager tour"
    return blocks[0]


def _clean_env() -> dict[str, str]:
    """This process's environment minus anything that would leak the source tree or venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel) built by ``.ci/build-dist``."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [str(ROOT / ".ci" / "build-dist"), str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sdist,) = out.glob("kvblocks-*.tar.gz")
    (wheel,) = out.glob("kvblocks-*.whl")
    return sdist, wheel


def test_sdist_holds_what_a_build_needs(dist: tuple[Path, Path]) -> None:
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    missing = [path for path in _SDIST_REQUIRED if path not in members]
    assert not missing, f"sdist lacks {missing}"
    # The kernel sources are symlinks into cuda/ in the repository; the sdist must carry them
    # as files, or an install from it has no kernels to compile.
    for path in _SDIST_REQUIRED:
        assert members[path].isfile(), f"{path} is not a regular file in the sdist"
    built = [name for name in members if name.endswith((".so", ".pyd", ".whl"))]
    assert not built, f"sdist carries build outputs {built}"


def test_wheel_is_manylinux_abi3(dist: tuple[Path, Path]) -> None:
    _, wheel = dist
    # PyPI refuses plain linux_x86_64; abi3 means one wheel serves CPython 3.10 and later.
    assert re.fullmatch(
        r"kvblocks-[^-]+-cp310-abi3-manylinux2014_x86_64\.manylinux_2_17_x86_64\.whl", wheel.name
    ), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        tags = [
            line.split(":", 1)[1].strip()
            for line in zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL")))
            .decode()
            .splitlines()
            if line.startswith("Tag:")
        ]
    assert tags == ["cp310-abi3-manylinux2014_x86_64", "cp310-abi3-manylinux_2_17_x86_64"]
    assert "kvblocks/_core.abi3.so" in names
    assert "kvblocks/py.typed" in names
    assert "kvblocks/ops/_cuda/split_k_attention.cu" in names


def test_wheel_installs_into_a_clean_venv_and_runs_the_readme_tour(
    dist: tuple[Path, Path], tmp_path: Path
) -> None:
    _, wheel = dist
    venv = tmp_path / "venv"
    env = _clean_env()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=300)
    python = venv / "bin" / "python"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr

    example = tmp_path / "readme_tour.py"
    example.write_text(
        "import kvblocks\n"
        f"assert kvblocks.__file__.startswith({str(venv)!r}), kvblocks.__file__\n"
        + _first_readme_example(),
        encoding="utf-8",
    )
    # cwd outside the repository: only the installed wheel can be imported.
    run = subprocess.run(
        [str(python), str(example)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[1 2 3]" in run.stdout

    # The wheel's extension has the API of the one built from the tree (a stale build of an
    # older source would not).
    api = (
        "import json, kvblocks._core as c; "
        "print(json.dumps([sorted(dir(c)), sorted(dir(c.KVCacheManager))]))"
    )
    installed = subprocess.run(
        [str(python), "-c", api], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stderr
    assert json.loads(installed.stdout) == [
        sorted(dir(tree_core)),
        sorted(dir(tree_core.KVCacheManager)),
    ]

    # The console script is installed, and the clean venv (no torch) gets the extras hint.
    version = subprocess.run(
        [str(venv / "bin" / "kvblocks"), "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("kvblocks ")
    ops = subprocess.run(
        [str(python), "-c", "import kvblocks.ops"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ops.returncode != 0
    assert "ImportError: kvblocks.ops needs torch: pip install 'kvblocks[torch]'" in ops.stderr
