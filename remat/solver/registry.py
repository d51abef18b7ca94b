"""Every solver under one name and one signature.

``solve(problem, *, budget_bytes, config) -> Plan``. Rule-based baselines ignore the budget and
:func:`solve` checks their plan fits; optimizing solvers use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Mapping

from remat.problem import Problem
from remat.solver import clock
from remat.solver.baselines import (
    block_checkpoint,
    keep_all,
    keep_inputs,
    keep_matmuls,
    megatron_selective,
)
from remat.solver.chain import chain_solver
from remat.solver.chen import chen_greedy, chen_sqrt
from remat.solver.compress import compress
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.descent import descend
from remat.solver.lp_round import lp_rounding
from remat.solver.milp import exact
from remat.solver.plan import Plan, Proof, proven
from remat.solver.spans import solve_spans


def milp_size(problem: Problem) -> int:
    """Forward values of the compressed problem: what the flat LP/MILP would be built over."""
    return len(compress(problem).problem.forward_names)


SolverFn = Callable[..., Plan]
"""``fn(problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan``."""

HEURISTICS: Mapping[str, SolverFn] = {
    "keep_all": keep_all,
    "keep_inputs": keep_inputs,
    "keep_matmuls": keep_matmuls,
    "block": block_checkpoint,
    "megatron": megatron_selective,
    "chen_sqrt": chen_sqrt,
    "chen_greedy": chen_greedy,
}


def _heuristic_plans(
    problem: Problem, budget_bytes: int | None, config: SolverConfig
) -> tuple[list[Plan], list[Plan], int | None]:
    """Every heuristic's plan that fits, those that do not (starts for :func:`descend`), and
    the least peak any of them reached."""
    fitting: list[Plan] = []
    over: list[Plan] = []
    least_peak: int | None = None
    for name, fn in HEURISTICS.items():
        if config.progress:
            config.progress(f"trying {name}")
        try:
            plan = fn(problem, budget_bytes=budget_bytes, config=config)
        except BudgetError as e:
            peak = e.least_peak_bytes
        except ValueError:  # a baseline that does not apply (e.g. no blocks to checkpoint)
            continue
        else:
            peak = plan.predicted_peak_bytes
            (fitting if budget_bytes is None or peak <= budget_bytes else over).append(plan)
        least_peak = peak if least_peak is None else min(least_peak, peak)
    fitting.sort(key=_by_cost)
    over.sort(key=_by_cost)
    return fitting, over, least_peak


def _by_cost(plan: Plan) -> tuple[float, int, str]:
    return plan.recompute_time_s, plan.predicted_peak_bytes, plan.solver


def _descents(
    problem: Problem,
    over: list[Plan],
    fitting: list[Plan],
    budget_bytes: int,
    seconds: float,
    config: SolverConfig,
) -> list[Plan]:
    """:func:`descend`, within ``seconds``, from the ``DESCENT_STARTS`` plans over the budget
    nearest to it among those cheaper than every plan that fits (a start far above the budget
    would take many steps: keep_all is the cheapest plan over every budget)."""
    deadline = clock.now() + seconds
    cheapest = fitting[0].recompute_time_s if fitting else math.inf
    starts = {p.saved: p for p in over if p.recompute_time_s < cheapest}.values()
    found = []
    for start in sorted(starts, key=lambda p: p.predicted_peak_bytes)[:DESCENT_STARTS]:
        if config.progress:
            config.progress(f"peak descent from {start.solver}'s plan")
        plan = descend(problem, start, budget_bytes=budget_bytes, deadline=deadline)
        if plan is not None:
            found.append(plan)
    return found


LP_SHARE = 1 / 3
"""Share of the time limit the LP rounding may take before the exact MILP starts."""
DESCENT_SHARE = 0.1
"""Share of the time limit the peak descents (:mod:`remat.solver.descent`) may take."""
DESCENT_STARTS = 2
"""Plans over the budget a descent starts from (the nearest to it, see :func:`_descents`)."""


def _starts(
    problem: Problem, budget_bytes: int | None, config: SolverConfig, size: int
) -> tuple[list[Plan], int | None, float]:
    """Plans to start the exact MILP from, cheapest first: every heuristic's that fits, the
    chain solver's (blocks and a DP, :mod:`remat.solver.chain`; with the whole time limit,
    before the rest has it) where the graph is too large for the flat MILP, peak descents
    (:mod:`remat.solver.descent`) from the heuristic plans just over the budget, and the LP
    rounding's when the LP solves within its share of the time limit (on graphs of a few
    thousand values it does not). ``size`` is
    :func:`milp_size`. Also returns the least peak seen and the seconds left for the MILP (<= 0
    when the time limit is spent)."""
    t0 = clock.now()
    fitting, over, least_peak = _heuristic_plans(problem, budget_bytes, config)
    flat = size <= config.max_milp_values
    done = bool(fitting) and fitting[0].recompute_time_s == 0
    if budget_bytes is not None and not done and not flat:  # no MILP: the chain is the best
        chained = _chain_plan(problem, budget_bytes, config)
        if chained is not None:
            fitting = sorted([*fitting, chained], key=_by_cost)
        t0 = clock.now()
    if budget_bytes is not None and over:
        seconds = config.time_limit_s * DESCENT_SHARE
        fitting = sorted([*fitting, *_descents(problem, over, fitting, budget_bytes, seconds, config)],
                         key=_by_cost)  # fmt: skip
    left = config.time_limit_s - (clock.now() - t0)
    if budget_bytes is not None and flat and left > 0:
        share = min(left, config.time_limit_s * LP_SHARE)
        lp_config = dataclasses.replace(config, time_limit_s=share)
        # No rounding fits, or no time (to build the model, or to solve it).
        with contextlib.suppress(BudgetError, RuntimeError):
            fitting.append(lp_rounding(problem, budget_bytes=budget_bytes, config=lp_config))
        fitting.sort(key=_by_cost)
    # May be <= 0: the solvers stop building their models at their limits, but HiGHS takes
    # at least a second, and the heuristics and the chain's simulations are not interrupted.
    return fitting, least_peak, config.time_limit_s - (clock.now() - t0)


def _chain_plan(problem: Problem, budget_bytes: int, config: SolverConfig) -> Plan | None:
    """The chain solver's plan, as ``solver="chain"`` makes it (the whole time limit: its
    refinement uses all it has); None without repeated blocks or a chain plan that fits."""
    try:
        return chain_solver(problem, budget_bytes=budget_bytes, config=config)
    except (BudgetError, ValueError):
        return None


def _unless_proven(
    problem: Problem, plan: Plan, budget_bytes: int | None, config: SolverConfig
) -> Plan:
    """``plan``, or the chain solver's where ``plan`` is not proven optimal and the chain's
    is cheaper, with the better lower bound of the two (a bound holds for every plan at the
    budget). Why: every other solver's plan is a warm start of the MILP, and a proven optimum
    is the least of any plan; the chain's local search is anytime, so it is run as alone,
    after the MILP and only where the MILP proved nothing, and exact is never beaten."""
    if budget_bytes is None or proven(plan) is Proof.OPTIMAL or "chain" in plan.solver:
        return plan
    chained = _chain_plan(problem, budget_bytes, config)
    if chained is None or chained.recompute_time_s >= plan.recompute_time_s:
        return plan
    bound = _max_lower_bound([plan, chained])
    if bound is not None:
        bound = min(bound, chained.recompute_time_s)
    chained = dataclasses.replace(chained, lower_bound_s=bound)
    return dataclasses.replace(
        chained,
        solver=plan.solver,
        reason=f"{chained.reason}; cheaper than the exact MILP's plan ({plan.reason})",
        proof=proven(chained),
    )


@clock.counted
def exact_solver(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    """The exact MILP, warm-started from the cheapest heuristic or LP-rounded plan that fits;
    where it proves nothing in time, the chain solver's plan if that is cheaper
    (:func:`_unless_proven`)."""
    size = milp_size(problem)
    fitting, _, seconds = _starts(problem, budget_bytes, config, size)
    left = dataclasses.replace(config, time_limit_s=max(1.0, seconds))
    found = exact(
        problem, budget_bytes=budget_bytes, config=left, start=fitting[0] if fitting else None
    )
    if size > config.max_milp_values:  # the chain's plan was a warm start already
        return found
    return _unless_proven(problem, found, budget_bytes, config)


SOLVERS: Mapping[str, SolverFn] = {
    **HEURISTICS,
    "chain": chain_solver,
    "lp_round": lp_rounding,
    "exact": exact_solver,
}


def _spans_exact(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    return solve_spans(problem, budget_bytes=budget_bytes, config=config)


def _spans_rounded(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    return solve_spans(problem, budget_bytes=budget_bytes, config=config, relax=True)


def _spans_auto(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    """The cheapest fitting plan of the heuristics and the fixed-lifetime MILP."""
    if budget_bytes is None:
        plan = keep_all(problem, budget_bytes=None, config=config)
        return _with_reason(plan, "auto", "no budget given: keep everything (no recomputation)")
    fitting, _, least_peak = _heuristic_plans(problem, budget_bytes, config)
    try:
        fitting.append(_spans_exact(problem, budget_bytes=budget_bytes, config=config))
    except BudgetError as e:
        least_peak = min(least_peak or e.least_peak_bytes, e.least_peak_bytes)
    if not fitting:
        raise BudgetError(budget_bytes, least_peak or 0, "the least peak of auto's plans")
    return _cheapest(sorted(fitting, key=_by_cost), "the exact MILP over fixed lifetimes included")


FIXED_LIFETIME_SOLVERS: Mapping[str, SolverFn] = {
    **HEURISTICS,
    "lp_round": _spans_rounded,
    "exact": _spans_exact,
}
"""Solvers for executors whose lifetimes do not depend on the plan (``sac``): the MILP and
the LP rounding are :mod:`remat.solver.spans`'s; the chain solver's menus and the flat MILP
model the graph executor's recompute-at-stage schedule."""


