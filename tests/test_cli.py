"""The README's main job, on a tiny configuration."""

from __future__ import annotations

import pytest

from remat.cli import main


def test_demo_runs_and_reports_equal(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--layers", "2", "--dim", "32", "--heads", "2", "--vocab", "64",
                 "--seq", "16", "--batch", "2", "--steps", "1", "--time-limit", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    for plan in ("keep_all", "keep_inputs", "keep_matmuls", "block", "megatron", "auto @"):
        assert plan in out
    assert "DIFFER" not in out and out.count("equal") >= 7
