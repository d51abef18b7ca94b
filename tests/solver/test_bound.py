"""The backward-start bound is below the true optimum (exhaustive search) at every budget, and
not trivially zero where memory is tight."""

from __future__ import annotations

from hypothesis import assume, given, settings

from remat.problem import Problem
from remat.solver.bound import backward_start_bound
from remat.solver.config import SolverConfig
from remat.solver.registry import solve
from tests.solver.test_exact import brute_force, exhaustive, optimum
from tests.solver.test_schedule_properties import problems
from tests.solver.test_solvers import _layers

CONFIG = SolverConfig(time_limit_s=30)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_the_bound_is_below_the_optimum_at_every_budget(
    case: tuple[Problem, frozenset[str]],
) -> None:
    prob, _ = case
    results = exhaustive(prob)
    assume(results is not None)  # else too many subsets to enumerate
    assert results is not None
    for budget in sorted({peak for _, peak in results}):
        best = optimum(results, budget)
        bound = backward_start_bound(prob, budget, CONFIG)
        assert best is not None and bound is not None
        assert 0 <= bound <= best + 1e-12


def test_the_bound_is_not_trivial_where_memory_is_tight() -> None:
    """On a chain of layers the bound at the least budget is well above zero (it misses what
    the backward's own peak forces, so it stays below the optimum)."""
    prob = _layers(4)
    results = brute_force(prob)
    budgets = sorted({peak for _, peak in results})
    bounds = [backward_start_bound(prob, b, CONFIG) for b in budgets]
    optima = [optimum(results, b) for b in budgets]
    assert all(
        b is not None and o is not None and b <= o + 1e-12
        for b, o in zip(bounds, optima, strict=True)
    )
    assert bounds[0] is not None and optima[0] is not None and bounds[0] > 0
    exact = solve(prob, solver="exact", budget_bytes=budgets[0], config=CONFIG)
    assert bounds[0] <= exact.recompute_time_s + 1e-12
