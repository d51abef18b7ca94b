"""The planning pipeline: capture -> joint graph -> problem -> plan, each stage timed."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.graph.capture import Captured, capture
from remat.graph.joint import JointGraph, build_joint
from remat.graph.problem import build_problem
from remat.graph.profiles import DeviceProfile
from remat.problem import Problem
from remat.solver.fixed import FIXED_PLANS, fixed_saved_set
from remat.solver.plan import Plan, make_plan


class BudgetError(ValueError):
    """No plan fits the requested budget; the message states the least feasible peak."""


@dataclass(frozen=True)
class Analysis:
    """A model's step as a graph and as numbers, ready to plan."""

    captured: Captured
    joint: JointGraph
    problem: Problem
    timings: Mapping[str, float]
    """Seconds spent in ``capture``, ``joint`` and ``annotate``."""


def analyze(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    device_profile: str | DeviceProfile = "cpu",
) -> Analysis:
    t0 = time.perf_counter()
    captured = capture(model, args, kwargs)
    t1 = time.perf_counter()
    joint = build_joint(captured)
    t2 = time.perf_counter()
    problem = build_problem(
        joint,
        device_profile=device_profile,
        metadata={"model": type(model).__name__, "capture": captured.method},
    )
    t3 = time.perf_counter()
    return Analysis(
        captured, joint, problem, {"capture": t1 - t0, "joint": t2 - t1, "annotate": t3 - t2}
    )


def fixed_plan(problem: Problem, name: str) -> Plan:
    why = fixed_saved_set(problem, name)
    return make_plan(problem, why, solver=name, reason=f"fixed plan {name!r}", why_saved=why)


def best_fixed_plan(problem: Problem, budget_bytes: int) -> Plan:
    """The fixed plan with the least recompute time whose simulated peak fits the budget."""
    plans = [fixed_plan(problem, name) for name in FIXED_PLANS]
    fitting = [p for p in plans if p.predicted_peak_bytes <= budget_bytes]
    if not fitting:
        least = min(plans, key=lambda p: p.predicted_peak_bytes)
        raise BudgetError(
            f"activation budget {budget_bytes:,} B ({budget_bytes / 2**30:.3f} GiB) is below the "
            f"least peak the available plans reach: {least.predicted_peak_bytes:,} B "
            f"({least.predicted_peak_bytes / 2**30:.3f} GiB, plan {least.solver!r})"
        )
    best = min(fitting, key=lambda p: (p.recompute_time_s, p.predicted_peak_bytes))
    return make_plan(
        problem,
        best.saved,
        solver=f"fixed:{best.solver}",
        reason=(
            f"least recompute time among the fixed plans that fit {budget_bytes:,} B "
            f"({len(fitting)} of {len(plans)} fit)"
        ),
        why_saved=best.decisions,
    )


def choose_plan(
    problem: Problem,
    *,
    plan: str | Plan | None = None,
    solver: str | None = None,
    activation_budget_bytes: int | None = None,
) -> Plan:
    """Resolve the user's request (a named plan, an existing plan, or a budget) into a Plan."""
    if plan is not None and (solver is not None or activation_budget_bytes is not None):
        raise ValueError("pass either plan= or solver=/activation_budget_bytes=, not both")
    if isinstance(plan, Plan):
        unknown = sorted(plan.saved - set(problem.by_name))
        if unknown:
            raise ValueError(f"the plan saves values this graph does not have: {unknown[:5]}")
        return make_plan(problem, plan.saved, solver=plan.solver, reason=plan.reason)
    if isinstance(plan, str):
        return fixed_plan(problem, plan)
    if solver not in (None, "fixed"):
        raise ValueError(f"unknown solver {solver!r}; valid solvers: fixed")
    if activation_budget_bytes is None:
        if solver is not None:
            raise ValueError(f"solver={solver!r} needs activation_budget_bytes=")
        return make_plan(
            problem,
            fixed_saved_set(problem, "keep_all"),
            solver="keep_all",
            reason="no budget given: keep everything (no recomputation)",
        )
    if activation_budget_bytes < 0:
        raise ValueError("activation_budget_bytes must be >= 0")
    return best_fixed_plan(problem, activation_budget_bytes)
