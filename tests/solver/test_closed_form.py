"""A chain whose optimum is known in closed form, and monotonicity over a budget sweep.

n equal layers ``a_i = f(a_{i-1})`` (1 MiB, 1 s each; ``a_n`` is the output); the backward op
``g_i`` reads ``g_{i+1}`` and ``a_{i-1}``. Saving k of ``a_1..a_{n-1}`` splits the rest into
segments of lengths ``L_0..L_k`` (``L_j`` unsaved values above checkpoint j); the executor
recomputes a segment at its top, once, so the cost is ``n - 1 - k`` seconds whatever the
placement. The peak is at the top of a segment: the output, the tangent, the gradient being
read and the one being written, the j checkpoints below, the recomputed segment: ``4 + j +
L_j`` MiB, one less for the topmost segment (its incoming gradient is the tangent). With
``b`` MiB the segment lengths may reach ``b - 4 - j`` (``b - 3 - k`` for the top one), so k
checkpoints fit iff ``k <= b - 3`` and ``sum_j (b - 4 - j) + (b - 3 - k) >= n - 1 - k``, and
the least recompute time is ``n - 1 - kmax(b)``.
"""

from __future__ import annotations

import pytest

from remat.problem import Problem, Role
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.registry import solve
from tests.solver.builders import MiB, external, op, problem

N = 12
CONFIG = SolverConfig(time_limit_s=60)


def equal_layers(n: int) -> Problem:
    specs = [external("x", Role.INPUT)]
    prev = "x"
    for i in range(1, n + 1):
        specs.append(op(f"a{i}", Role.FORWARD, (prev,), flops=1))
        prev = f"a{i}"
    specs.append(op("t", Role.TANGENT))
    grad = "t"
    for i in range(n, 0, -1):
        specs.append(op(f"g{i}", Role.BACKWARD, (grad, f"a{i - 1}" if i > 1 else "x")))
        grad = f"g{i}"
    return problem(specs, user_outputs=(f"a{n}",), grads=("g1",))


def kmax(n: int, b: int) -> int | None:
    """Most checkpoints that fit in ``b`` MiB (None: not even k = 0)."""
    best = None
    for k in range(0, min(b - 3, n - 1) + 1):
        capacity = sum(b - 4 - j for j in range(k)) + (b - 3 - k)
        if capacity >= n - 1 - k:
            best = k
    return best


@pytest.mark.parametrize("solver", ["exact", "auto"])
def test_equal_layers_reach_the_closed_form_optimum(solver: str) -> None:
    prob = equal_layers(N)
    checked = 0
    for b in range(3, N + 5):
        k = kmax(N, b)
        if k is None:
            with pytest.raises(BudgetError):
                solve(prob, solver=solver, budget_bytes=b * MiB, config=CONFIG)
            continue
        plan = solve(prob, solver=solver, budget_bytes=b * MiB, config=CONFIG)
        assert plan.predicted_peak_bytes <= b * MiB
        assert plan.recompute_time_s == pytest.approx(N - 1 - k), (b, k)
        checked += 1
    assert checked >= 5  # from the sqrt-like regime up to keeping everything


def test_cost_never_grows_with_the_budget() -> None:
    """A fine sweep over the chain of test_solvers (unequal layers, residual reads)."""
    from tests.solver.test_solvers import _layers

    prob = _layers(5)
    keep_all = solve(prob, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    with pytest.raises(BudgetError) as err:
        solve(prob, solver="exact", budget_bytes=0, config=CONFIG)
    least = err.value.least_peak_bytes
    costs = []
    for step in range(9):
        budget = least + (keep_all - least) * step // 8
        for name in ("exact", "auto"):
            plan = solve(prob, solver=name, budget_bytes=budget, config=CONFIG)
            assert plan.predicted_peak_bytes <= budget
            costs.append((name, plan.recompute_time_s))
    for name in ("exact", "auto"):
        seq = [c for n, c in costs if n == name]
        assert seq == sorted(seq, reverse=True), (name, seq)
        assert seq[-1] == 0.0