def get_solver(name: str, problem: Problem | None = None) -> SolverFn:
    """``name``'s solver for ``problem``'s executor (remat's, without a problem)."""
    executor = "graph" if problem is None else problem.executor
    solvers = solvers_for(executor)
    try:
        return solvers[name]
    except KeyError:
        on = f" for the {problem.executor} executor" if problem is not None else ""
        raise ValueError(
            f"unknown solver {name!r}{on}; valid solvers: "
            f"{', '.join(sorted(n for n in solvers if n != 'auto'))}, auto"
        ) from None


def solvers_for(executor: str) -> Mapping[str, SolverFn]:
    """The solvers of one executor (:data:`SOLVER_TABLE`), ``auto`` included."""
    return {name: fn for (ex, name), fn in SOLVER_TABLE.items() if ex == executor}


@clock.counted
def solve_auto(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    """The exact MILP's plan when it is found in the time limit (warm-started from the best
    heuristic or LP-rounded plan, so never worse), else the cheapest of those that fits."""
    if budget_bytes is None:
        plan = keep_all(problem, budget_bytes=None, config=config)
        return _with_reason(plan, "auto", "no budget given: keep everything (no recomputation)")
    size = milp_size(problem)  # compresses the problem: once per call
    fitting, least_peak, seconds = _starts(problem, budget_bytes, config, size)
    best = fitting[0] if fitting else None
    if size > config.max_milp_values:
        if best is None:
            raise BudgetError(
                budget_bytes,
                least_peak or 0,
                "the least peak of the heuristics (graph too large for the flat MILP)",
            )
        return _cheapest(
            fitting,
            f"the flat MILP was skipped: {size} forward values after compression > "
            f"max_milp_values={config.max_milp_values}",
        )
    if fitting and seconds <= 0:
        return _cheapest(fitting, "the time limit was spent before the exact MILP could start")
    left = dataclasses.replace(config, time_limit_s=max(1.0, seconds))
    try:
        found = exact(problem, budget_bytes=budget_bytes, config=left, start=best)
    except BudgetError as e:
        known = [x for x in (least_peak, e.least_peak_bytes if e.achievable else None) if x]
        if known:
            raise BudgetError(
                budget_bytes, min(known), "the least peak the exact MILP and heuristics reached"
            ) from None
        raise
    except RuntimeError as e:  # the MILP found nothing in time
        if best is None:
            raise BudgetError(budget_bytes, least_peak or 0, f"heuristics only: {e}") from None
        found = best
    names = ", ".join(p.solver for p in fitting) or "none"
    # A lower bound holds for every plan at this budget: keep the best one proven.
    bound = _max_lower_bound([*fitting, found])
    if best is not None and best.recompute_time_s <= found.recompute_time_s:
        why = f"{best.reason}; the exact MILP found nothing cheaper ({found.reason})"
        # As cheap as the MILP's plan: as optimal as it, if it was proven.
        proof = Proof.OPTIMAL if found.proof is Proof.OPTIMAL else best.proof
        found = dataclasses.replace(best, proof=proof)
    else:
        why = found.reason
    if bound is not None:
        bound = min(bound, found.recompute_time_s)  # solver tolerances
    found = _unless_proven(
        problem, dataclasses.replace(found, lower_bound_s=bound), budget_bytes, config
    )
    return _with_reason(
        found,
        f"auto:{found.solver}",
        f"least recompute time among the plans that fit ({names}) and the exact MILP: {why}",
    )


def _cheapest(fitting: list[Plan], why: str) -> Plan:
    """The cheapest plan that fits (``fitting`` is sorted), with the best bound of them all."""
    best = fitting[0]
    return _with_reason(
        dataclasses.replace(best, lower_bound_s=_max_lower_bound(fitting)),
        f"auto:{best.solver}",
        f"least recompute time among the plans that fit "
        f"({', '.join(p.solver for p in fitting)}); {why}",
    )


def _max_lower_bound(plans: list[Plan]) -> float | None:
    bounds = [p.lower_bound_s for p in plans if p.lower_bound_s is not None]
    return max(bounds) if bounds else None


SOLVER_TABLE: Mapping[tuple[str, str], SolverFn] = {
    **{("graph", name): fn for name, fn in SOLVERS.items()},
    ("graph", "auto"): solve_auto,
    **{("sac", name): fn for name, fn in FIXED_LIFETIME_SOLVERS.items()},
    ("sac", "auto"): _spans_auto,
}
"""Every solver by ``(executor, name)``: remat's executor (``graph``) and PyTorch's checkpoint
executor (``sac``, fixed lifetimes), each with its ``auto``."""


def least_peak(problem: Problem, name: str, config: SolverConfig | None = None) -> int:
    """The least peak ``name`` reaches (its plan at budget 0, or the peak its error states);
    a huge number if the solver does not apply (e.g. no blocks)."""
    try:
        return solve(problem, solver=name, budget_bytes=0, config=config).predicted_peak_bytes
    except BudgetError as e:
        return e.least_peak_bytes
    except ValueError:
        return 1 << 62


def _with_reason(plan: Plan, solver: str, reason: str) -> Plan:
    """``auto``'s plan: the winner's, renamed, with its proof (:attr:`Proof.OPTIMAL` when its
    cost meets the best lower bound any solver proved)."""
    return dataclasses.replace(plan, solver=solver, reason=reason, proof=proven(plan))


@clock.counted
def solve(
    problem: Problem,
    *,
    solver: str,
    budget_bytes: int | None,
    config: SolverConfig | None = None,
) -> Plan:
    """Run one solver; raises :class:`BudgetError` if its plan does not fit ``budget_bytes``."""
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError("the budget must be >= 0 bytes")
    config = config or SolverConfig()
    reused = _solved_before(problem, budget_bytes, config, solver)
    if reused is not None:
        return reused
    plan = get_solver(solver, problem)(problem, budget_bytes=budget_bytes, config=config)
    if budget_bytes is not None and plan.predicted_peak_bytes > budget_bytes:
        raise BudgetError(budget_bytes, plan.predicted_peak_bytes, f"the peak of {solver}'s plan")
    if budget_bytes is not None:
        if solver in NEVER_BEATEN:
            plan = _with_seen(problem, budget_bytes, plan, solver)
            _SOLVED.setdefault(id(problem), {})[budget_bytes, _settings(config)] = plan
        _remember(problem, budget_bytes, plan)
    return plan


NEVER_BEATEN = ("exact", "auto")
"""Solvers whose plan is at least as cheap as every plan any solver found for the same
problem and budget in this process (:func:`_with_seen`)."""

_SEEN: dict[int, dict[int, Plan]] = {}
"""``id(problem)`` -> budget -> the cheapest plan :func:`solve` returned there so far."""


_SOLVED: dict[int, dict[tuple[int, SolverConfig], Plan]] = {}
"""``id(problem)`` -> (budget, settings) -> the plan ``exact`` or ``auto`` returned there."""


def _settings(config: SolverConfig) -> SolverConfig:
    """``config`` without what does not change a plan (the progress callback)."""
    return dataclasses.replace(config, progress=None)


def _solved_before(
    problem: Problem, budget_bytes: int | None, config: SolverConfig, solver: str
) -> Plan | None:
    """The plan ``exact`` or ``auto`` already returned for this problem, budget and settings,
    renamed for ``solver``; None for other solvers or where neither ran. Why: both run the
    same MILP under a work limit, and ``auto`` starts it from more plans than ``exact`` does,
    so the two could end on different incumbents; answering both from one run keeps them
    equal, and each at or below every plan seen before it (:func:`_with_seen`), whichever
    runs first."""
    if solver not in NEVER_BEATEN or budget_bytes is None:
        return None
    plan = _SOLVED.get(id(problem), {}).get((budget_bytes, _settings(config)))
    if plan is None:
        return None
    if solver == "auto":
        name = plan.solver if plan.solver.startswith("auto") else f"auto:{plan.solver}"
    else:
        name = solver
    return dataclasses.replace(plan, solver=name)


def _remember(problem: Problem, budget_bytes: int, plan: Plan) -> None:
    key = id(problem)
    if key not in _SEEN:
        _SEEN[key] = {}
        weakref.finalize(problem, _SEEN.pop, key, None)
        weakref.finalize(problem, _SOLVED.pop, key, None)
    best = _SEEN[key].get(budget_bytes)
    if best is None or plan.recompute_time_s < best.recompute_time_s:
        _SEEN[key][budget_bytes] = plan


def _with_seen(problem: Problem, budget_bytes: int, plan: Plan, solver: str) -> Plan:
    """``plan``, or the cheapest plan another solver already found at this budget when that
    one is cheaper. Why: the chain's local search and the LP rounding stop at work limits,
    and a second run inside ``exact`` (a warm start, or the chain after an unproven MILP)
    gets another share of the limit, so it can come out worse than the run a user just saw.
    Every plan :func:`solve` returned is a warm start of ``exact`` and ``auto`` this way."""
    seen = _SEEN.get(id(problem), {}).get(budget_bytes)
    if seen is None or seen.recompute_time_s >= plan.recompute_time_s:
        return plan
    bound = _max_lower_bound([plan, seen])
    return dataclasses.replace(
        seen,
        solver=f"auto:{seen.solver}" if solver == "auto" else solver,
        reason=f"{seen.reason}; {seen.solver}'s plan from an earlier solve, cheaper than "
        f"{plan.solver}'s ({plan.reason})",
        proof=proven(seen),
        lower_bound_s=None if bound is None else min(bound, seen.recompute_time_s),
    )
