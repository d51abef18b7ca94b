"""``remat.apply`` under ``torch.distributed``: one plan for the group, solved on its first
rank and broadcast; a rank that traced another step is an error, never a rank training
another plan, and the first rank's budget error reaches every rank (2 gloo processes, CPU)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import remat
from tests.executors.sac import agree_worker
from tests.executors.sac.ranks import spawn
from tests.executors.sac.test_distributed import _free_port

WORLD = 2


def _budget() -> int:
    """Half-way between every block recomputed and none: a plan with a choice in it."""
    model = agree_worker._model()
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    least, most = (
        remat.plan_of(remat.apply(copy.deepcopy(model), tokens, plan=p)).predicted_peak_bytes
        for p in ("block", "keep_all")
    )
    return (least + most) // 2


def test_ranks_train_the_first_rank_s_plan(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    spawn(agree_worker.main, (WORLD, _budget(), str(tmp_path)), WORLD)
    first, second = (torch.load(tmp_path / f"{r}.pt") for r in range(WORLD))
    assert "error" not in first["same"] and "error" not in second["same"], (first, second)
    assert second["same"]["saved"] == first["same"]["saved"]
    assert second["same"]["peak"] == first["same"]["peak"]
    assert second["same"]["reason"].startswith("planned on rank 0 and broadcast")
    assert "error" not in first["differs"]
    assert second["differs"]["error"] == "PlanFileError"
    assert "rank 1 traced another step than rank 0" in second["differs"]["message"]
    # The first rank's BudgetError, with its figures and words, on every rank.
    assert first["fails"]["error"] == second["fails"]["error"] == "BudgetError"
    assert second["fails"]["message"] == first["fails"]["message"]


def test_group_needs_torch_distributed() -> None:
    model = agree_worker._model()
    tokens = torch.randint(0, 64, (2, 32))
    with pytest.raises(ValueError, match="group= needs torch.distributed initialized"):
        remat.apply(model, tokens, activation_budget_bytes=10**9, group=object())  # type: ignore[arg-type]
