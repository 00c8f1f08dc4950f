"""Shared pytest configuration: the ``gpu`` marker skips cleanly on machines without a GPU."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("cupy") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests unless torch sees a CUDA device and CuPy is installed."""
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with torch and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
