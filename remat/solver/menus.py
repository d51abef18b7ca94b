"""A block's menu: one representative block per class cut out and solved exactly at several
budgets and prices per byte kept, each distinct plan an :class:`Option`
(:mod:`remat.solver.chain`, step 2). Menus are cached by the block's content.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from dataclasses import dataclass

from remat.problem import Problem
from remat.solver import clock
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import must_save
from remat.solver.fronts import KeptProblem, kept_problem
from remat.solver.milp import exact, kept_tradeoff, min_peak
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.schedule import InvalidPlanError
from remat.solver.structure import BALLAST, Block, Structure, block_problem

MENU_POINTS = 6
"""Budgets the representative block is solved at between its least and keep-all peaks."""


MENU_SHARE = 0.7
"""Share of the time limit the menus may take (the DP and local search have the rest)."""


MENU_SOLVES = 40
"""At most this many points of the block's (bytes kept, time) Pareto front."""


@dataclass(frozen=True)
class Option:
    saved: frozenset[str]
    """The option's saved set in the representative block."""
    time_s: float
    """Recompute time of one block with this option."""
    origin: str


MENU_CACHE = 16
"""Menus kept (least recently used dropped): a sweep, or a second capture of the same model,
solves each block's menu once."""


FRONT_WEIGHTS = (0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0)
"""Seconds per byte kept, in units of a block's average slope (recomputing all it can, over
what keep-all keeps), at which :func:`front_plans` touches the block's front."""


FRONT_SHARE = 6
"""A front point's solve may take the chain's time limit over this (10 s of 60), within the
menu's."""


_MENUS: collections.OrderedDict[tuple[object, ...], list[Option]] = collections.OrderedDict()


def cached_menu(
    problem: Problem, structure: Structure, cls: tuple[int, ...], config: SolverConfig
) -> list[Option]:
    """Menus depend on the block's problems and the solver's settings, not on the budget nor
    on which capture the block came from: the key is their whole content."""
    block = structure.blocks[cls[0]]
    sub, keep_all, heavy = block_problems(problem, block)
    kept = kept_problem(problem, block)
    key = (
        sub.content,
        heavy.content,
        kept.problem.content if kept else None,
        dataclasses.replace(config, progress=None),
    )
    if key in _MENUS:
        _MENUS.move_to_end(key)
        return _MENUS[key]
    menu = block_menu(sub, keep_all, heavy, config, kept)
    _MENUS[key] = menu
    if len(_MENUS) > MENU_CACHE:
        _MENUS.popitem(last=False)
    return menu


def block_problems(problem: Problem, block: Block) -> tuple[Problem, Plan, Problem]:
    """The block alone, its keep-all plan, and the block with a ballast above that plan's
    peak (its own backward's; see :func:`block_menu`)."""
    sub = block_problem(problem, block)
    keep_all = make_plan(
        sub,
        sub.backward_reads | set(must_save(sub)),
        solver="keep_all",
        reason="",
        proof=Proof.HEURISTIC,
    )
    return sub, keep_all, block_problem(problem, block, keep_all.predicted_peak_bytes)


