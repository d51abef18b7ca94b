"""The offload search: it offloads where the link hides the copies well enough to beat the
recompute plan at the budget, and keeps that plan where it does not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from remat.models import TinyGPT
from remat.problem import Link, Problem
from remat.solver.milp_model import ModelTimeout
from remat.solver.offload_search import LADDER, offloadable, search
from remat.solver.plan import Plan
from remat.solver.registry import solve


def _problem(link: Link) -> Problem:
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    problem = remat.analyze(TinyGPT(layers=2), (tokens,)).problem
    return dataclasses.replace(problem, link=link)


def _search(problem: Problem, host: int) -> tuple[Plan, Plan, int]:
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    low = solve(problem, solver="keep_matmuls", budget_bytes=None).predicted_peak_bytes
    budget = (3 * keep_all + low) // 4

    def at(b: int) -> Plan:
        return solve(problem, solver="lp_round", budget_bytes=b)

    return search(problem, budget, host, at, keep_all), at(budget), budget


def test_a_fast_link_offloads_and_beats_recomputing() -> None:
    plan, recompute, budget = _search(_problem(Link(d2h=50e9, h2d=50e9)), 1 << 30)
    assert plan.offloaded and plan.solver.endswith("+offload")
    assert plan.predicted_peak_bytes <= budget
    assert plan.step_time_s < recompute.step_time_s


def test_a_slow_link_or_no_host_room_keeps_the_recompute_plan() -> None:
    slow, recompute, _ = _search(_problem(Link(d2h=1e3, h2d=1e3)), 1 << 30)
    assert not slow.offloaded and slow.saved == recompute.saved
    tight, recompute, _ = _search(_problem(Link(d2h=50e9, h2d=50e9)), 1)
    assert not tight.offloaded and tight.saved == recompute.saved


def test_offloadable_values_hold_their_storage_alone() -> None:
    problem = _problem(Link(d2h=50e9, h2d=50e9))
    plan = solve(problem, solver="keep_all", budget_bytes=None)
    by = problem.by_name
    values = offloadable(problem, plan.schedule)
    assert values
    sizes = [problem.storages_bytes(by[v].storages) for v in values]
    assert sizes == sorted(sizes, reverse=True)
    for v in values:
        assert set(by[v].storages) == set(by[v].allocates)
        others = [n for n in plan.schedule.saved if n != v]
        assert not any(set(by[n].storages) & set(by[v].storages) for n in others)


def test_a_budget_whose_model_is_not_built_in_its_share_of_the_time() -> None:
    """Each budget of the search gets its share of the time limit: one whose solver runs out
    building its model is skipped; at the budget itself the error says why it ran out."""
    problem = _problem(Link(d2h=50e9, h2d=50e9))
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    low = solve(problem, solver="keep_matmuls", budget_bytes=None).predicted_peak_bytes
    budget = (3 * keep_all + low) // 4

    def wider_out_of_time(b: int) -> Plan:
        if b > budget:
            raise ModelTimeout("the LP/MILP model was not built within the time limit")
        return solve(problem, solver="lp_round", budget_bytes=b)

    plan = search(problem, budget, 1 << 30, wider_out_of_time, keep_all)
    assert not plan.offloaded  # every wider budget was skipped: the plan at the budget
    assert keep_all > budget >= plan.predicted_peak_bytes

    def out_of_time(b: int) -> Plan:
        raise ModelTimeout("the LP/MILP model was not built within the time limit")

    with pytest.raises(ModelTimeout, match=f"solves {LADDER + 1} budgets, each with a"):
        search(problem, budget, 1 << 30, out_of_time, keep_all)
