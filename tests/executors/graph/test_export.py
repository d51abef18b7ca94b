"""Exported graphs: readable code on disk that loads back and computes the same values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import remat
from remat.executors.graph.export import load_graphs
from remat.models import TinyGPT


def test_export_loads_back_and_runs_the_same(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=1, seq=16)
    model.eval()
    x = torch.randint(0, 64, (2, 16))
    fast = remat.optimize(model, x, plan="keep_matmuls")
    folder = fast.export(tmp_path / "out")
    moved = shutil.move(str(folder), str(tmp_path / "moved"))  # the folder is movable
    graphs = load_graphs(moved)
    original = fast._first.executor.graphs
    for part in ("forward", "backward", "inference"):
        on_disk = (Path(moved) / part / "module.py").read_text()
        ops = [ln.strip() for ln in getattr(original, part).code.splitlines() if "= torch" in ln]
        assert ops and all(op in on_disk for op in ops), part  # every op, readable...
        positions = [on_disk.index(op) for op in ops]
        assert positions == sorted(positions), part  # ...in execution order
    assert "args_list.clear()" in (Path(moved) / "backward" / "module.py").read_text()
    assert json.loads((Path(moved) / "plan.json").read_text())["saved"] == sorted(fast.plan.saved)
    ex = fast._first.executor
    primals = [fast._primal(role, key, [x]) for role, key in ex.primal_keys]
    with torch.no_grad():
        for a, b in zip(graphs.inference(*primals), original.inference(*primals), strict=True):
            assert torch.equal(a, b)
