"""The blocks' fronts bound (:mod:`remat.solver.block_bound`) is below the true optimum
(exhaustive search) on stacks of blocks under a head, at every budget."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import remat.solver.block_bound as block_bound_module
from remat.problem import Problem, Role
from remat.solver import clock
from remat.solver.block_bound import block_bound, head_moments
from remat.solver.bound import backward_bound
from remat.solver.config import SolverConfig
from remat.solver.fronts import kept_problem, tangent
from remat.solver.plan import Proof, make_plan
from remat.solver.registry import solve
from remat.solver.schedule import InvalidPlanError
from remat.solver.structure import find_structure
from tests.solver.builders import external, op, problem
from tests.solver.test_exact import brute_force, optimum

CONFIG = SolverConfig(time_limit_s=30)


@pytest.fixture(autouse=True)
def _no_clock(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The floor's rounds (and the chain solver's loops) end by their own counts here: a
    clock that never moves, so what they find does not depend on the work limit."""
    monkeypatch.setattr(clock.Clock, "now", lambda self: 0.0)


def _stack(
    n: int, sizes: tuple[int, int, int, int], flops: tuple[int, int, int], both: bool = False
) -> Problem:
    """``n`` blocks ``layers.i`` (a matmul-like ``a``, an activation ``m`` read by nothing
    but the residual add, the residual ``h`` read by the next block's backward and the head),
    under a head ``y`` whose backward reads the last residual: what a transformer's loss
    does before the blocks' backward starts."""
    sa, sm, sh, sy = sizes
    fa, fm, fy = flops
    specs = [external("x", Role.INPUT), external("w"), external("w2")]
    prev = "x"
    for i in range(n):
        stack = ((f"layers.{i}", "Layer"),)
        for v, s in (
            op(f"a{i}", Role.FORWARD, (prev, "w"), alloc=sa, flops=fa),
            op(f"m{i}", Role.FORWARD, (f"a{i}",), alloc=sm, flops=fm),
            op(f"h{i}", Role.FORWARD, (prev, f"m{i}"), alloc=sh, flops=1),
        ):
            specs.append((replace(v, module_stack=stack), s))
        prev = f"h{i}"
    inputs = (prev, f"h{n - 2}", "w2") if both else (prev, "w2")  # both: two blocks read
    specs.append(op("y", Role.FORWARD, inputs, alloc=sy, flops=fy))  # the logits
    specs.append(op("loss", Role.FORWARD, ("y",), flops=1))
    specs.append(op("t", Role.TANGENT))
    specs.append(op("gt", Role.BACKWARD, ("t", "y"), alloc=sy))  # reads the logits first
    specs.append(op("gw2", Role.BACKWARD, ("gt", prev)))  # then the last residual
    specs.append(op("gy", Role.BACKWARD, ("gt", "w2"), alloc=sh))
    grad = "gy"
    for i in reversed(range(n)):
        stack = ((f"layers.{i}", "Layer"),)
        below = f"h{i - 1}" if i else "x"
        for v, s in (
            op(f"gm{i}", Role.BACKWARD, (grad, f"a{i}"), alloc=sm),
            op(f"ga{i}", Role.BACKWARD, (f"gm{i}", below), alloc=sa),
            op(f"gx{i}", Role.BACKWARD, (f"ga{i}", grad), alloc=sh),
        ):
            specs.append((replace(v, module_stack=stack), s))
        grad = f"gx{i}"
    specs.append(op("gw", Role.BACKWARD, (grad,)))
    return problem(specs, user_outputs=("loss",), grads=("gw", "gw2"))


def test_the_stack_has_head_moments_and_one_class_of_blocks() -> None:
    prob = _stack(3, (2, 1, 1, 2), (50, 10, 40))
    structure = find_structure(prob)
    assert len(structure.blocks) == 3 and len(structure.classes) == 1
    assert head_moments(prob, structure) == [0]


@settings(max_examples=12, deadline=None)
@given(
    st.tuples(*[st.integers(1, 3)] * 4),
    st.tuples(st.integers(20, 100), st.integers(1, 30), st.integers(1, 100)),
)
def test_the_bound_is_below_the_optimum_at_every_budget(
    sizes: tuple[int, int, int, int], flops: tuple[int, int, int]
) -> None:
    prob = _stack(3, sizes, flops)
    results = brute_force(prob)
    for budget in sorted({peak for _, peak in results}):
        best = optimum(results, budget)
        bound = block_bound(prob, budget, CONFIG, rounds=3)
        assert best is not None and bound is not None
        assert 0 <= bound <= best + 1e-9 * max(1.0, best)


