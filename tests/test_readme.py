"""The README's Python example runs as written (the READMEs of Checkmate and Rockmate call
APIs that do not exist; ours is executed in CI)."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_example_runs() -> None:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "no python example in the README"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


ROOT = Path(__file__).parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "experiments" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]


def test_the_docs_link_only_files_in_the_repository() -> None:
    """Every relative link of the READMEs and ``docs/`` names a file of the repository, and
    none points outside it (a reader of a clone has nothing else)."""
    assert (ROOT / "docs" / "design.md").is_file()
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), (doc.name, target)
