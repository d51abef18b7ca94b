"""The chain solver's searches from the DP's stitched plan (:mod:`remat.solver.chain`, steps 5
and 7): where the DP's additive model was wrong, the simulator and the exact MILP correct it.

* **On the simulated plan** (step 5): the DP solved again until the stitched plan fits, a
  one-block repair, and the local search over single blocks' options. These work on
  choices (one option per block) through a ``stitch`` the caller gives, with or without
  seams, so the chain solver runs them on the plain chain and again with seams.
* **Refinement in context** (step 7): windows of values re-solved by the exact MILP with the
  rest of the plan fixed.

Separate from :mod:`remat.solver.chain`, which finds the blocks, their menus and the costs
the DP reads, tries seams, and bounds and reports the plan: these searches only need a
stitched plan, the menus and a budget, and each tries plans until one is better or the
time is up.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

from remat.problem import Problem
from remat.solver import clock
from remat.solver.chain_dp import GRID, ChainCosts, chain_dp
from remat.solver.compress import compress
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.menus import Option
from remat.solver.milp import exact
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.schedule import InvalidPlanError
from remat.solver.structure import Structure

DP_ROUNDS = 24
"""DP solves, each for a smaller budget, until the simulated plan fits."""
MENU_WINDOW = 2
"""The all-blocks refinement window frees what a block's menu neighbours this far on either
side disagree on (on a 4-layer Llama, 2 found the flat MILP's best plan; 5 and 10 found the
same, in more time)."""


def search(
    problem: Problem,
    costs: list[ChainCosts],
    target: int,
    options_of: Sequence[Sequence[Option]],
    stitch: Callable[[Sequence[int]], frozenset[str]],
    deadline: float,
    config: SolverConfig,
    polish: bool = True,
) -> tuple[Plan, list[int]] | None:
    """Steps 4 and 5 of :mod:`remat.solver.chain`'s docstring: the DP, solved again for less
    while the simulated plan is over ``target`` and then, between the budgets that fit and
    that did not, for more while it fits (the DP's model is conservative at some moments, so
    the first plan that fits may leave memory unused); a one-block repair; then (``polish``)
    the local search."""
    n_blocks = len(options_of)
    best: Plan | None = None
    best_choice: list[int] = []
    first_over: list[int] | None = None
    fits_at: int | None = None  # the largest DP budget whose plan fit
    over_at: int | None = None  # the least DP budget whose plan was over
    dp_budget = target
    step = max(1, target // GRID)
    outcome: dict[tuple[int, ...], int] = {}  # a choice's simulated peak over the target
    for _ in range(DP_ROUNDS):
        found = chain_dp(costs, dp_budget, n_blocks)
        if found is None:
            break
        key = tuple(found)
        fresh = key not in outcome
        if fresh:
            plan = stitched_plan(problem, stitch(found))
            if plan is None:
                break
            outcome[key] = plan.predicted_peak_bytes - target
            if outcome[key] <= 0 and (
                best is None or plan.recompute_time_s < best.recompute_time_s
            ):
                best, best_choice = plan, found
            elif outcome[key] > 0 and first_over is None:
                first_over = found
        if outcome[key] <= 0:
            fits_at = dp_budget
        else:
            over_at = dp_budget if over_at is None else min(over_at, dp_budget)
        if fits_at is None:
            if fresh:
                dp_budget -= outcome[key]
            else:  # the DP's grid hides the difference: ask for less, faster
                dp_budget -= step
                step *= 2
        elif over_at is None or over_at - fits_at <= 2 * step:
            break
        else:
            dp_budget = (fits_at + over_at) // 2
    if config.progress:
        config.progress("chain: local search on the simulated plan")
    if first_over is not None:
        # The DP's cheapest choice was over budget by a little: one block moved may fix it.
        repaired = _repair(problem, first_over, target, options_of, stitch, deadline, costs)
        if repaired is not None and (
            best is None or repaired[0].recompute_time_s < best.recompute_time_s
        ):
            best, best_choice = repaired
    if best is None or not polish:
        return None if best is None else (best, best_choice)
    return local_search(problem, best, best_choice, target, options_of, stitch, deadline, costs)


def stitched_plan(problem: Problem, saved: frozenset[str]) -> Plan | None:
    """A stitched saved set's plan, or None where the executor cannot run it (a seam's or a
    dropped value's recomputation that would need a random op: the candidates exclude it,
    so this is a guard, not a path)."""
    try:
        return make_plan(problem, saved, solver="chain", reason="", proof=Proof.NEIGHBOURHOOD)
    except InvalidPlanError:
        return None


def _repair(
    problem: Problem,
    choice: list[int],
    target: int,
    options_of: Sequence[Sequence[Option]],
    stitch: Callable[[Sequence[int]], frozenset[str]],
    deadline: float,
    costs: Sequence[ChainCosts],
) -> tuple[Plan, list[int]] | None:
    """The cheapest plan that fits among those moving one block of ``choice`` to an option
    that keeps less (by ``costs``), or None if none fits in time. Moves are simulated in
    order of the time they add, so the first that fits is the cheapest."""
    moves = sorted(
        (options[o].time_s - options[choice[k]].time_s, k, o)
        for k, options in enumerate(options_of)
        for o in range(len(options))
        if _keep(costs, o, k) < _keep(costs, choice[k], k)
    )
    for _, k, o in moves:
        if clock.now() > deadline:
            return None
        trial = [*choice[:k], o, *choice[k + 1 :]]
        plan = stitched_plan(problem, stitch(trial))
        if plan is not None and plan.predicted_peak_bytes <= target:
            return plan, trial
    return None


def _keep(costs: Sequence[ChainCosts], o: int, k: int) -> int:
    """Block ``k``'s keep under option ``o`` (a class with fewer options uses its last)."""
    return costs[min(o, len(costs) - 1)].keep[k]


