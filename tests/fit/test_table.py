"""``remat fit``: each answer checked by planning concrete captures at it and one size up."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from remat.budget import Options
from remat.cli import main
from remat.executors.graph.analyze import analyze
from remat.fit import FitReport, fit
from remat.fit.graph_shapes import Dims, inputs_at
from remat.request import model_static_memory
from remat.solver.plan import Proof, make_plan
from tests.zoo import llama

_CACHE: dict[str, Any] = {}


def _report() -> tuple[Any, tuple[Any, ...], FitReport]:
    if "r" not in _CACHE:
        torch.manual_seed(0)
        model = llama(3, 128)
        args = (torch.randint(0, 128, (2, 32)),)
        static = model_static_memory(model, Options()).total
        # Room for no checkpointing up to about length 64 at batch 2.
        report = fit(model, args, budget_bytes=static + 3_000_000, reserve_fraction=0.0,
                     device_profile="h100", max_seq=128, time_limit_s=2.0)  # fmt: skip
        _CACHE["r"] = (model, args, report)
    return _CACHE["r"]


def _fits(model: Any, args: Any, report: FitReport, name: str, b: int, s: int) -> bool:
    """Plan a concrete capture at (b, s) as the row does: its saved sets, its rule."""
    a, kw = inputs_at(args, {}, Dims.of(args, {}), b, s)
    problem = analyze(model, a, kw, device_profile="h100").problem
    assert report.planner is not None
    candidates = next(c for r, c in report.planner.by_range if r.contains(b, s))
    step_budget = report.budget.step_budget_bytes
    options = []
    for c in candidates:
        plan = make_plan(problem, c.saved, solver=c.name, reason="", proof=Proof.HEURISTIC)
        sim = plan.simulation
        pct = 100 * sim.recompute_time_s / sim.step_time_s
        options.append((c.name, plan.predicted_peak_bytes, pct))
    fixed = {
        "no checkpointing": "keep_all",
        "Megatron selective": "megatron",
        "every block": "block",
    }
    if name in fixed:
        peaks = [p for n, p, _ in options if n == fixed[name]]
    elif name == "least peak":
        peaks = [p for _, p, _ in options]
    else:
        cap = float(name.removeprefix("remat <= ").removesuffix("%"))
        peaks = [p for _, p, pct in options if pct <= cap + 1e-9]
    return bool(peaks) and min(peaks) <= step_budget


def test_each_answer_fits_and_the_next_size_does_not(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One fit (about 25 s) and everything checked on it, in one test so that the xdist
    workers do not each compute it: a row's answers against concrete captures at them and
    one size up (a capture each, about 1.5 s: the recompute-capped row, whose choice takes
    the most of the fit; the formula's exactness at unseen shapes is
    ``tests/fit/test_formula.py``'s), every row's against the report's own choices there,
    the rows against each other, and the command line over the report."""
    _check_row("remat <= 10%", concrete=True)
    for name in ("no checkpointing", "every block", "least peak"):
        _check_row(name, concrete=False)
    _check_rows()
    _check_cli(capsys, monkeypatch)


def _check_row(name: str, *, concrete: bool) -> None:
    """``name``'s longest sequence and largest batch fit and one more does not: planned on
    concrete captures (``concrete``), else as the report chooses at those shapes."""
    model, args, report = _report()
    row = report.plans[name]
    assert row.max_seq is not None and row.max_batch is not None

    def fits(b: int, s: int) -> bool:
        if concrete:
            return _fits(model, args, report, name, b, s)
        choice = report.choose(name, b, s)
        return choice is not None and choice.step_peak_bytes <= report.budget.step_budget_bytes

    assert fits(report.batch, row.max_seq)
    if row.max_seq < 128:
        assert not fits(report.batch, row.max_seq + 1)
    assert fits(row.max_batch, 32)
    assert not fits(row.max_batch + 1, 32)


def _check_rows() -> None:
    """Checkpointing fits longer sequences than keeping everything."""
    _, _, report = _report()
    rows = report.plans
    assert rows["every block"].max_seq > rows["no checkpointing"].max_seq  # type: ignore[operator]
    assert rows["least peak"].max_seq >= rows["every block"].max_seq  # type: ignore[operator]
    caps = [rows[f"remat <= {c}%"].max_seq or 0 for c in (5, 10, 20)]
    assert caps == sorted(caps)
    for name, row in rows.items():
        if row.at_max_seq is not None and name.startswith("remat <= "):
            assert row.at_max_seq.recompute_pct <= float(name[9:-1]) + 1e-9


def _check_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line over the report the checks above use (one fit fewer in CI)."""
    _, _, report = _report()
    monkeypatch.setattr("remat.cli.fit.fit", lambda *a, **k: report)
    assert main(["fit", "tests.zoo:tiny_llama_factory", "--budget-gb", "0.02", "--device",
                 "h100", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert set(out["plans"]) >= {"no checkpointing", "every block", "least peak", "remat <= 5%"}
    row = out["plans"]["every block"]
    assert set(row) == {"max_seq", "max_batch", "peak_bytes_at_max", "recompute_pct"}
    assert row["max_seq"] == report.plans["every block"].max_seq
    assert "Max(" in out["formula"]
    assert main(["fit", "tests.zoo:tiny_llama_factory", "--budget-gb", "0.02"]) == 0
    text = capsys.readouterr().out
    assert "every block" in text and "step peak = max of" in text
