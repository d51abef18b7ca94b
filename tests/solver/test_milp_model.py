"""The exact MILP's memory model equals the simulator at every moment it models.

For plans of several solvers on real joint graphs, the binaries are fixed to the plan (saved
set and the executor's recompute stages) and the model's peak is minimised: that is the
largest modelled live total, which must equal the simulator's largest live total over the same
moments (all but those inside a recomputation group, which the MILP adds lazily as cuts).
"""

from __future__ import annotations

import pulp
import pytest
import torch

import remat
from remat.solver import Proof, make_plan
from remat.solver.backend import backend
from remat.solver.compress import compress
from remat.solver.config import SolverConfig
from remat.solver.milp_model import MilpModel, start_values
from remat.solver.registry import HEURISTICS, solve
from tests.zoo import ZOO

CASES = [c for c in ZOO if c.name in ("tiny_gpt", "hf_gpt2", "cnn_bn", "tied")]


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "compressed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_model_peak_equals_simulated_peak_at_modelled_moments(
    case: object, compressed: bool
) -> None:
    torch.manual_seed(0)
    problem = remat.analyze(case.build(), case.inputs(), case.kwargs).problem  # type: ignore[attr-defined]
    comp = compress(problem)
    checked = 0
    for name in HEURISTICS:
        try:
            plan = solve(problem, solver=name, budget_bytes=None)
        except ValueError:
            continue
        if compressed:  # the model the solver builds: views merged, chains folded
            plan = make_plan(
                comp.problem, comp.lower(plan.saved), solver=name, reason="", proof=Proof.HEURISTIC
            )
            model = MilpModel(comp.problem, None, comp.fold)
        else:
            model = MilpModel(problem, None)
        start = start_values(model, plan)
        assert start, f"{name}: the plan's recompute stages are not in the model"
        for var, value in start.items():
            var.lowBound = var.upBound = value
        # Every continuous variable at its least value: each moment's modelled live total.
        model.lp.setObjective(pulp.lpSum(model.lp.variables()))
        model.lp.solve(backend(SolverConfig(time_limit_s=60), 60, {}))
        assert pulp.LpStatus[model.lp.status] == "Optimal", name
        peak = float(pulp.value(model.M))

        def modelled(name: str, lp: pulp.LpProblem = model.lp, peak: float = peak) -> float:
            return float(lp.get_constraint_by_name(name).value()) + peak

        timeline = plan.simulation.timeline
        fw = {s.name: s.allocated_bytes for s in timeline if s.phase == "forward"}
        bw = {s.name: s.allocated_bytes for s in timeline if s.phase == "backward"}
        for t, op in enumerate(model.stages):
            assert modelled(f"mem_stage_{t}") == pytest.approx(bw[op], abs=0.5), (name, op)
        for k, op in enumerate(model.fwd):
            if op in fw:
                assert modelled(f"mem_fw_{k}") == pytest.approx(fw[op], abs=0.5), (name, op)
        simulated = max(s.allocated_bytes for s in timeline if not s.recompute)
        assert peak == pytest.approx(simulated, abs=0.5), name
        checked += 1
    assert checked >= 5
