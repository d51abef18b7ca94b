"""LP relaxation + rounding (Checkmate, Jain et al. 2020, section 5): fast, with a lower bound.

The exact MILP's relaxation (every binary in [0, 1], no intra-stage cuts) is solved once. Its
optimum is a proven lower bound on the least recompute time under the budget. The fractional
saved-set ``s*`` is then rounded in two phases, as in Checkmate: (1) choose the saved set by
thresholding ``s*`` (every distinct threshold is tried, plus a few seeded randomized roundings);
(2) the recomputations follow from the saved set — our executor fixes them, so phase 2 is a
simulation rather than a second LP. The cheapest rounded plan whose simulated peak fits wins.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pulp

from remat.problem import Problem
from remat.solver import clock
from remat.solver.backend import backend
from remat.solver.compress import compress
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import fixed_saved_set, keep_all_plan
from remat.solver.milp import budget_error, least_plan
from remat.solver.milp_model import BelowFloor, MilpModel
from remat.solver.plan import Plan, Proof, make_plan, proven

RANDOM_ROUNDINGS = 16


@clock.counted
def lp_rounding(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    """The cheapest rounding of the LP relaxation that fits ``budget_bytes``."""
    keep_all = keep_all_plan(problem, "lp_round")
    if budget_bytes is None or keep_all.predicted_peak_bytes <= budget_bytes:
        return keep_all
    t0 = time.perf_counter()
    comp = compress(problem)
    small = comp.problem
    deadline = clock.now() + config.time_limit_s
    try:  # ModelTimeout (a RuntimeError) if the model takes the whole time limit to build
        model = MilpModel(small, budget_bytes, comp.fold, deadline=deadline)
    except BelowFloor as e:
        raise budget_error(budget_bytes, e.floor, least_plan(problem, config, None)) from None
    for var in model.lp.variables():
        var.cat = pulp.LpContinuous
    if config.progress:
        config.progress(f"lp_round: solving the LP relaxation ({len(model.lp.variables())} vars)")
    if (
        not model.lp.numConstraints()
    ):  # nothing to decide (e.g. the backward reads random values only)
        return _no_choice(problem)
    model.lp.solve(backend(config, max(1.0, deadline - clock.now()), {}))
    _check_solved(model, problem, budget_bytes, config)
    bound = max(0.0, float(pulp.value(model.lp.objective)) - model.tie_max) / model.scale
    frac = {n: float(v.value() or 0.0) for n, v in model.s.items()}
    random_values = {n for n in model.fwd if small.by_name[n].never_recomputed}
    best, tried = _best_rounding(small, _candidates(frac), random_values, budget_bytes)
    reason = (
        f"lp_round: best of {tried} roundings of the LP relaxation, "
        f"LP lower bound {bound * 1e3:.4g} ms, {time.perf_counter() - t0:.1f} s"
    )
    plan = make_plan(
        problem,
        best.saved,
        solver="lp_round",
        reason=reason,
        proof=Proof.HEURISTIC,
        lower_bound_s=bound,
    )
    # A rounding that meets the LP's bound is optimal.
    return dataclasses.replace(plan, proof=proven(plan))


def _no_choice(problem: Problem) -> Plan:
    """The plan where the model has no row, so nothing to decide: keeping the inputs, with
    a bound of zero (optimal if it recomputes nothing)."""
    only = make_plan(
        problem,
        fixed_saved_set(problem, "keep_inputs"),
        solver="lp_round",
        reason="lp_round: no choice to make",
        proof=Proof.HEURISTIC,
        lower_bound_s=0.0,
    )
    return dataclasses.replace(only, proof=proven(only))


def _check_solved(
    model: MilpModel, problem: Problem, budget_bytes: int, config: SolverConfig
) -> None:
    """Raise unless the relaxation was solved to optimality: an infeasible one proves the
    budget too low for any plan (a :class:`BudgetError` with the least plan's peak); any
    other status leaves no bound to report."""
    if model.lp.status != pulp.LpStatusOptimal:
        status = pulp.LpStatus[model.lp.status]
        hs = getattr(model.lp, "solverModel", None)
        if hs is not None:
            status += f" / HiGHS {hs.modelStatusToString(hs.getModelStatus())}"
        if model.lp.status == pulp.LpStatusInfeasible:
            raise budget_error(budget_bytes, model.floor, least_plan(problem, config, None))
        raise RuntimeError(f"lp_round: the LP relaxation was not solved ({status})")


def _candidates(frac: dict[str, float]) -> list[frozenset[str]]:
    """Phase 1's saved sets from the fractional ``s*``: one per distinct threshold (and 0.5),
    highest first, then :data:`RANDOM_ROUNDINGS` randomized roundings, seeded so that the
    same problem gets the same plan."""
    candidates: list[frozenset[str]] = []
    for theta in sorted({x for x in frac.values() if x > 1e-9} | {0.5}, reverse=True):
        candidates.append(frozenset(n for n, x in frac.items() if x >= theta - 1e-9))
    rng = random.Random(0)
    for _ in range(RANDOM_ROUNDINGS):
        candidates.append(frozenset(n for n, x in frac.items() if rng.random() < x))
    return candidates


def _best_rounding(
    small: Problem,
    candidates: list[frozenset[str]],
    random_values: set[str],
    budget_bytes: int,
) -> tuple[Plan, int]:
    """Phase 2: each distinct candidate (with the random values, which are never recomputed)
    simulated on the compressed problem ``small``; the cheapest that fits, and how many were
    tried. A :class:`BudgetError` with the least peak seen if none fits: the LP's rounding
    may miss plans the exact MILP finds."""
    best: Plan | None = None
    least_peak: int | None = None
    seen: set[frozenset[str]] = set()
    for saved in candidates:
        saved = saved | random_values
        if saved in seen:
            continue
        seen.add(saved)
        plan = make_plan(small, saved, solver="lp_round", reason="", proof=Proof.HEURISTIC)
        peak = plan.predicted_peak_bytes
        least_peak = peak if least_peak is None else min(least_peak, peak)
        if peak > budget_bytes:
            continue
        if best is None or plan.recompute_time_s < best.recompute_time_s:
            best = plan
    if best is None:
        assert least_peak is not None
        raise BudgetError(
            budget_bytes,
            least_peak,
            f"the least peak of {len(seen)} roundings of lp_round's LP relaxation; "
            "solver='exact' may go lower",
        )
    return best, len(seen)