def local_search(
    problem: Problem,
    plan: Plan,
    choice: list[int],
    target: int,
    options_of: Sequence[Sequence[Option]],
    stitch: Callable[[Sequence[int]], frozenset[str]],
    deadline: float,
    costs: Sequence[ChainCosts] | None = None,
) -> tuple[Plan, list[int]]:
    """Move single blocks to cheaper options while the simulated plan still fits (the DP's
    additive model is conservative at block boundaries; the simulator is exact). Moves are
    tried largest saving first; with ``costs``, only those whose extra bytes kept (in the
    uniform plans' context) fit in what the plan leaves of the budget, since every block's
    keep is live at the step's last forward moment. Why: each try simulates the whole step
    (a quarter second at 70B), and most moves of a plan found under the budget cannot fit."""
    choice = list(choice)
    improved = True
    while improved and clock.now() < deadline:
        improved = False
        slack = target - plan.predicted_peak_bytes
        moves = []
        for k, options in enumerate(options_of):
            current = options[choice[k]].time_s
            for o in range(len(options)):
                if options[o].time_s >= current:
                    continue
                if costs is not None and _keep(costs, o, k) - _keep(costs, choice[k], k) > slack:
                    continue
                moves.append((options[o].time_s - current, k, o))
        for _, k, o in sorted(moves):
            if clock.now() > deadline:
                return plan, choice
            trial = [*choice[:k], o, *choice[k + 1 :]]
            candidate = stitched_plan(problem, stitch(trial))
            if (
                candidate is not None
                and candidate.predicted_peak_bytes <= target
                and candidate.recompute_time_s < plan.recompute_time_s
            ):
                plan, choice, improved = candidate, trial, True
                break
    return plan, choice


def refine(
    problem: Problem,
    structure: Structure,
    menus: dict[tuple[int, ...], list[Option]],
    plan: Plan,
    target: int,
    config: SolverConfig,
    deadline: float,
) -> tuple[Plan, int]:
    """Large-neighbourhood search with the exact MILP in context (when the whole problem is
    small enough to model): a window of values is re-solved exactly while the rest of the plan
    stays as it is. Each solve is warm-started from the current plan, so the plan never gets
    worse. Returns the plan and the windows attempted.

    Why: the menus are Pareto-optimal for a block cut out alone, and the DP's model is additive;
    the optimum of the whole chain differs from the stitched plan by a few values per block,
    and what it gains in one block it often spends in another. Windows, in order:

    * **every block at once, near its menu option** (:func:`_menu_window`): the values whose
      choice differs between the block's option and its ``MENU_WINDOW`` neighbours on the menu,
      in every block, with everything outside the blocks. This is the window that moves memory
      between blocks: on a 4-layer Llama it found in 5 s the plan the flat MILP found in 60 s
      (3.1% cheaper than the stitched plan, recomputing more of the last block and the head so
      that the first blocks recompute less), which no window of one or two blocks found;
    * the first block with everything outside the blocks, the last likewise;
    * adjacent pairs of blocks.
    """
    if (
        plan.recompute_time_s == 0
        or len(compress(problem).problem.forward_names) > config.max_milp_values
    ):
        return plan, 0
    blocks = [set(b.forward) for b in structure.blocks]
    outside = set(problem.forward_names).difference(*blocks)

    def all_blocks(current: Plan) -> set[str]:
        return _menu_window(structure, menus, set(current.schedule.saved), MENU_WINDOW) | outside

    windows: list[Callable[[Plan], set[str]] | set[str]] = [
        all_blocks,
        outside | blocks[0],
        outside | blocks[-1],
        *(blocks[k] | blocks[k + 1] for k in range(len(blocks) - 1)),
    ]
    solved = 0
    took = 1.0  # the last window's work: a window may overrun its limit (model building)
    for window in windows:
        start = clock.now()
        left = deadline - start
        if left < took:
            break
        if config.progress:
            config.progress(f"chain: exact MILP on window {solved + 1} of {len(windows)}")
        # The all-blocks window is the largest: it may not starve the smaller ones after it.
        window_config = dataclasses.replace(
            config, time_limit_s=left / 2 if window is all_blocks else left
        )
        with contextlib.suppress(RuntimeError, BudgetError):
            found = exact(
                problem,
                budget_bytes=target,
                config=window_config,
                start=plan,
                free=window(plan) if callable(window) else window,
            )
            if (
                found.predicted_peak_bytes <= target
                and found.recompute_time_s < plan.recompute_time_s
            ):
                plan = found
        solved += 1
        took = clock.now() - start
    return plan, solved


def _menu_window(
    structure: Structure,
    menus: dict[tuple[int, ...], list[Option]],
    saved: set[str],
    width: int,
) -> set[str]:
    """The values of every block whose choice is in play near the block's place on its menu:
    those on which the menu option nearest the block's saved set and the ``width`` options
    either side of it (by recompute time) disagree, or on which the block differs from that
    option."""
    free: set[str] = set()
    for cls in structure.classes:
        menu = menus[cls]  # cheapest first: of options equally near the block, the cheapest
        positions = set(structure.blocks[cls[0]].forward)
        for k in cls:
            to_block = structure.correspondence(cls[0], k)
            here = {n for n, m in to_block.items() if m in saved} & positions
            i = min(range(len(menu)), key=lambda j: len(menu[j].saved ^ here))
            near = [set(o.saved) for o in menu[max(0, i - width) : i + width + 1]] + [here]
            free |= {to_block[n] for n in set().union(*near) - near[0].intersection(*near)}
    return free