def block_menu(
    sub: Problem,
    keep_all: Plan,
    heavy: Problem,
    config: SolverConfig,
    kept: KeptProblem | None = None,
) -> list[Option]:
    """Distinct plans of a block (``sub``), from keep-all to least peak; ``keep_all`` and
    ``heavy`` (the block with a ballast): :func:`block_problems`; ``kept``: the block as the
    backward's first moments see it (:func:`remat.solver.fronts.kept_problem`), for more
    points of its front."""
    fwd = sub.forward_names
    per = dataclasses.replace(config, time_limit_s=max(1.0, config.time_limit_s / MENU_SOLVES))
    deadline = clock.now() + config.time_limit_s * MENU_SHARE
    least = make_plan(sub, must_save(sub), solver="keep_inputs", reason="", proof=Proof.HEURISTIC)
    plans = [keep_all, least]
    # Options trading what the block keeps for the later blocks' backward against time: with a
    # ballast above the block's own backward peak, the budget bounds the bytes kept. First
    # across the whole range, then walking the Pareto front down from keep-all (each solve
    # asking for less than the last plan kept) while time remains.
    top = make_plan(
        heavy, keep_all.saved, solver="", reason="", proof=Proof.HEURISTIC
    ).predicted_peak_bytes
    bottom = make_plan(
        heavy, must_save(heavy), solver="", reason="", proof=Proof.HEURISTIC
    ).predicted_peak_bytes

    def solve_heavy(budget: int) -> int | None:
        try:
            p = exact(heavy, budget_bytes=budget, config=per)
        except (BudgetError, RuntimeError):
            return None
        plans.append(make_plan(sub, p.saved - {BALLAST}, solver="exact", reason="", proof=p.proof))
        return p.predicted_peak_bytes

    for k in range(1, 2 * MENU_POINTS):
        if clock.now() < deadline:
            solve_heavy(bottom + (top - bottom) * k // (2 * MENU_POINTS))
    # The fronts' points get more time than a budgeted solve: an incumbent cut short is
    # no point of the front.
    front = dataclasses.replace(
        config, time_limit_s=max(per.time_limit_s, config.time_limit_s / FRONT_SHARE)
    )
    slope = least.recompute_time_s / max(1, keep_all.simulation.saved_bytes)
    plans += front_plans(sub, sub, slope, front, deadline)
    if kept is not None:
        plans += front_plans(sub, kept.problem, kept.slope(), front, deadline, kept.stage)
    # Options trading the block's own backward peak against time (the binding constraint of
    # the last blocks, whose backward runs with everything before them kept).
    with contextlib.suppress(RuntimeError):
        plans.append(min_peak(sub, per))
    hi = keep_all.predicted_peak_bytes
    lo = min(p.predicted_peak_bytes for p in plans)
    for k in range(1, MENU_POINTS + 1):
        if clock.now() > deadline:
            break
        with contextlib.suppress(BudgetError, RuntimeError):
            plans.append(
                exact(sub, budget_bytes=lo + (hi - lo) * k // (MENU_POINTS + 1), config=per)
            )
    budget: int | None = top - 1
    for _ in range(MENU_SOLVES):
        if budget is None or clock.now() > deadline:
            break
        reached = solve_heavy(budget)
        budget = None if reached is None else reached - 1
    seen: dict[frozenset[str], Option] = {}
    for p in plans:
        saved = frozenset(n for n in p.schedule.saved if n in fwd)
        if saved not in seen or p.recompute_time_s < seen[saved].time_s:
            seen[saved] = Option(saved, p.recompute_time_s, p.solver)
    # Cheapest first; an option no cheaper and no smaller than another is dropped later by the
    # DP itself, so all are kept.
    return sorted(seen.values(), key=lambda o: (o.time_s, -len(o.saved)))


def front_plans(
    sub: Problem,
    on: Problem,
    slope: float,
    config: SolverConfig,
    deadline: float,
    stage: int = 0,
) -> list[Plan]:
    """Points of the block's front of recompute against bytes kept for the backward, as plans
    of ``sub``: the best plans of ``on`` (``sub``, or its :class:`KeptProblem`'s problem, with
    its ``stage``) for ``recompute + w * kept`` (:func:`remat.solver.milp.kept_tradeoff`) at
    the weights of :data:`FRONT_WEIGHTS` times ``slope``. Why: the budgeted solves step the
    budget in strides and stop at their time limits, and miss points of the front between
    them (Llama-70B's block: the menu kept 722 MB for 4.42 ms where the front has 689 MB for
    2.68 ms). And the kept problem's front is what the backward's first moments hold, where
    a deep stack's step peaks: it counts as kept what the backward outside the block reads
    of it (the next block reads its input), which ``sub`` does not (Llama-70B: its point at
    143 MB for 7.77 ms is none of ``sub``'s)."""
    fwd = set(sub.forward_names)
    out: list[Plan] = []
    for f in FRONT_WEIGHTS if slope > 0 else ():
        left = deadline - clock.now()
        if left <= 0:
            break
        limit = dataclasses.replace(config, time_limit_s=min(config.time_limit_s, left))
        found = kept_tradeoff(on, slope * f, limit, stage=stage)
        if found is None:
            continue
        with contextlib.suppress(InvalidPlanError):
            saved = (found.saved & fwd) | set(must_save(sub))
            out.append(make_plan(sub, saved, solver="front", reason="", proof=Proof.HEURISTIC))
    return out
