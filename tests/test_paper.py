"""The paper's tables are generated from the committed CSVs, never typed by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_paper_tables_match_the_committed_csvs() -> None:
    # Loaded by path: a module named "build" on sys.path would shadow PyPA's build package.
    spec = importlib.util.spec_from_file_location("paper_build", ROOT / "paper" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)

    text = build.PAPER.read_text()
    assert build.build(text) == text, "paper/paper.md is out of date: run python paper/build.py"
    # Every table the builder knows is in the paper, filled in.
    for name in build.TABLES:
        start = text.index(f"<!-- table:{name} -->")
        end = text.index(f"<!-- /table:{name} -->")
        assert text[start:end].count("\n|") >= 3, name