def test_it_proves_more_than_the_moments_where_recomputing_fills_the_head() -> None:
    """The moments bound counts a saved value only while the backward reads it; a block's
    front knows it holds its residual's feeder until the residual is recomputed."""
    prob = _stack(3, (2, 1, 1, 2), (50, 10, 40))
    results = brute_force(prob)
    gains = []
    for budget in sorted({peak for _, peak in results}):
        best = optimum(results, budget)
        mine = block_bound(prob, budget, CONFIG)
        moments = backward_bound(prob, budget, CONFIG)
        assert best is not None and mine is not None and moments is not None
        assert mine <= best + 1e-9 * max(1.0, best)
        gains.append(mine - moments)
    assert max(gains) > 0


def test_the_last_blocks_backward_raises_the_floor_below_the_optimum(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where the step peaks in the last block's backward (its activation ``a`` held with the
    gradients), the rounds with that block's exact model prove more than the head's rows
    alone at some budgets, and never more than the optimum."""
    prob = _stack(3, (2, 1, 1, 2), (50, 5, 1))
    results = brute_force(prob)
    gains = []
    for budget in sorted({peak for _, peak in results}):
        best = optimum(results, budget)
        with_tail = block_bound(prob, budget, CONFIG, rounds=3)
        with monkeypatch.context() as m:
            m.setattr(block_bound_module, "_tail", lambda problem, structure: None)
            heads = block_bound(prob, budget, CONFIG, rounds=3)
        assert best is not None and with_tail is not None and heads is not None
        assert with_tail <= best + 1e-9 * max(1.0, best)
        gains.append(with_tail - heads)
    assert sum(g > 1e-12 for g in gains) >= 2


def test_the_chain_solver_records_the_larger_floor() -> None:
    """With ``floor_time_s`` the chain plan's floor is the larger of the two bounds, still
    below the optimum, and the reason says which it is (on a stand-in clock)."""
    prob = _stack(3, (2, 1, 1, 2), (50, 10, 40))
    results = brute_force(prob)
    budgets = sorted({peak for _, peak in results})
    gained = False
    for budget in budgets[1:-1]:
        plain = solve(prob, solver="chain", budget_bytes=budget, config=CONFIG)
        more = solve(prob, solver="chain", budget_bytes=budget,
                     config=replace(CONFIG, floor_time_s=20))  # fmt: skip
        best = optimum(results, budget)
        assert best is not None and more.lower_bound_s is not None
        assert more.recompute_time_s == plain.recompute_time_s  # the plan is the same
        assert (plain.lower_bound_s or 0) <= more.lower_bound_s <= best + 1e-9 * max(1.0, best)
        if more.lower_bound_s > (plain.lower_bound_s or 0) + 1e-12:
            gained = True
            assert "from the blocks' fronts" in more.reason
    assert gained


def test_a_tangent_is_below_every_plan_of_the_block_and_touches_the_best() -> None:
    """``recompute + w * kept`` over every saved set of one block (exhaustive) is at least
    the tangent's bound at ``w``, and equal to it at the best set up to the MILP's tie-break
    (fewer bytes saved among equal times, worth at most 1e-3 of the cheapest op's time),
    which the bound subtracts."""
    prob = _stack(3, (2, 3, 1, 2), (50, 10, 40))
    kp = kept_problem(prob, find_structure(prob).blocks[1])
    assert kp is not None
    free = [v.name for v in kp.problem.values if v.role is Role.FORWARD]
    points = []
    for k in range(len(free) + 1):
        for subset in itertools.combinations(free, k):
            with contextlib.suppress(InvalidPlanError):
                plan = make_plan(kp.problem, set(subset), solver="", reason="",
                                 proof=Proof.HEURISTIC)  # fmt: skip
                points.append((plan.recompute_time_s, kp.kept(plan)))
    for weight in (1e-6, 1e-5, 3e-5, 1e-4):
        line = tangent(kp, weight, CONFIG)
        assert line is not None
        best = min(t + weight * kept for t, kept in points)
        assert line.bound_s <= best + 1e-9 * max(1.0, best)
        cheapest = min(v.time_s for v in kp.problem.values if v.time_s > 0)
        assert line.bound_s == pytest.approx(best, abs=1e-3 * cheapest)


@pytest.mark.parametrize("sizes", [(2, 1, 1, 2), (1, 3, 1, 2)])
def test_a_head_reading_two_blocks_still_gets_a_floor_below_the_optimum(
    sizes: tuple[int, int, int, int],
) -> None:
    """With two block values read by the head, the blocks it reaches count for nothing once it
    does (they need not be reached at once): still below the optimum at every budget."""
    prob = _stack(3, sizes, (50, 10, 40), both=True)
    results = brute_force(prob)
    for budget in sorted({peak for _, peak in results}):
        best = optimum(results, budget)
        bound = block_bound(prob, budget, CONFIG, rounds=3)
        assert best is not None and bound is not None
        assert bound <= best + 1e-9 * max(1.0, best)
