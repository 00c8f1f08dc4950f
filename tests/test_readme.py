"""The Python examples of the README and of every page in docs/ run as written, so the docs
cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCKS = [
    (page, index, block)
    for page in PAGES
    for index, block in enumerate(
        re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    )
]


def test_readme_has_examples() -> None:
    assert sum(page.name == "README.md" for page, _, _ in _BLOCKS) >= 3


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_relative_links_resolve() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.name} links a missing {target}"


@pytest.mark.parametrize(
    ("page", "index", "source"),
    _BLOCKS,
    ids=[f"{page.name}[{index}]" for page, index, _ in _BLOCKS],
)
def test_readme_example_runs(page: Path, index: int, source: str) -> None:
    code = compile(source, f"{page.relative_to(ROOT)}[python block {index}]", "exec")
    exec(code, {"__name__": "readme"})
