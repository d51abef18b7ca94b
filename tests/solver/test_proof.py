"""What each solver proves about its plan (``Plan.proof``), as data rather than reason text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from remat.plan.files import plan_from_file, save_plan
from remat.problem import Problem
from remat.solver.config import SolverConfig
from remat.solver.milp import exact
from remat.solver.plan import Proof
from remat.solver.registry import HEURISTICS, SOLVERS, solve
from tests.solver.test_solvers import _layers

CONFIG = SolverConfig(time_limit_s=60.0)


def _budget() -> tuple[Problem, int]:
    """Six two-op layers, and a budget halfway between block checkpointing's peak and
    keep_all's."""
    prob = _layers(6)
    top = solve(prob, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    low = solve(prob, solver="block", budget_bytes=None).predicted_peak_bytes
    assert low < top
    return prob, (low + top) // 2


def test_exact_with_time_to_spare_is_optimal_and_meets_its_bound() -> None:
    prob, budget = _budget()
    plan = solve(prob, solver="exact", budget_bytes=budget, config=CONFIG)
    assert plan.proof is Proof.OPTIMAL
    assert plan.recompute_time_s > 0  # a budget that makes it choose
    assert plan.lower_bound_s is not None
    # The bound is the optimum less the tie-break's largest possible value (a small share).
    assert plan.lower_bound_s <= plan.recompute_time_s
    assert plan.lower_bound_s == pytest.approx(plan.recompute_time_s, rel=1e-3)


def test_no_budget_is_optimal_for_the_optimizing_solvers() -> None:
    prob = _layers(6)
    for name in ("exact", "lp_round", "auto"):
        assert solve(prob, solver=name, budget_bytes=None).proof is Proof.OPTIMAL, name


@pytest.mark.parametrize("name", sorted(HEURISTICS))
def test_heuristics_claim_nothing(name: str) -> None:
    plan = solve(_layers(6), solver=name, budget_bytes=None)
    assert plan.proof is Proof.HEURISTIC


def test_a_time_limit_too_short_to_build_the_model_keeps_the_start() -> None:
    """1 us: the model's build stops at its first check (a plain 0.01 s could still solve
    this small model, since HiGHS always gets at least a second)."""
    prob, budget = _budget()
    start = solve(prob, solver="block", budget_bytes=budget)
    plan = exact(prob, budget_bytes=budget, config=SolverConfig(time_limit_s=1e-6), start=start)
    assert plan.proof is Proof.TIME_LIMIT
    assert plan.saved == start.saved


def test_a_neighbourhood_solve_claims_the_neighbourhood_only() -> None:
    prob, budget = _budget()
    start = solve(prob, solver="block", budget_bytes=budget)
    free = {"a0", "h0"}
    plan = exact(prob, budget_bytes=budget, config=CONFIG, start=start, free=free)
    assert plan.proof is Proof.NEIGHBOURHOOD
    assert plan.lower_bound_s is None


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_every_solver_states_a_proof(name: str) -> None:
    prob, budget = _budget()
    plan = solve(prob, solver=name, budget_bytes=None, config=CONFIG)
    assert isinstance(plan.proof, Proof)
    assert plan.proof_text in plan.summary()
    if plan.predicted_peak_bytes <= budget or name not in HEURISTICS:
        plan = solve(prob, solver=name, budget_bytes=budget, config=CONFIG)
        assert isinstance(plan.proof, Proof)
        if name in HEURISTICS:
            assert plan.proof is Proof.HEURISTIC
        if name in ("exact", "auto"):  # six small layers: proven with time to spare
            assert plan.proof is Proof.OPTIMAL
        if plan.proof is Proof.OPTIMAL:
            best = solve(prob, solver="exact", budget_bytes=budget, config=CONFIG)
            assert plan.recompute_time_s == pytest.approx(best.recompute_time_s, rel=1e-6)


def test_auto_keeps_the_proof_of_the_exact_milp() -> None:
    prob, budget = _budget()
    plan = solve(prob, solver="auto", budget_bytes=budget, config=CONFIG)
    assert plan.proof is Proof.OPTIMAL


def test_a_plan_file_keeps_the_proof(tmp_path: Path) -> None:
    prob, budget = _budget()
    plan = solve(prob, solver="exact", budget_bytes=budget, config=CONFIG)
    path = save_plan(plan, prob, tmp_path / "plan.json")
    assert json.loads(path.read_text())["proof"] == "optimal"
    assert plan_from_file(path, prob).proof is Proof.OPTIMAL
    # A file written before plans recorded their proof claims nothing.
    doc = json.loads(path.read_text())
    del doc["proof"]
    path.write_text(json.dumps(doc))
    assert plan_from_file(path, prob).proof is Proof.HEURISTIC


def test_proof_text_reads_the_proof_and_the_floor() -> None:
    """The words the demo, compare and the reports print, from the plan's data alone."""
    prob, budget = _budget()
    plan = solve(prob, solver="block", budget_bytes=budget)
    cost = plan.recompute_time_s
    assert cost > 0
    assert plan.proof_text == "heuristic, no floor"
    at = dataclasses.replace
    assert at(plan, lower_bound_s=cost / 1.031).proof_text == "within 3.1% of the floor"
    assert at(plan, lower_bound_s=cost).proof_text == "optimal"  # meets its floor
    assert at(plan, proof=Proof.OPTIMAL).proof_text == "optimal"
    assert at(plan, proof=Proof.TIME_LIMIT).proof_text == "time limit, no floor"
    assert at(plan, proof=Proof.TIME_LIMIT, lower_bound_s=0.0).proof_text == (
        "time limit, no floor"
    )
    assert at(plan, proof=Proof.NEIGHBOURHOOD).proof_text == (
        "optimal in its neighbourhood, no floor"
    )
