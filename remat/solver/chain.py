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

This module holds the menus, the costs, the seams and the bounds, and puts the steps
together; the searches of steps 5 and 7 are in :mod:`remat.solver.chain_search`.
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
from remat.solver.chain_dp import ChainCosts, ChainCostsBuilder
from remat.solver.chain_search import DP_ROUNDS as DP_ROUNDS  # re-exported
from remat.solver.chain_search import MENU_WINDOW as MENU_WINDOW  # re-exported
from remat.solver.chain_search import local_search, refine, search, stitched_plan
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import must_save
from remat.solver.menus import (
    Option,
    cached_menu,
)
from remat.solver.plan import Plan, Proof, make_plan, proven
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
BOUND_S = 10.0
BOUND_SHARE = 0.1
"""The lower bound (:mod:`remat.solver.bound`) gets this share of the time limit, at most
``BOUND_S`` seconds."""


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


@dataclass(frozen=True)
class _Outcome:
    """What the chain solver's reason reports of its plan (:func:`_reason`), gathered from
    the stages that found, refined and bounded it."""

    plan: Plan
    """The plan returned: stitched, then refined."""
    stitched_s: float
    """Its recompute time before the refinement."""
    windows: int
    """Refinement windows attempted (:func:`~remat.solver.chain_search.refine`)."""
    dropped: frozenset[str]
    """Values outside the blocks the stitched plans do not save (:func:`_outside_drops`)."""
    bound: float | None
    """The lower bound on recompute time, at most the plan's; None where none was taken."""
    floor: str
    """Which bound it is: the backward's moments', or the blocks' fronts'."""


