"""A kernel cache directory that cannot be written is an operational fault: logged on the
``kvblocks.ops`` logger, and the kernels go to a directory of this process's own."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvblocks.ops import kernel_cache


@pytest.fixture
def fresh_cache_state() -> Iterator[None]:
    saved = kernel_cache._fallback_dir
    kernel_cache._fallback_dir = None
    yield
    kernel_cache._fallback_dir = saved


@pytest.mark.usefixtures("fresh_cache_state")
def test_an_unwritable_cache_dir_is_logged_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(blocker / "kernels"))
    at_exit: list[tuple[object, tuple[object, ...], dict[str, object]]] = []
    monkeypatch.setattr(
        kernel_cache.atexit, "register", lambda f, *a, **k: at_exit.append((f, a, k))
    )
    with caplog.at_level(logging.WARNING, logger="kvblocks.ops"):
        directory = kernel_cache._writable_dir()
    assert directory != blocker / "kernels" and directory.is_dir()
    (record,) = [r for r in caplog.records if r.name == "kvblocks.ops"]
    assert "is not writable" in record.getMessage() and str(directory) in record.getMessage()
    # The directory is this process's alone and goes when it exits, with what was compiled
    # into it (it stayed in the temp dir, one per process).
    (directory / "k.cubin").write_bytes(b"x")
    for func, args, kwargs in at_exit:
        func(*args, **kwargs)  # type: ignore[operator]
    assert not directory.exists()


@pytest.mark.usefixtures("fresh_cache_state")
def test_a_writable_cache_dir_is_used_without_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "kernels"))
    with caplog.at_level(logging.WARNING, logger="kvblocks.ops"):
        assert kernel_cache._writable_dir() == tmp_path / "kernels"
    assert not [r for r in caplog.records if r.name == "kvblocks.ops"]
