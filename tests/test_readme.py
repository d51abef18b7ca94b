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
