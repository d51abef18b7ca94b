"""The exact MILP over the executor's schedule: least recompute time under a byte budget.

The model is :class:`remat.solver.milp_model.MilpModel` (its docstring has the formulation).
This module searches with it: a warm start from the best heuristic plan, rounds of lazy cuts
until the simulated plan fits, a loose gap first and a tight one once a plan fits, and the
proof or the bound a plan carries.

Every recomputation the model could want is allowed: ``R[v, t]`` exists for every stage ``t``
at which some (non-random) descendant of ``v`` is read. The solver minimises sum of recompute
times; ties are broken towards fewer saved bytes.

Size: the problem is first compressed without loss (:mod:`remat.solver.compress`: views merged
into their bases where that cannot cost, never-worth-saving chains sharing their consumer's
variables), and availability "saved or recomputed by stage t" is one cumulative variable per
(value, window stage) rather than a sum written out at every use. On GPT-2 small (12 layers)
that takes the model from 105k to 52k binaries and from 16 M to 1.6 M nonzeros; it is still
too large for HiGHS to solve its root LP in minutes on two cores, which is why large models
go through the block decomposition instead.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Collection

import pulp

from remat.problem import Problem
from remat.solver import clock
from remat.solver.backend import backend, best_bound
from remat.solver.compress import Compressed, compress
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import keep_all_plan
from remat.solver.milp_model import (
    SAVED,
    UNUSED,
    BelowFloor,
    MilpModel,
    ModelTimeout,
    cost_bound,
    stage_ops,
    start_values,
    violations,
)
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.simulate import Simulation


@clock.counted
def exact(
    problem: Problem,
    *,
    budget_bytes: int | None,
    config: SolverConfig,
    start: Plan | None = None,
    free: Collection[str] | None = None,
) -> Plan:
    """Least recompute time under ``budget_bytes`` (no budget: keep everything).

    ``start``: a plan to warm-start from (e.g. the best heuristic's); the result is never
    worse than it when it fits the budget.

    ``free``: a large-neighbourhood step. Only these forward values may change from ``start``'s
    choice of saved or not; the others keep it, and the stage at which ``start``'s schedule
    recomputes them. The result is the least recompute time within that neighbourhood and
    records no lower bound, since it proves nothing about plans outside it. Needs a ``start``
    that fits.
    """
    keep_all = keep_all_plan(problem, "exact")
    fits = budget_bytes is not None and keep_all.predicted_peak_bytes <= budget_bytes
    if budget_bytes is None or (fits and free is None):
        return keep_all
    if start is not None and start.predicted_peak_bytes > budget_bytes:
        start = None
    if free is not None and start is None:
        raise ValueError("a neighbourhood solve (free=...) needs a start plan that fits")
    return _solve(problem, budget_bytes, config, start, free)


@dataclasses.dataclass(frozen=True)
class Tradeoff:
    """:func:`kept_tradeoff`'s answer at one weight."""

    bound_s: float
    """A lower bound on ``recompute_s + weight * kept`` over every plan."""
    kept: int
    """The bytes the solver's best plan keeps."""
    saved: frozenset[str]
    """That plan's saved values (a plan of the block, on the front where it is optimal)."""


@clock.counted
def kept_tradeoff(
    problem: Problem, weight: float, config: SolverConfig, *, stage: int = 0
) -> Tradeoff | None:
    """A lower bound, in seconds, on ``recompute_s + weight * kept`` over every plan of
    ``problem``, where ``kept`` is the bytes of forward values live before the recomputations
    of the backward's ``stage``-th stage (its ``stage``-th op that reads a forward value; at
    0, what the plan keeps for the backward), and the solver's best plan; ``None`` if nothing
    was proven in ``config.time_limit_s``. No budget, and the model without its moment cuts:
    a relaxation, so its dual bound holds for every plan. Why: over ``weight`` these are
    tangents below the least recompute for each bound on what is kept
    (:mod:`remat.solver.fronts`), valid whether that staircase is convex or not; and the best
    plans are points of that front, options the chain solver's menus lack
    (:mod:`remat.solver.chain`)."""
    comp = compress(problem)
    budget = 4 * sum(problem.storage_bytes.values()) + 1
    model = MilpModel(comp.problem, budget, comp.fold, kept_weight=weight, kept_stage=stage)
    model.lp.solve(backend(config, max(1.0, config.time_limit_s), {}, probing=False))
    raw = best_bound(model.lp)
    if raw is None or not math.isfinite(raw):
        return None
    kept = sum(b * (v.value() or 0.0) for b, v in model.kept_terms)
    bound = max(0.0, (raw - model.tie_max) / model.scale)
    return Tradeoff(bound, round(kept), frozenset(model.saved()))


@clock.counted
def min_peak(problem: Problem, config: SolverConfig, start: Plan | None = None) -> Plan:
    """The plan with the least simulated peak (recompute time not optimised). Its ``proof`` is
    about that peak: :attr:`Proof.OPTIMAL` when the MILP proved it least."""
    return _solve(problem, None, config, start)


@dataclasses.dataclass(frozen=True)
class _Search:
    """One exact solve: the problem as given and compressed, the budget (``None``: least
    peak), the start plan on both, the values a neighbourhood solve fixes, the deadline."""

    original: Problem
    comp: Compressed
    budget_bytes: int | None
    config: SolverConfig
    start: Plan | None
    small_start: Plan | None
    fix: dict[str, str]
    free: Collection[str] | None
    t0: float
    deadline: float

    @property
    def what(self) -> str:
        return "least recompute time" if self.budget_bytes is not None else "least peak"

    def model(self, budget_bytes: int | None) -> MilpModel:
        return MilpModel(self.comp.problem, budget_bytes, self.comp.fold, self.fix, self.deadline)


def _solve(
    problem: Problem,
    budget_bytes: int | None,
    config: SolverConfig,
    start: Plan | None,
    free: Collection[str] | None = None,
) -> Plan:
    """Solve the losslessly compressed problem; the plan is made and checked on the original.
    The model is solved, its plan simulated, and cuts added at the moments where the
    simulation is over the model's peak, until they agree (:func:`_rounds`)."""
    t0 = time.perf_counter()
    comp = compress(problem)
    small_start, fix = _compressed_start(comp, start, free)
    search = _Search(
        original=problem,
        comp=comp,
        budget_bytes=budget_bytes,
        config=config,
        start=start,
        small_start=small_start,
        fix=fix,
        free=free,
        t0=t0,
        deadline=clock.now() + config.time_limit_s,
    )
    opened = _open(search)
    return opened if isinstance(opened, Plan) else _rounds(search, opened)


def _open(s: _Search) -> MilpModel | Plan:
    """The model, bounded below by its plan-independent floor and above by the start plan's
    peak; or the plan already known: the start, where it reaches the floor or the model
    could not be built in time."""
    try:
        model = s.model(s.budget_bytes)
    except BelowFloor as e:
        assert s.budget_bytes is not None
        least = least_plan(s.original, s.config, s.start)
        raise budget_error(s.budget_bytes, e.floor, least) from None
    except ModelTimeout as e:
        if s.start is None or s.budget_bytes is None:
            raise
        return dataclasses.replace(
            s.start, reason=f"exact MILP: {e}; kept {s.start.solver}", proof=Proof.TIME_LIMIT
        )
    if model.budget_var is not None:
        model.budget_var.lowBound = model.floor
        if s.start is not None:
            if s.start.predicted_peak_bytes <= model.floor:
                return dataclasses.replace(
                    s.start,
                    solver="exact",
                    reason=f"exact ({s.what}): {s.start.solver}'s plan reaches the "
                    "plan-independent floor (optimal)",
                    proof=Proof.OPTIMAL,
                )
            model.budget_var.upBound = s.start.predicted_peak_bytes
    return model


def _rounds(s: _Search, model: MilpModel) -> Plan:
    """Solve, simulate, cut where the simulation is over, until the plan is within the
    model's peak (or the time is up)."""
    problem = s.comp.problem
    rounds = 0
    margin = 0  # bytes taken off the budget to absorb the solver's feasibility tolerance
    fresh = True
    while True:
        rounds += 1
        if s.config.progress:
            s.config.progress(f"exact MILP round {rounds}: {model.binaries} binaries")
        warm = start_values(model, s.small_start) if s.small_start is not None and fresh else {}
        fresh = False
        _run_solver(model, s, warm)
        if model.lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return _no_solution(model, s.original, s.budget_bytes, s.config, s.start, s.free)
        saved = model.saved() | {n for n in model.fwd if problem.by_name[n].never_recomputed}
        plan = make_plan(problem, saved, solver="exact", reason="", proof=Proof.TIME_LIMIT)
        sim = plan.simulation
        target = float(s.budget_bytes if s.budget_bytes is not None else pulp.value(model.M))
        if sim.peak_bytes <= target + 0.5:
            break
        added = 0
        for w, t in violations(model, sim, target, stage_ops(plan)):
            added += model.add_moment_cut(w, t)
            if added >= 8:
                break
        over = sim.peak_bytes - target
        if not added and s.budget_bytes is not None and over <= max(1024, 1e-6 * target):
            # Within the solver's feasibility tolerance (1e-7 of a row's scale): not a
            # modelling gap. Solve again for a budget smaller by that much.
            again = _for_tolerance(s, model, margin, over, rounds)
            if isinstance(again, Plan):
                return again
            (model, margin), fresh = again, True
            continue
        if not added:
            raise RuntimeError(
                "exact MILP: its model and the simulator disagree at a moment no cut covers "
                f"(simulated {sim.peak_bytes:,} B at {sim.peak_step}, model {target:,.0f} B); "
                "this is a bug, please report it with the model"
            )
        if clock.now() > s.deadline:
            # The model so far is a relaxation: its bound is still a valid lower bound (unless
            # it was solved for less than the budget).
            bound = cost_bound(model) if not margin and s.free is None else None
            start = s.start if s.budget_bytes is not None else None
            return _out_of_time(start, bound, f"{rounds} round(s) of cuts")
    rounds_text = f"{rounds} round(s), {time.perf_counter() - s.t0:.1f} s"
    return _final_plan(
        model, s.original, saved, sim, s.budget_bytes, s.what, rounds_text, margin,
        len(s.fix), s.free,
    )  # fmt: skip


def _run_solver(model: MilpModel, s: _Search, warm: dict[pulp.LpVariable, float]) -> None:
    left = max(1.0, s.deadline - clock.now())
    model.lp.solve(backend(s.config, left, warm, probing=False))
    if model.lp.status == pulp.LpStatusInfeasible:  # confirmed without presolve
        left = max(1.0, s.deadline - clock.now())
        model.lp.solve(backend(s.config, left, warm, probing=False, presolve=False))


def _for_tolerance(
    s: _Search, model: MilpModel, margin: int, over: float, rounds: int
) -> tuple[MilpModel, int] | Plan:
    """The model again for ``over`` more bytes under the budget than ``margin``, and the new
    margin; the start plan (or none) where there is no time for it or the budget is that
    close to the floor."""
    what = f"{rounds} round(s), re-solving for the solver's tolerance"
    if clock.now() > s.deadline:
        # A model solved for less than the budget bounds nothing at the budget.
        bound = cost_bound(model) if not margin and s.free is None else None
        return _out_of_time(s.start, bound, what)
    assert s.budget_bytes is not None
    margin += math.ceil(over) + 1
    try:
        return s.model(s.budget_bytes - margin), margin
    except (BelowFloor, ModelTimeout):  # a budget this close to the floor, or no time
        return _out_of_time(s.start, None, what)


def _compressed_start(
    comp: Compressed, start: Plan | None, free: Collection[str] | None
) -> tuple[Plan | None, dict[str, str]]:
    """The start plan on the compressed problem, and (with ``free``) the values fixed to
    what it does: saved, or recomputed at the stage it recomputes them."""
    if start is None:
        return None, {}
    problem = comp.problem
    small_start = make_plan(
        problem, comp.lower(start.saved), solver=start.solver, reason="", proof=start.proof
    )
    if free is None:
        return small_start, {}
    movable = {comp.leader(comp.rep.get(n, n)) for n in free}
    kept = small_start.saved | comp.lower(start.saved)
    stage = stage_ops(small_start)
    fix = {
        n: SAVED if n in kept else stage.get(n, UNUSED)
        for n in problem.forward_names
        if n not in movable
    }
    return small_start, fix


def _no_solution(
    model: MilpModel,
    original: Problem,
    budget_bytes: int | None,
    config: SolverConfig,
    start: Plan | None,
    free: Collection[str] | None,
) -> Plan:
    """The solver stopped without an integer solution: the start plan, or the least-peak plan
    where it fits, or a :class:`BudgetError`."""
    status = pulp.LpStatus[model.lp.status]
    if budget_bytes is None:
        raise RuntimeError(f"exact MILP found no plan ({status}) within the time limit")
    if start is not None:
        return dataclasses.replace(
            start,
            reason=f"exact MILP found nothing better in time; kept {start.solver}",
            proof=Proof.TIME_LIMIT,
            lower_bound_s=cost_bound(model) if free is None else start.lower_bound_s,
        )
    least = least_plan(original, config, None)
    if least is not None and least.predicted_peak_bytes <= budget_bytes:
        # The budgeted model found nothing in time (or, at a budget equal to the least
        # peak, lost it to the solver's tolerance), but the least-peak plan fits.
        return dataclasses.replace(
            least,
            solver="exact",
            reason=f"exact MILP found no plan for the budget ({status}); its least-peak "
            "plan fits it (recompute time not optimised)",
            proof=Proof.HEURISTIC,
            lower_bound_s=None,
        )
    raise budget_error(budget_bytes, model.floor, least)


def _final_plan(
    model: MilpModel,
    original: Problem,
    saved: set[str],
    sim: Simulation,
    budget_bytes: int | None,
    what: str,
    rounds_text: str,
    margin: int,
    fixed: int,
    free: Collection[str] | None,
) -> Plan:
    """The solved plan on the original problem, with what the solve proved."""
    optimal = model.lp.sol_status == pulp.LpSolutionOptimal
    # The objective is recompute nanoseconds with a budget, peak bytes without one.
    # A bound on objective = cost + tie-break is a bound on cost once the tie-break's largest
    # possible value is taken off.
    scale, unit, ties = (
        (model.scale, "s", model.tie_max) if budget_bytes is not None else (1.0, "B", 0.0)
    )
    objective = float(pulp.value(model.lp.objective) or 0.0)
    raw_bound = objective if optimal else best_bound(model.lp)
    bound = max(0.0, raw_bound - ties) / scale if raw_bound is not None else None
    if bound is not None and not math.isfinite(bound):
        bound = None
    proof = (
        "optimal"
        if optimal
        else f"time limit hit, best bound {bound:.4g} {unit}"
        if bound is not None
        else "time limit hit"
    )
    proven = Proof.OPTIMAL if optimal else Proof.TIME_LIMIT
    if free is not None:  # optimal within the neighbourhood only
        proof = "optimal in the neighbourhood" if optimal else "time limit hit"
        proven = Proof.NEIGHBOURHOOD if optimal else Proof.TIME_LIMIT
        what += f", {len(model.fwd) - fixed} of {len(model.fwd)} values free"
        bound = None
    reason = (
        f"exact MILP ({what}), {proof}, {rounds_text}, "
        f"{model.binaries} binaries over {model.T} stages "
        f"({len(original.forward_names)} forward values compressed to {len(model.fwd)})"
        + (f"; solved for {margin:,} B under the budget (solver tolerance)" if margin else "")
    )
    time_bound = bound if budget_bytes is not None else None
    plan = make_plan(
        original, saved, solver="exact", reason=reason, proof=proven, lower_bound_s=time_bound
    )
    if plan.predicted_peak_bytes != sim.peak_bytes:
        raise RuntimeError(
            f"exact MILP: the compressed problem simulates a peak of {sim.peak_bytes:,} B but "
            f"the original {plan.predicted_peak_bytes:,} B; this is a bug, please report it"
        )
    return plan


def _out_of_time(start: Plan | None, bound: float | None, what: str) -> Plan:
    """The start plan with what the MILP proved, or an error when there is none."""
    if start is None:
        raise RuntimeError(f"exact MILP found no plan within the time limit ({what})")
    return dataclasses.replace(
        start,
        reason=f"exact MILP ran out of time after {what}; kept {start.solver}",
        proof=Proof.TIME_LIMIT,
        lower_bound_s=bound,
    )


def least_plan(problem: Problem, config: SolverConfig, start: Plan | None) -> Plan | None:
    """The least-peak plan the MILP proves, or, if it runs out of time, ``start`` (if any)."""
    try:
        return min_peak(problem, config, start)
    except RuntimeError:
        return start


def budget_error(budget: int, floor: int, least: Plan | None) -> BudgetError:
    """The error for a budget no plan meets, with the least known peak (``least``'s), else the
    plan-independent floor as a lower bound."""
    if least is None:
        return BudgetError(budget, floor, "exact MILP out of time", achievable=False)
    return BudgetError(budget, least.predicted_peak_bytes, "exact MILP")
