"""Where the CUDA headers are found: NVIDIA's wheels may be split across site dirs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from kvblocks.ops import cuda_sources, nvrtc_build


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")


def test_crt_headers_in_another_site_dir_are_found(tmp_path, monkeypatch):
    # The runtime wheel in one site dir, nvidia-cuda-crt installed with --target in another
    # (what a venv over a system torch gets): <mma.h> includes "crt/mma.h" from the second.
    system, target = tmp_path / "system" / "nvidia", tmp_path / "target" / "nvidia"
    _touch(system / "cu13/include/cuda_fp16.h")
    _touch(system / "cu13/include/mma.h")
    _touch(target / "cu13/include/crt/mma.h")
    real = importlib.util.find_spec
    fake = SimpleNamespace(submodule_search_locations=[str(system), str(target)])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: fake if name == "nvidia" else real(name)
    )
    dirs = cuda_sources.cuda_include_dirs()
    assert system / "cu13/include" in dirs
    assert target / "cu13/include" in dirs
    assert f"-I{target / 'cu13/include'}" in cuda_sources.nvrtc_options("sm_90", cuda_major=13)


def test_a_missing_crt_header_names_the_wheel():
    log = 'mma.h(55): catastrophic error: cannot open source file "crt/mma.h"'
    assert "nvidia-cuda-crt" in nvrtc_build._missing_header_hint(log)
    assert nvrtc_build._missing_header_hint("error: identifier x is undefined") == ""
