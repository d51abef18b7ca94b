"""Plan files: round trip, re-applied without solving, mismatched and corrupt files refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import remat
from remat.models import TinyGPT
from remat.plan.files import PlanFileError
from tests.checks import assert_trains_like_eager


def _model(seq: int = 16) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=32), torch.randint(0, 64, (2, seq))


def test_round_trip_reapplies_the_same_plan(tmp_path: Path) -> None:
    model, x = _model()
    fast = remat.optimize(model, x, plan="keep_matmuls")
    path = fast.save_plan(tmp_path / "plan.json")
    doc = json.loads(path.read_text())
    assert doc["saved"] == sorted(fast.plan.saved)
    assert doc["predicted_peak_bytes"] == fast.plan.predicted_peak_bytes
    assert doc["torch_version"] == torch.__version__
    assert set(doc["decisions"]) == set(fast.plan.decisions)  # the audit record
    again = remat.optimize(model, x, plan=str(path))
    assert again.plan.saved == fast.plan.saved
    assert again.plan.predicted_peak_bytes == fast.plan.predicted_peak_bytes
    assert "loaded from" in again.plan.reason
    assert_trains_like_eager(model, (x,), {}, steps=1, plan=path)


def test_a_plan_for_other_shapes_is_refused(tmp_path: Path) -> None:
    model, x = _model(seq=16)
    path = remat.optimize(model, x, plan="keep_matmuls").save_plan(tmp_path / "p.json")
    _, longer = _model(seq=32)
    with pytest.raises(PlanFileError, match="different graph") as err:
        remat.optimize(model, longer, plan=path)
    assert "Plan again" in str(err.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not readable JSON"),
        ('{"format": "something-else"}', "not a remat plan file"),
        ('{"format": "remat-plan", "version": 99}', "version 99"),
        ('{"format": "remat-plan", "version": 1, "saved": "x"}', "corrupt"),
        ('{"format": "remat-plan", "version": 1, "offload_all": true}', "offload_all"),
    ],
)
def test_corrupt_files_get_a_clear_error(tmp_path: Path, content: str, match: str) -> None:
    model, x = _model()
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PlanFileError, match=match):
        remat.optimize(model, x, plan=path)


def test_missing_file(tmp_path: Path) -> None:
    model, x = _model()
    with pytest.raises(PlanFileError, match="does not exist"):
        remat.optimize(model, x, plan=str(tmp_path / "nope.json"))
