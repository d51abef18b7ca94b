"""Which saved values to offload: a recompute plan for a larger budget, made to fit the real
one by copying saved values to host memory.

Why this shape: offload trades device memory for copy time, which compute hides where the link
is fast enough, while recompute trades it for op time that nothing hides. So a plan that keeps
more (recomputes less) at a larger budget, with enough of its saved values offloaded to come
back under the budget, can beat the best recompute plan at the budget itself. This search tries
plans at budgets from the budget up to keep-all's peak, offloads the largest values that hold
their storage alone until each fits the device budget within the host budget, and keeps the
plan of least predicted step time (:attr:`remat.solver.simulate.Simulation.step_time_s`, the
exposed copy time included): the recompute plan at the budget unless an offloading one is
faster. It is a heuristic over the exact model: every plan it returns is simulated exactly,
but the choice is not proven optimal (:attr:`Proof.HEURISTIC`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

from remat.problem import Problem
from remat.solver import offload
from remat.solver.config import BudgetError
from remat.solver.milp_model import ModelTimeout
from remat.solver.plan import Plan, Proof, fmt_bytes, make_plan
from remat.solver.schedule import Schedule

LADDER = 4
"""Budgets tried above the device budget, evenly up to keep-all's peak."""


Placing = Callable[[Sequence[str]], tuple[offload.Offload, ...]]
"""Values -> their points on one schedule (:func:`placing`)."""


def offloadable(
    problem: Problem,
    schedule: Schedule,
    copy_ops: Collection[str] | None = None,
    at: Placing | None = None,
) -> list[str]:
    """Saved values the executor can offload exactly (each the only holder of the storages
    it allocates, none shared with another saved value or the caller's outputs; with
    ``copy_ops``, the ops the executor runs, one of them and placeable among them), largest
    first: the fewest copies free the most. ``at``: :func:`placing` on this schedule and
    ``copy_ops``, where the caller has it."""
    by = problem.by_name
    holders = (*schedule.saved, *problem.user_outputs, *problem.mutation_outputs)
    owners = {n: (by[n].storages, by[n].allocates) for n in holders}
    read = {i for n in schedule.backward for i in by[n].inputs}
    out = [n for n in schedule.saved if n in read and offload.unfit(n, holders, owners) is None]
    if copy_ops is not None:
        at = at or placing(problem, schedule, copy_ops)
        out = [n for n in out if n in copy_ops and _placeable(at, n)]
    return sorted(out, key=lambda n: (-problem.storages_bytes(by[n].storages), problem.index[n]))


def _placeable(at: Placing, value: str) -> bool:
    try:
        at([value])
    except offload.OffloadError:
        return False
    return True


def placing(
    problem: Problem, schedule: Schedule, copy_ops: Collection[str] | None = None
) -> Placing:
    """:func:`remat.solver.offload.place` on ``schedule`` at ``copy_ops`` (the ops the
    executor runs; None: all), the schedule's times, last uses and first reads worked out
    once: each value's points depend on its own size alone, so values placed one at a time
    get the points they get placed together."""
    by, link = problem.by_name, offload.link_of(problem)
    ops = (*schedule.forward, *schedule.backward)
    inputs = {n: by[n].inputs for n in ops}
    times = {n: by[n].time_s for n in ops}
    last_uses = offload.last_forward_uses(schedule.forward, inputs)
    first_reads = offload.first_reads(schedule.backward, inputs)

    def at(values: Sequence[str]) -> tuple[offload.Offload, ...]:
        return offload.place(
            schedule.forward,
            schedule.backward,
            times,
            values,
            {v: problem.storages_bytes(by[v].storages) for v in values},
            last_uses,
            first_reads,
            link,
            copy_ops,
        )

    return at


def offload_to_fit(
    problem: Problem,
    plan: Plan,
    budget_bytes: int,
    host_budget_bytes: int,
    copy_ops: Collection[str] | None = None,
) -> Plan | None:
    """``plan`` with its largest offloadable values offloaded, one more at a time, until its
    device peak fits ``budget_bytes`` (None where the host budget or the candidates run out
    first)."""
    if plan.predicted_peak_bytes <= budget_bytes:
        return plan
    by = problem.by_name
    at = placing(problem, plan.schedule, copy_ops)
    chosen: list[offload.Offload] = []
    host = 0
    for value in offloadable(problem, plan.schedule, copy_ops, at):
        nbytes = problem.storages_bytes(by[value].storages)
        if host + nbytes > host_budget_bytes:
            continue
        chosen += at([value])
        host += nbytes
        tried = make_plan(
            problem,
            plan.saved,
            solver=plan.solver,
            reason=plan.reason,
            proof=Proof.HEURISTIC,
            offloads=tuple(chosen),
        )
        if tried.predicted_peak_bytes <= budget_bytes:
            return tried
    return None


def search(
    problem: Problem,
    budget_bytes: int,
    host_budget_bytes: int,
    solve_at: Callable[[int], Plan],
    keep_all_peak: int,
    copy_ops: Collection[str] | None = None,
) -> Plan:
    """The fastest of the recompute plan at ``budget_bytes`` (``solve_at``) and the plans at
    larger budgets made to fit by offload; raises :class:`BudgetError` where none fits.
    ``copy_ops``: the ops the executor runs, where copies can be waited on or started (None:
    every op of the step)."""
    offload.link_of(problem)
    tried: list[tuple[int, Plan]] = []
    base: Plan | None = None
    refused: BudgetError | None = None
    try:
        base = solve_at(budget_bytes)
    except BudgetError as e:
        refused = e
    except ModelTimeout as e:
        raise ModelTimeout(
            f"{e}: with a host budget the search solves {LADDER + 1} budgets, each with a "
            f"{LADDER + 1}th of time_limit_s; give it more"
        ) from e
    if keep_all_peak > budget_bytes:
        step = (keep_all_peak - budget_bytes) / LADDER
        for k in range(1, LADDER + 1):
            wider = budget_bytes + round(step * k)
            try:
                relaxed = solve_at(wider)
            except (BudgetError, ModelTimeout):  # none at this budget, or not in its share
                continue
            fitted = offload_to_fit(problem, relaxed, budget_bytes, host_budget_bytes, copy_ops)
            if fitted is not None:
                tried.append((wider, fitted))
    best = min(
        [*([(budget_bytes, base)] if base is not None else []), *tried],
        key=lambda wp: (wp[1].step_time_s, wp[1].offloaded_bytes),
        default=None,
    )
    if best is None:
        assert refused is not None
        raise refused
    wider, plan = best
    if not plan.offloaded:
        return plan
    link = offload.link_of(problem)
    where = f" ({offload.SAME_MEMORY})" if link.synchronous else ""
    return dataclasses.replace(
        plan,
        solver=f"{plan.solver}+offload",
        reason=(
            f"{plan.solver}'s plan for {fmt_bytes(wider)} with {len(plan.offloaded)} saved "
            f"values ({fmt_bytes(plan.offloaded_bytes)}) offloaded to fit "
            f"{fmt_bytes(budget_bytes)}: a predicted step of {plan.step_time_s * 1e3:.4g} ms "
            f"against {base.step_time_s * 1e3:.4g} ms recomputing alone"
            if base is not None
            else f"{plan.solver}'s plan for {fmt_bytes(wider)} with {len(plan.offloaded)} "
            f"saved values offloaded: no recompute plan fits {fmt_bytes(budget_bytes)}"
        )
        + where,
        proof=Proof.HEURISTIC,
        lower_bound_s=None,
    )


__all__ = ["LADDER", "Placing", "offload_to_fit", "offloadable", "placing", "search"]
