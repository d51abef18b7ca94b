"""Peak descent (remat.solver.descent) and its place in ``auto``."""

from __future__ import annotations

import math

from hypothesis import given, settings

from remat.problem import Problem
from remat.solver import Proof, make_plan
from remat.solver.config import SolverConfig
from remat.solver.descent import descend
from remat.solver.registry import _descents, solve
from remat.solver.schedule import build_schedule
from tests.solver.test_exact import exhaustive, optimum
from tests.solver.test_schedule_properties import problems
from tests.solver.test_solvers import _layers

NEVER = math.inf
"""No deadline: what these tests check must not depend on how fast the machine is."""


@settings(max_examples=40, deadline=None)
@given(problems())
def test_a_descent_fits_and_never_beats_the_optimum(
    case: tuple[Problem, frozenset[str]],
) -> None:
    prob, _ = case
    start = solve(prob, solver="keep_all", budget_bytes=None)
    results = exhaustive(prob)
    for budget in sorted({start.predicted_peak_bytes - 1, start.predicted_peak_bytes // 2}):
        plan = descend(prob, start, budget_bytes=budget, deadline=NEVER)
        if plan is None:
            continue
        build_schedule(prob, plan.saved)  # runnable
        assert plan.predicted_peak_bytes <= budget
        again = make_plan(prob, plan.saved, solver="x", reason="", proof=Proof.HEURISTIC)
        assert again.predicted_peak_bytes == plan.predicted_peak_bytes
        if results is not None:
            best = optimum(results, budget)
            assert best is not None and plan.recompute_time_s >= best - 1e-12


def test_one_step_below_keep_all_recomputes_the_most_bytes_per_second() -> None:
    """On a chain of layers, just under keep_all's peak one value recomputed is enough, and
    the cheapest one that lowers the peak is the optimum (exhaustive search agrees)."""
    prob = _layers(4)
    start = solve(prob, solver="keep_all", budget_bytes=None)
    budget = start.predicted_peak_bytes - 1
    plan = descend(prob, start, budget_bytes=budget, deadline=NEVER)
    assert plan is not None and plan.solver == "descent(keep_all)"
    assert len(start.saved - plan.saved) == 1
    best = optimum(exhaustive(prob) or [], budget)
    assert plan.recompute_time_s == best


def test_a_descent_stops_at_its_deadline() -> None:
    prob = _layers(4)
    start = solve(prob, solver="keep_all", budget_bytes=None)
    budget = start.predicted_peak_bytes - 1
    assert descend(prob, start, budget_bytes=budget, deadline=-1.0) is None


def test_auto_descends_from_the_nearest_start_cheaper_than_what_fits() -> None:
    """keep_all is the cheapest plan over every budget but the farthest from it: the descent
    starts from the nearest one first, and only from plans cheaper than the best that fits."""
    prob = _layers(6)
    keep_all = solve(prob, solver="keep_all", budget_bytes=None)
    near = descend(prob, keep_all, budget_bytes=keep_all.predicted_peak_bytes - 1,
                   deadline=NEVER)  # fmt: skip
    assert near is not None
    budget = near.predicted_peak_bytes - 1
    config = SolverConfig()
    found = _descents(prob, [keep_all, near], [], budget, NEVER, config)
    assert found and found[0].solver == f"descent({near.solver})"
    assert all(p.predicted_peak_bytes <= budget for p in found)
    # Nothing over the budget is cheaper than a plan that fits at no cost: no descent.
    assert near.recompute_time_s > 0
    assert _descents(prob, [near], [keep_all], budget, NEVER, config) == []
