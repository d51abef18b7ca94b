"""Every registered solver through the same checks (no torch): valid plans, budgets, errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings

from remat.problem import Role
from remat.solver import build_schedule
from remat.solver.blocks import block_of
from remat.solver.chen import checkpoint_candidates
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.registry import SOLVERS, get_solver, solve
from tests.solver.builders import MiB, chain, external, op, problem
from tests.solver.test_schedule_properties import problems

RULE_BASED_NEEDING_BLOCKS = {"block", "chain"}


def _layers(n: int) -> object:
    """n blocks `layers.i` of two ops each, a residual chain: x -> (a_i -> h_i) -> ... -> out."""
    specs = [external("x", Role.INPUT), external("w")]
    prev = "x"
    for i in range(n):
        a, sa = op(f"a{i}", Role.FORWARD, (prev, "w"), alloc=2, flops=100)
        h, sh = op(f"h{i}", Role.FORWARD, (a.name,), flops=10)
        stack = ((f"layers.{i}", "Layer"),)
        specs += [(replace(a, module_stack=stack), sa), (replace(h, module_stack=stack), sh)]
        prev = h.name
    specs.append(op("out", Role.FORWARD, (prev,)))
    specs.append(op("t", Role.TANGENT))
    grad = "t"
    for i in reversed(range(n)):
        stack = ((f"layers.{i}", "Layer"),)
        for v, sizes in (
            op(f"gh{i}", Role.BACKWARD, (grad, f"a{i}")),
            op(f"ga{i}", Role.BACKWARD, (f"gh{i}", f"h{i - 1}" if i else "x")),
        ):
            specs.append((replace(v, module_stack=stack), sizes))
        grad = f"ga{i}"
    specs.append(op("gw", Role.BACKWARD, (grad,)))
    return problem(specs, user_outputs=("out",), grads=("gw",))


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_every_solver_gives_a_runnable_plan(name: str) -> None:
    prob = _layers(6)
    plan = solve(prob, solver=name, budget_bytes=None)
    build_schedule(prob, plan.saved)  # runnable
    assert plan.predicted_peak_bytes > 0
    assert set(plan.decisions) >= set(plan.schedule.saved)
    with pytest.raises(BudgetError, match="least feasible peak"):
        solve(prob, solver=name, budget_bytes=0)


def test_auto_picks_the_cheapest_fitting_plan_and_says_why() -> None:
    prob = _layers(6)
    keep_all = solve(prob, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    budget = keep_all - 1
    fitting = []
    for name in SOLVERS:
        try:
            fitting.append(solve(prob, solver=name, budget_bytes=budget))
        except ValueError:  # BudgetError included: that solver's plan does not fit
            continue
    auto = solve(prob, solver="auto", budget_bytes=budget)
    assert auto.predicted_peak_bytes <= budget
    assert auto.recompute_time_s == min(p.recompute_time_s for p in fitting)
    assert auto.solver.startswith("auto:") and "least recompute time" in auto.reason
    least = min(_least_peak(prob, n) for n in SOLVERS)
    with pytest.raises(BudgetError) as err:
        solve(prob, solver="auto", budget_bytes=least - 1)
    assert err.value.least_peak_bytes == least


def _least_peak(prob: object, name: str) -> int:
    with pytest.raises(BudgetError) as err:
        solve(prob, solver=name, budget_bytes=0)  # type: ignore[arg-type]
    return err.value.least_peak_bytes


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid solvers: block, chain, chen_greedy, chen_sqrt"):
        get_solver("checkmate2")
    with pytest.raises(ValueError, match="valid: auto, highs, cbc"):
        SolverConfig(backend="gurobi")


def test_blocks_found_from_module_paths() -> None:
    prob = _layers(3)
    blocks = block_of(prob)
    assert blocks["a1"] == "layers.1" and blocks["out"] is None
    assert block_of(prob, ("Layer",))["h2"] == "layers.2"
    assert set(block_of(prob, ("layers.0",)).values()) == {"layers.0", None}


def test_block_plan_keeps_block_inputs_only() -> None:
    prob = _layers(4)
    plan = solve(prob, solver="block", budget_bytes=None)
    assert set(plan.schedule.saved) == {"h0", "h1", "h2"}  # inputs of layers 1..3 (x is external)
    assert set(plan.schedule.recomputed) == {"a0", "a1", "a2", "a3"}


def test_chen_candidates_are_the_residual_stream() -> None:
    prob = _layers(4)
    assert checkpoint_candidates(prob) == ["a0", "h0", "a1", "h1", "a2", "h2", "a3", "h3"]
    diamond = problem(
        [
            external("x", Role.INPUT),
            external("w"),
            op("a", Role.FORWARD, ("x", "w")),
            op("b", Role.FORWARD, ("a",)),
            op("c", Role.FORWARD, ("a",)),
            op("d", Role.FORWARD, ("b", "c")),
            op("out", Role.FORWARD, ("d",)),
            op("t", Role.TANGENT),
            op("g", Role.BACKWARD, ("t", "b", "c")),
        ],
        user_outputs=("out",),
        grads=("g",),
    )
    assert checkpoint_candidates(diamond) == ["a", "d"]  # b and c are parallel branches


def test_chain_peaks_by_solver() -> None:
    prob = chain()
    assert solve(prob, solver="keep_all", budget_bytes=None).predicted_peak_bytes == 5 * MiB


@settings(max_examples=100, deadline=None)
@given(problems())
def test_all_solvers_valid_on_random_dags(case: tuple[object, frozenset[str]]) -> None:
    prob, _ = case
    for name in SOLVERS:
        try:
            plan = solve(prob, solver=name, budget_bytes=None)  # type: ignore[arg-type]
        except ValueError as e:
            assert name in RULE_BASED_NEEDING_BLOCKS, e
            continue
        build_schedule(prob, plan.saved)  # type: ignore[arg-type]
        budget = plan.predicted_peak_bytes
        assert solve(prob, solver=name, budget_bytes=budget).predicted_peak_bytes <= budget  # type: ignore[arg-type]
        auto = solve(prob, solver="auto", budget_bytes=budget)  # type: ignore[arg-type]
        assert auto.predicted_peak_bytes <= budget
        assert auto.recompute_time_s <= plan.recompute_time_s


def test_auto_keeps_the_exact_milps_bound_when_a_start_plan_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bound holds for every plan at the budget: when the exact MILP runs out of time and
    hands back its start plan with a dual bound, auto's plan carries that bound."""
    import remat.solver.registry as registry

    prob = chain()
    budget = solve(prob, solver="keep_inputs", budget_bytes=None).predicted_peak_bytes
    heuristic = solve(prob, solver="auto", budget_bytes=budget)

    def timed_out(problem: object, *, budget_bytes: int, config: object, start: object) -> object:
        return replace(start, reason="exact MILP ran out of time", lower_bound_s=0.0)  # type: ignore[type-var]

    def no_lp(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no LP in time")

    monkeypatch.setattr(registry, "exact", timed_out)
    monkeypatch.setattr(registry, "lp_rounding", no_lp)
    plan = solve(prob, solver="auto", budget_bytes=budget)
    assert plan.lower_bound_s == 0.0 and plan.recompute_time_s == heuristic.recompute_time_s
