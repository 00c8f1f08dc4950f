"""The README's Python examples run as written, so the docs cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(_BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(_BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    source = _BLOCKS[index]
    exec(compile(source, f"README.md[python block {index}]", "exec"), {"__name__": "readme"})
