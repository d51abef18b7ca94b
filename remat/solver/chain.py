"""Hierarchical planning for chains of identical blocks: per-block menus and a DP over the chain.

A 7B-70B transformer's joint graph has tens of thousands of values: too many for the flat MILP,
and the heuristics leave time on the table. But it is a chain of identical blocks, so:

1. :func:`remat.solver.structure.find_structure` finds the blocks and their classes of
   identical structure.
2. **Menus.** One representative block per class is cut out as a problem of its own and solved
   with the exact MILP: walking down the Pareto front of (bytes the block keeps for the
   backward, recompute time) from keep-all, each solve asking for less than the last plan
   kept; then at a few budgets on its own backward peak; plus keep-only-what-must-be-kept;
   plus points of its front (the best plans of recompute plus a price per byte kept), both of
   the block alone and of the block as the backward's first moments see it
   (:func:`remat.solver.fronts.kept_problem`).
   Each distinct plan is an *option*, mapped onto every block of the class by position.
3. **Costs in context.** Each option is applied to every block at once and the whole step is
   simulated. From that timeline, per block: the bytes its saved values hold for the backward
   (``keep``), and its forward and backward peaks minus the bytes the earlier blocks keep
   (``fw_base``, ``bw_base``): what the block needs on top of what its predecessors hold.
4. **DP.** Blocks are taken in forward order; the state is the bytes the blocks so far keep
   (on a grid, rounded up); choosing option ``o`` for block ``i`` is allowed when
   ``held + fw_base[o][i]`` and ``held + bw_base[o][i]`` fit the budget, and the tail (head and
   loss, then the first backward ops) fits with everything kept. The least total recompute time
   wins. Exact for this decomposition and this additive model.
5. **The simulator has the last word.** The stitched plan is simulated; if its peak is over the
   budget (the additive model is an approximation at block boundaries), the DP is solved again
   for a budget smaller by the excess, then bisected between the DP budgets that fit and that
   did not (the model is conservative at some moments, the first plan that fits may leave
   memory unused). Then a local search moves single blocks to cheaper options while the
   simulated plan still fits.
6. **Seams** (remat's own executor): the search again with runs of block boundaries whose
   output is recomputed from the nearest kept one before it, each block saving a cheaper
   replacement for its output (:mod:`remat.solver.seams`), and without the values outside
   the blocks that cost less per byte to recompute than the chain trades on average; the
   cheaper of the plans with and without seams wins.
7. **Refinement in context** (when the whole problem is small enough for the flat MILP's model,
   ``SolverConfig.max_milp_values``): windows of values (first, every block's values near its
   menu option at once; then the first block with everything outside the blocks, the last
   likewise, then adjacent pairs) are re-solved by the exact MILP with the rest of the plan
   fixed, while time remains, to recover what the decomposition misses where blocks meet each
   other and the embeddings and head, and memory one block can give another.

8. **A lower bound** at any size: :func:`remat.solver.bound.backward_bound` (the backward's
   start and its ops' moments, one binary per value, no time index), recorded as the plan's
   ``lower_bound_s``; with ``SolverConfig.floor_time_s``, also the tighter one from the
   blocks' exact fronts (:mod:`remat.solver.block_bound`), the larger of the two.

Outside seams, values outside the blocks (embeddings, head, loss) keep what their backward
reads, and every block's inputs are saved when its recomputation needs them, so recomputation
does not cross a block boundary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import pulp

from remat.problem import Problem, Role
from remat.solver import clock
from remat.solver.block_bound import block_bound
from remat.solver.bound import backward_bound
from remat.solver.chain_dp import (
    GRID,
    ChainCosts,
    ChainCostsBuilder,
    chain_dp,
)
from remat.solver.compress import compress
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import must_save
from remat.solver.menus import (
    Option,
    cached_menu,
)
from remat.solver.milp import exact
from remat.solver.plan import Plan, Proof, make_plan, proven
from remat.solver.schedule import InvalidPlanError
from remat.solver.seams import (
    Swap,
    apply_seams,
    boundaries,
    find_swap,
    outside_candidates,
    patterns,
)
from remat.solver.simulate import Simulation
from remat.solver.structure import Structure, block_problem, find_structure

NONE: frozenset[int] = frozenset()
"""No seams."""
NOTHING: frozenset[str] = frozenset()
"""No value outside the blocks dropped."""
DP_ROUNDS = 24
"""DP solves, each for a smaller budget, until the simulated plan fits."""
BOUND_S = 10.0
BOUND_SHARE = 0.1
"""The lower bound (:mod:`remat.solver.bound`) gets this share of the time limit, at most
``BOUND_S`` seconds."""
MENU_WINDOW = 2
"""The all-blocks refinement window frees what a block's menu neighbours this far on either
side disagree on (on a 4-layer Llama, 2 found the flat MILP's best plan; 5 and 10 found the
same, in more time)."""


class Stitch(Protocol):
    """A choice of one option per block (and seams, and values dropped outside the blocks)
    to a saved set: :attr:`ChainMenu.stitch`."""

    def __call__(
        self, choice: Sequence[int], seams: frozenset[int] = ..., dropped: frozenset[str] = ...
    ) -> frozenset[str]: ...


@dataclass(frozen=True)
class ChainMenu:
    """The chain's blocks, each class's menu of options, and the uniform plans (option ``o``
    on every block, a class with fewer options using its last): eager to recompute-all."""

    structure: Structure
    menus: dict[tuple[int, ...], list[Option]]
    options_of: list[list[Option]]
    stitch: Stitch
    """``stitch(choice, seams, dropped)``: the saved set of one option per block, with seams
    at the given boundaries (:mod:`remat.solver.seams`; a block whose option has no swap
    keeps its output) and without the values ``dropped`` outside the blocks."""
    uniform: list[Plan]
    seams: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """Boundaries (block ``k`` to ``k + 1``) that may be seams, and block ``k``'s output
    there (:func:`remat.solver.seams.boundaries`)."""


@clock.counted
def chain_menu(problem: Problem, config: SolverConfig) -> ChainMenu:
    """Solve one block per class for its menu (cached) and stitch the uniform plans."""
    structure = find_structure(problem, config.block_types)
    if not structure.repeated:
        raise ValueError(
            "the chain solver needs repeated blocks (identical children of a ModuleList); "
            "none found: use a flat solver"
        )
    blocks = structure.blocks
    if config.progress:
        config.progress(f"chain: {len(blocks)} blocks; solving one block per class for a menu")
    menus = {c: cached_menu(problem, structure, c, config) for c in structure.classes}
    fixed = _outside_saved(problem, structure)
    options_of = [menus[next(c for c in structure.classes if k in c)] for k in range(len(blocks))]
    maps = {k: structure.correspondence(c[0], k) for c in structure.classes for k in c}

    outputs = boundaries(problem, structure)
    swap_of = _swaps(problem, structure, outputs, options_of, maps)

    def stitch(
        choice: Sequence[int], seams: frozenset[int] = NONE, dropped: frozenset[str] = NOTHING
    ) -> frozenset[str]:
        saved = set(fixed - dropped)
        picked = [min(o, len(options_of[k]) - 1) for k, o in enumerate(choice)]
        for k, o in enumerate(picked):
            saved |= {maps[k][n] for n in options_of[k][o].saved}
        return apply_seams(saved, outputs, {k: swap_of(k, picked[k]) for k in seams})

    n_opts = max(len(m) for m in menus.values())
    uniform = [
        make_plan(
            problem, stitch([o] * len(blocks)), solver="chain", reason="", proof=Proof.NEIGHBOURHOOD
        )
        for o in range(n_opts)
    ]
    return ChainMenu(structure, menus, options_of, stitch, uniform, outputs)


def _swaps(
    problem: Problem,
    structure: Structure,
    outputs: dict[int, str],
    options_of: list[list[Option]],
    maps: dict[int, dict[str, str]],
) -> Callable[[int, int], Swap | None]:
    """Block ``k``'s swap under its option ``o``, in block ``k``'s names: found once per
    class, option and output position in the class's representative block."""
    rep = {k: c[0] for c in structure.classes for k in c}
    back = {k: {b: a for a, b in maps[k].items()} for k in outputs}
    subs: dict[int, Problem] = {}
    found: dict[tuple[int, int, str], Swap | None] = {}

    def swap_of(k: int, o: int) -> Swap | None:
        r = rep[k]
        name = back[k].get(outputs[k])
        if name is None:
            return None
        key = (r, o, name)
        if key not in found:
            if r not in subs:
                subs[r] = block_problem(problem, structure.blocks[r])
            found[key] = find_swap(subs[r], name, options_of[k][o].saved)
        sw = found[key]
        if sw is None:
            return None
        return dataclasses.replace(sw, saved=frozenset(maps[k][n] for n in sw.saved))

    return swap_of


