"""The paper's tables are generated from the committed CSVs, never typed by hand."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_paper_tables_match_the_committed_csvs() -> None:
    sys.path.insert(0, str(ROOT / "paper"))
    import build

    text = build.PAPER.read_text()
    assert build.build(text) == text, "paper/paper.md is out of date: run python paper/build.py"
    # Every table the builder knows is in the paper, filled in.
    for name in build.TABLES:
        start = text.index(f"<!-- table:{name} -->")
        end = text.index(f"<!-- /table:{name} -->")
        assert text[start:end].count("\n|") >= 3, name
