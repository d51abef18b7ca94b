"""The README and the documentation say what runs: every code block is executed, the site
builds, and every link resolves.

A block that must not run here (``torchrun``, CUDA, installing packages) is marked with an
HTML comment on the line before its fence, giving the reason::

    <!-- show-only: launches 8 processes with torchrun -->

``python`` blocks run in a fresh interpreter and ``bash`` blocks under ``bash -e``, each in an
empty folder with this environment's ``remat`` and ``python`` first on ``PATH``; ``text``
blocks are output and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = [*PAGES, ROOT / "experiments" / "README.md"]
RUN = {"python", "bash"}
SHOWN = {"text", "toml", "yaml", "json"}
SHOW_ONLY = re.compile(r"<!--\s*show-only:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    show_only: str | None  # the reason, where the block is not run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, with the show-only reason of the line before each."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: a fence that is never closed"
        marker = SHOW_ONLY.search(lines[start - 1]) if start else None
        out.append(
            Block(
                page,
                start + 1,
                m.group(1),
                "\n".join(lines[start + 1 : i]) + "\n",
                marker.group(1) if marker else None,
            )
        )
        i += 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.language in RUN and b.show_only is None]


def test_every_block_is_run_or_says_why_not() -> None:
    """A fence names its language; one that is not run says why, and only code is marked."""
    assert len(RUNNABLE) >= 5, "the README and docs run almost no code"
    for b in ALL:
        assert b.language in RUN | SHOWN, f"{b.name}: fence language {b.language!r}"
        if b.show_only is not None:
            assert b.show_only, f"{b.name}: show-only with no reason"
            assert b.language in RUN, f"{b.name}: show-only on a {b.language} block"
    for page in PAGES:
        text = page.read_text()
        indented = [n + 1 for n, line in enumerate(text.splitlines()) if re.match(r"\s+```", line)]
        assert not indented, f"{page.name}: indented fences (neither run nor checked) at {indented}"
        marked = len(SHOW_ONLY.findall(text))
        assert marked == sum(b.show_only is not None for b in ALL if b.page == page), (
            f"{page.name}: a show-only marker not directly above a fence"
        )


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [sys.executable, "-c", block.code] if block.language == "python" else None
    cmd = cmd or ["bash", "-e", "-c", block.code]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, (
        f"{block.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


def test_the_site_builds(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the navigation, every link between pages and
    every anchor resolves, and the API reference renders from the docstrings."""
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    assert nav == {p.name for p in (ROOT / "docs").glob("*.md")}, "a page outside the nav"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "Plan a selective-checkpoint policy per block" in reference


def test_the_docs_link_only_files_in_the_repository() -> None:
    """Every relative link of the READMEs and ``docs/`` names a file of the repository, and
    none points outside it (a reader of a clone has nothing else)."""
    assert (ROOT / "docs" / "design.md").is_file()
    for doc in DOCS:
        text = doc.read_text()
        for up in re.findall(r"(?:\.\./)+[\w./-]+", text):  # named in prose, not only linked
            assert (doc.parent / up).resolve().is_relative_to(ROOT), (doc.name, up)
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), (doc.name, target)


def test_the_readme_is_for_users() -> None:
    """The README stays a short guide: details live in ``docs/``, figures in experiments."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 170
    for narration in ("last run", "this machine", "lent GPU"):
        assert narration not in text, narration
    assert not re.search(r"#\d+\b", text), "a '#N' reference: the README says what the product does"