@clock.counted
def chain_solver(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    """Least recompute time for a chain of blocks (see the module docstring)."""
    t0 = time.perf_counter()
    c0 = clock.now()
    menu = chain_menu(problem, config)
    structure, menus, options_of, stitch, uniform = (
        menu.structure, menu.menus, menu.options_of, menu.stitch, menu.uniform
    )  # fmt: skip
    blocks = structure.blocks
    n_opts = len(uniform)
    costs = [_costs(problem, structure, p.schedule.saved, p.simulation) for p in uniform]
    if config.progress:
        config.progress(f"chain: DP over {len(blocks)} blocks x {n_opts} options")

    # No budget: the least peak the chain reaches.
    least = min(p.predicted_peak_bytes for p in uniform)
    target = least if budget_bytes is None else budget_bytes
    deadline = c0 + config.time_limit_s
    plain = partial(stitch, seams=NONE)
    found = _search(problem, costs, target, options_of, plain, deadline, config, polish=False)
    best, best_choice = found if found is not None else (None, [])
    seamed: tuple[Plan, list[int]] | None = None
    dropped = NOTHING
    if menu.seams and best is not None and best.recompute_time_s > 0:
        if config.progress:
            config.progress("chain: seams (recomputation across block boundaries)")
        dropped = _outside_drops(problem, menu, best, best_choice)
        plain = partial(stitch, seams=NONE, dropped=dropped)
        # The search with seams first: where a run of them lowers the peak it frees
        # gigabytes at 7B-70B, more than the local search without them finds (Llama-70B at
        # 80 GB: 306 ms of recompute without, 266 ms with); the latter gets what is left.
        seamed = _seamed(problem, menu, best, best_choice, dropped, target, deadline, config)
    if best is not None:
        start = _stitched(problem, plain(best_choice))
        if start is None or start.predicted_peak_bytes > target:  # the drops lowered its peak
            start = best
        best, best_choice = _local_search(
            problem, start, best_choice, target, options_of, plain, deadline
        )
    if seamed is not None and (best is None or seamed[0].recompute_time_s < best.recompute_time_s):
        best, best_choice = seamed
    # The uniform plans are candidates too (the DP's model could have ruled one out wrongly).
    for p in uniform:
        if p.predicted_peak_bytes <= target and (
            best is None or p.recompute_time_s < best.recompute_time_s
        ):
            best = p
    if best is None:
        raise BudgetError(target, least, "the least peak of the chain solver's uniform plans")
    stitched = best.recompute_time_s
    bound = None
    if budget_bytes is not None and best.recompute_time_s > 0:
        # Cheap at any size (no time index), and any dual bound HiGHS proves in its time is
        # valid; taken before the refinement, which uses all the time left.
        share = min(BOUND_S, max(1.0, BOUND_SHARE * config.time_limit_s))
        with contextlib.suppress(pulp.PulpSolverError):
            bound = backward_bound(
                problem, budget_bytes, dataclasses.replace(config, time_limit_s=share)
            )
    best, windows = _refine(
        problem, structure, menus, best, target, config, c0 + config.time_limit_s
    )
    floor = "at the backward's moments"
    if bound is not None and config.floor_time_s and best.recompute_time_s > bound:
        with contextlib.suppress(pulp.PulpSolverError):
            fronts = block_bound(
                problem,
                target,
                dataclasses.replace(config, time_limit_s=config.floor_time_s),
                structure=structure,
            )
            # Above a plan that fits, a floor is wrong (beyond the solver's tolerance): kept
            # out rather than clipped, so a bug cannot pass for a proof of optimality.
            if fronts is not None and bound < fronts <= best.recompute_time_s * (1 + 1e-6):
                bound, floor = fronts, "from the blocks' fronts"
    sizes = ", ".join(f"{len(menus[c])}" for c in structure.classes)
    reason = (
        f"chain DP over {len(blocks)} blocks in {len(structure.classes)} class(es) "
        f"({sizes} options from the per-block exact MILP)"
        + (
            f", refined in {windows} window(s) by the exact MILP "
            f"({stitched * 1e3:.4g} -> {best.recompute_time_s * 1e3:.4g} ms)"
            if windows
            else ""
        )
    )
    again = set(best.recomputed)
    crossed = sum(name in again for name in menu.seams.values())
    if crossed:
        reason += f", {crossed} block output(s) recomputed across a block boundary"
    if dropped & again:
        reason += f", {len(dropped & again)} value(s) outside the blocks recomputed"
    if bound is not None:
        bound = min(bound, best.recompute_time_s)  # solver tolerances
        reason += f", lower bound {bound * 1e3:.4g} ms ({floor})"
    reason += f", {time.perf_counter() - t0:.1f} s"
    plan = dataclasses.replace(
        best, solver="chain", reason=reason, proof=Proof.NEIGHBOURHOOD, lower_bound_s=bound
    )
    return dataclasses.replace(plan, proof=proven(plan))


def _search(
    problem: Problem,
    costs: list[ChainCosts],
    target: int,
    options_of: Sequence[Sequence[Option]],
    stitch: Callable[[Sequence[int]], frozenset[str]],
    deadline: float,
    config: SolverConfig,
    polish: bool = True,
) -> tuple[Plan, list[int]] | None:
    """Steps 4 and 5 of the module docstring: the DP, solved again for less while the
    simulated plan is over ``target`` and then, between the budgets that fit and that did
    not, for more while it fits (the DP's model is conservative at some moments, so the
    first plan that fits may leave memory unused); a one-block repair; then (``polish``) the
    local search."""
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
            plan = _stitched(problem, stitch(found))
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
    return _local_search(problem, best, best_choice, target, options_of, stitch, deadline, costs)


def _stitched(problem: Problem, saved: frozenset[str]) -> Plan | None:
    """A stitched saved set's plan, or None where the executor cannot run it (a seam's or a
    dropped value's recomputation that would need a random op: the candidates exclude it,
    so this is a guard, not a path)."""
    try:
        return make_plan(problem, saved, solver="chain", reason="", proof=Proof.NEIGHBOURHOOD)
    except InvalidPlanError:
        return None


def _outside_drops(
    problem: Problem, menu: ChainMenu, plan: Plan, choice: list[int]
) -> frozenset[str]:
    """Values outside the blocks that ``plan`` need not save (see
    :func:`remat.solver.seams.outside_candidates`): each, cheapest per byte first, while it
    costs less per byte than the chain's uniform plans trade on average (recompute-most
    against keep-all) and dropping it lowers the simulated peak."""
    keep_all, most = menu.uniform[0], menu.uniform[-1]
    freed = keep_all.saved_bytes - most.saved_bytes
    if freed <= 0:
        return NOTHING
    slope = (most.recompute_time_s - keep_all.recompute_time_s) / freed
    inside = {n for b in menu.structure.blocks for n in (*b.forward, *b.backward)}
    dropped: set[str] = set()
    peak = plan.predicted_peak_bytes
    found = outside_candidates(problem, inside, plan.schedule.saved, plan.recomputed)
    for rate, name in found:
        if rate > slope:
            break
        trial = frozenset(dropped | {name})
        p = _stitched(problem, menu.stitch(choice, NONE, trial))
        if p is not None and p.predicted_peak_bytes < peak:
            dropped, peak = set(trial), p.predicted_peak_bytes
    return frozenset(dropped)


def _seamed(
    problem: Problem,
    menu: ChainMenu,
    plan: Plan,
    choice: list[int],
    dropped: frozenset[str],
    target: int,
    deadline: float,
    config: SolverConfig,
) -> tuple[Plan, list[int]] | None:
    """The chain's search again with seams (:mod:`remat.solver.seams`) and without the
    values ``dropped`` outside the blocks: of the runs of
    :func:`~remat.solver.seams.patterns`, the one whose seams lower ``plan``'s simulated peak
    most; then every option's uniform plan with those seams, for the costs in context, and
    the DP and local search on them. None where no run lowers the peak."""
    tried = []
    for seams in patterns(menu.seams):
        p = _stitched(problem, menu.stitch(choice, seams, dropped))
        if p is not None:
            tried.append((p.predicted_peak_bytes, p.recompute_time_s, sorted(seams), seams))
    if not tried or min(tried)[0] >= plan.predicted_peak_bytes:
        return None
    *_, seams = min(tried)
    n = len(menu.options_of)
    costs = []
    for o in range(len(menu.uniform)):
        u = _stitched(problem, menu.stitch([o] * n, seams, dropped))
        if u is None:
            return None
        costs.append(_costs(problem, menu.structure, u.schedule.saved, u.simulation))

    def stitch(c: Sequence[int]) -> frozenset[str]:
        return menu.stitch(c, seams, dropped)

    return _search(problem, costs, target, menu.options_of, stitch, deadline, config)


def _refine(
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
        plan = _stitched(problem, stitch(trial))
        if plan is not None and plan.predicted_peak_bytes <= target:
            return plan, trial
    return None


def _keep(costs: Sequence[ChainCosts], o: int, k: int) -> int:
    """Block ``k``'s keep under option ``o`` (a class with fewer options uses its last)."""
    return costs[min(o, len(costs) - 1)].keep[k]


def _local_search(
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
            candidate = _stitched(problem, stitch(trial))
            if (
                candidate is not None
                and candidate.predicted_peak_bytes <= target
                and candidate.recompute_time_s < plan.recompute_time_s
            ):
                plan, choice, improved = candidate, trial, True
                break
    return plan, choice


def _outside_saved(problem: Problem, structure: Structure) -> frozenset[str]:
    """What every stitched plan saves: random values, forward values outside the blocks that
    the backward reads, block values that backward ops outside the blocks read, and every
    block's inputs from outside (kept only if its recomputation reads them)."""
    values = problem.by_name
    in_block = {n for b in structure.blocks for n in (*b.forward, *b.backward)}
    saved = set(must_save(problem))
    for v in problem.values:
        if v.role is Role.BACKWARD and v.name not in in_block:
            saved |= {i for i in v.inputs if values[i].role is Role.FORWARD}
        elif v.role is Role.BACKWARD:
            saved |= {i for i in v.inputs if values[i].role is Role.FORWARD and i not in in_block}
    for b in structure.blocks:
        inside = set(b.forward)
        for n in b.forward:
            saved |= {
                i for i in values[n].inputs if values[i].role is Role.FORWARD and i not in inside
            }
    return frozenset(saved)


def _costs(
    problem: Problem, structure: Structure, saved: Sequence[str], sim: Simulation
) -> ChainCosts:
    """Per-block quantities of a uniform plan (see the module docstring, step 3)."""
    values = problem.by_name
    blocks = structure.blocks
    where: dict[str, int] = {}
    for k, b in enumerate(blocks):
        for n in (*b.forward, *b.backward):
            where[n] = k
    # Bytes each block's saved values hold (a storage counted once, for its first block).
    counted: set[str] = set()
    keep = [0] * len(blocks)
    for n in saved:
        owner = where.get(n)
        if owner is None:
            continue
        new = [s for s in values[n].storages if s not in counted]
        counted.update(new)
        keep[owner] += problem.storages_bytes(new)
    costs = ChainCostsBuilder(keep)
    current = -1
    seen_block = False
    # A recomputation runs for the backward op after it: at a seam, block k's output is
    # recomputed for block k + 1's backward, whose moment it is.
    running = [-1] * len(sim.timeline)
    nxt = -1
    for i in range(len(sim.timeline) - 1, -1, -1):
        step = sim.timeline[i]
        if step.phase == "backward" and not step.recompute:
            nxt = where.get(step.name, -1)
        running[i] = nxt
    for i, step in enumerate(sim.timeline):
        k = where.get(step.name, -1)
        if step.phase == "forward":
            if k >= 0:
                current, seen_block = k, True
            costs.add("forward", k, step.allocated_bytes, before_regions=not seen_block)
            continue
        if step.recompute and running[i] >= 0:
            k = running[i]
        if k >= 0:
            current = k
        elif step.phase != "runtime":
            k = current  # a backward step of no block's: the block whose backward runs
        costs.add("backward", k, step.allocated_bytes)
    rec = {s.name for s in sim.timeline if s.recompute}
    for k, b in enumerate(blocks):
        costs.recompute(k, sum(values[n].time_s for n in (*b.forward,) if n in rec))
    return costs.costs()
