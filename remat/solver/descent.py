"""Peak descent: from a cheap plan over the budget, stop saving values one at a time until it fits.

Why: between the least peak of the block-structured plans (the chain's menus) and the least
peak of the flat solvers there is a band of budgets where only expensive plans were at hand.
On an 8-layer Llama (seq 256) ``keep_matmuls`` recomputes only elementwise ops but peaks 1 MB
above a budget where the chain has no plan and the flat MILP (490 values) finds nothing in a
minute; Chen's greedy segments fit at 15 GFLOP of recomputation. Dropping one or two more
saved activations from ``keep_matmuls`` fits at almost no cost.

Each step ranks the saved values by bytes freed per second of recomputation (their own op's
time: a cheap proxy), simulates the ``width`` best, and takes the one that lowers the peak the
most per second of recompute time it adds. Every candidate is simulated, so the result's peak
and cost are exact; the descent is greedy, not optimal.
"""

from __future__ import annotations

import dataclasses

from remat.problem import Problem, Role
from remat.solver import clock
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.schedule import InvalidPlanError

WIDTH = 8
"""Candidates simulated per step."""


def descend(
    problem: Problem,
    start: Plan,
    *,
    budget_bytes: int,
    deadline: float,
    width: int = WIDTH,
) -> Plan | None:
    """A plan that fits ``budget_bytes`` reached from ``start`` by unsaving values, or None if
    the descent gets stuck (no candidate lowers the peak) or ``deadline``
    (:func:`remat.solver.clock.now`) passes first."""
    values = problem.by_name
    plan = start
    tried: set[frozenset[str]] = {plan.saved}
    while plan.predicted_peak_bytes > budget_bytes:
        ranked = sorted(
            (
                n
                for n in _helpful(problem, plan)
                if values[n].role is Role.FORWARD
                and not values[n].never_recomputed
                and problem.storages_bytes(values[n].allocates) > 0
            ),
            key=lambda n: (
                -problem.storages_bytes(values[n].allocates) / max(values[n].time_s, 1e-12)
            ),
        )
        best: tuple[float, Plan] | None = None
        for lo in range(0, len(ranked), width):
            for n in ranked[lo : lo + width]:
                if clock.now() > deadline:
                    return None
                saved = plan.saved - {n}
                if saved in tried:
                    continue
                tried.add(saved)
                try:
                    trial = make_plan(
                        problem, saved, solver=start.solver, reason="", proof=Proof.HEURISTIC
                    )
                except InvalidPlanError:
                    continue
                lowered = plan.predicted_peak_bytes - trial.predicted_peak_bytes
                if lowered <= 0:
                    continue
                added = trial.recompute_time_s - plan.recompute_time_s
                score = lowered / max(added, 1e-12)
                if best is None or score > best[0]:
                    best = (score, trial)
            if best is not None:  # only look further down the ranking if nothing helped
                break
        if best is None:
            return None
        plan = best[1]
    steps = len(start.saved - plan.saved)
    return dataclasses.replace(  # already simulated: only named
        plan,
        solver=f"descent({start.solver})",
        proof=Proof.HEURISTIC,
        reason=f"{start.solver}'s plan ({start.predicted_peak_bytes:,} B) with {steps} more "
        f"value(s) recomputed until it fit (greedy peak descent)",
    )


def _helpful(problem: Problem, plan: Plan) -> frozenset[str]:
    """The saved values whose recomputation can lower the peak: with the peak in the backward,
    those first read after it (recomputed before the peak, a value is live at it again)."""
    phase, _, step = plan.simulation.peak_step.partition(":")
    order = plan.schedule.backward
    if phase != "backward" or step not in order:
        return plan.saved
    peak = len(order) - 1 - order[::-1].index(step)
    first: dict[str, int] = {}
    values = problem.by_name
    for k, op in enumerate(order):
        for i in values[op].inputs:
            first.setdefault(i, k)
    return frozenset(n for n in plan.saved if first.get(n, -1) > peak)