@clock.counted
def chain_solver(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    """Least recompute time for a chain of blocks (see the module docstring)."""
    t0 = time.perf_counter()
    c0 = clock.now()
    menu = chain_menu(problem, config)
    costs = [_costs(problem, menu.structure, p.schedule.saved, p.simulation) for p in menu.uniform]
    if config.progress:
        blocks = len(menu.structure.blocks)
        config.progress(f"chain: DP over {blocks} blocks x {len(menu.uniform)} options")

    # No budget: the least peak the chain reaches.
    least = min(p.predicted_peak_bytes for p in menu.uniform)
    target = least if budget_bytes is None else budget_bytes
    deadline = c0 + config.time_limit_s
    best, dropped = _stitched_best(problem, menu, costs, target, deadline, config)
    if best is None:
        raise BudgetError(target, least, "the least peak of the chain solver's uniform plans")
    stitched_s = best.recompute_time_s
    bound = _backward_bound(problem, budget_bytes, best, config)
    best, windows = refine(
        problem, menu.structure, menu.menus, best, target, config, c0 + config.time_limit_s
    )
    bound, floor = _fronts_bound(problem, target, menu.structure, best, bound, config)
    if bound is not None:
        bound = min(bound, best.recompute_time_s)  # solver tolerances
    outcome = _Outcome(best, stitched_s, windows, dropped, bound, floor)
    plan = dataclasses.replace(
        best,
        solver="chain",
        reason=_reason(menu, outcome, t0),
        proof=Proof.NEIGHBOURHOOD,
        lower_bound_s=bound,
    )
    return dataclasses.replace(plan, proof=proven(plan))


def _stitched_best(
    problem: Problem,
    menu: ChainMenu,
    costs: list[ChainCosts],
    target: int,
    deadline: float,
    config: SolverConfig,
) -> tuple[Plan | None, frozenset[str]]:
    """Steps 4 to 6 of the module docstring: the cheapest stitched plan that fits ``target``
    (None where none does) of the search without seams, then with them, and of the uniform
    plans; and the values outside the blocks that the plans without seams no longer save
    (for the reason: those that the plan recomputes)."""
    plain = partial(menu.stitch, seams=NONE)
    found = search(problem, costs, target, menu.options_of, plain, deadline, config, polish=False)
    best, best_choice = found if found is not None else (None, [])
    seamed: tuple[Plan, list[int]] | None = None
    dropped = NOTHING
    if menu.seams and best is not None and best.recompute_time_s > 0:
        if config.progress:
            config.progress("chain: seams (recomputation across block boundaries)")
        dropped = _outside_drops(problem, menu, best, best_choice)
        plain = partial(menu.stitch, seams=NONE, dropped=dropped)
        # The search with seams first: where a run of them lowers the peak it frees
        # gigabytes at 7B-70B, more than the local search without them finds (Llama-70B at
        # 80 GB: 306 ms of recompute without, 266 ms with); the latter gets what is left.
        seamed = _seamed(problem, menu, best, best_choice, dropped, target, deadline, config)
    if best is not None:
        start = stitched_plan(problem, plain(best_choice))
        if start is None or start.predicted_peak_bytes > target:  # the drops lowered its peak
            start = best
        best, best_choice = local_search(
            problem, start, best_choice, target, menu.options_of, plain, deadline
        )
    if seamed is not None and (best is None or seamed[0].recompute_time_s < best.recompute_time_s):
        best, best_choice = seamed
    # The uniform plans are candidates too (the DP's model could have ruled one out wrongly).
    for p in menu.uniform:
        if p.predicted_peak_bytes <= target and (
            best is None or p.recompute_time_s < best.recompute_time_s
        ):
            best = p
    return best, dropped


def _backward_bound(
    problem: Problem, budget_bytes: int | None, plan: Plan, config: SolverConfig
) -> float | None:
    """Step 8's bound at the backward's moments (:func:`remat.solver.bound.backward_bound`),
    with a share of the time limit; None without a budget, for a plan that recomputes
    nothing, or where HiGHS fails."""
    if budget_bytes is not None and plan.recompute_time_s > 0:
        # Cheap at any size (no time index), and any dual bound HiGHS proves in its time is
        # valid; taken before the refinement, which uses all the time left.
        share = min(BOUND_S, max(1.0, BOUND_SHARE * config.time_limit_s))
        with contextlib.suppress(pulp.PulpSolverError):
            return backward_bound(
                problem, budget_bytes, dataclasses.replace(config, time_limit_s=share)
            )
    return None


def _fronts_bound(
    problem: Problem,
    target: int,
    structure: Structure,
    plan: Plan,
    bound: float | None,
    config: SolverConfig,
) -> tuple[float | None, str]:
    """Step 8's bound, and which it is: with ``SolverConfig.floor_time_s``, the blocks'
    fronts' (:func:`remat.solver.block_bound.block_bound`) where it is tighter than
    ``bound`` and at most ``plan``'s recompute time; otherwise ``bound``."""
    floor = "at the backward's moments"
    if bound is not None and config.floor_time_s and plan.recompute_time_s > bound:
        with contextlib.suppress(pulp.PulpSolverError):
            fronts = block_bound(
                problem,
                target,
                dataclasses.replace(config, time_limit_s=config.floor_time_s),
                structure=structure,
            )
            # Above a plan that fits, a floor is wrong (beyond the solver's tolerance): kept
            # out rather than clipped, so a bug cannot pass for a proof of optimality.
            if fronts is not None and bound < fronts <= plan.recompute_time_s * (1 + 1e-6):
                bound, floor = fronts, "from the blocks' fronts"
    return bound, floor


def _reason(menu: ChainMenu, outcome: _Outcome, t0: float) -> str:
    """The plan's reason: the chain's blocks and menus, what the refinement gained, what
    recomputation crosses block boundaries, the bound, and the seconds since ``t0``."""
    structure, best = menu.structure, outcome.plan
    sizes = ", ".join(f"{len(menu.menus[c])}" for c in structure.classes)
    reason = (
        f"chain DP over {len(structure.blocks)} blocks in {len(structure.classes)} class(es) "
        f"({sizes} options from the per-block exact MILP)"
        + (
            f", refined in {outcome.windows} window(s) by the exact MILP "
            f"({outcome.stitched_s * 1e3:.4g} -> {best.recompute_time_s * 1e3:.4g} ms)"
            if outcome.windows
            else ""
        )
    )
    again = set(best.recomputed)
    crossed = sum(name in again for name in menu.seams.values())
    if crossed:
        reason += f", {crossed} block output(s) recomputed across a block boundary"
    if outcome.dropped & again:
        reason += f", {len(outcome.dropped & again)} value(s) outside the blocks recomputed"
    if outcome.bound is not None:
        reason += f", lower bound {outcome.bound * 1e3:.4g} ms ({outcome.floor})"
    reason += f", {time.perf_counter() - t0:.1f} s"
    return reason


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
        p = stitched_plan(problem, menu.stitch(choice, NONE, trial))
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
        p = stitched_plan(problem, menu.stitch(choice, seams, dropped))
        if p is not None:
            tried.append((p.predicted_peak_bytes, p.recompute_time_s, sorted(seams), seams))
    if not tried or min(tried)[0] >= plan.predicted_peak_bytes:
        return None
    *_, seams = min(tried)
    n = len(menu.options_of)
    costs = []
    for o in range(len(menu.uniform)):
        u = stitched_plan(problem, menu.stitch([o] * n, seams, dropped))
        if u is None:
            return None
        costs.append(_costs(problem, menu.structure, u.schedule.saved, u.simulation))

    def stitch(c: Sequence[int]) -> frozenset[str]:
        return menu.stitch(c, seams, dropped)

    return search(problem, costs, target, menu.options_of, stitch, deadline, config)


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
