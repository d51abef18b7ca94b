"""A floor from the blocks' exact fronts: the backward's first moments as a knapsack.

:func:`remat.solver.bound.backward_bound` gives each forward value a binary and no time index,
so it cannot see what a recomputation holds while it runs, nor that a value saved only to
recompute another is held until then: on a 7B Llama it lets the residual stream be recomputed
from nothing at the loss, and stays 1.2x below the chain solver's plan. But before the
backward reaches the first block (the loss, the head: the *head moments*), every block holds
what it kept, and what a block keeps against what it recomputes is a trade-off inside the
block alone: its front (:mod:`remat.solver.fronts`). So every plan that fits ``B`` satisfies,
at each head moment ``t``,

    bytes(live at t whatever the plan) + bytes(values outside the blocks saved, needed after t)
        + sum over blocks of bytes(what the block keeps) <= B,

and at the backward's start the same with every saved value outside the blocks; and each
block recomputes at least what its front says for what it keeps. The front enters as
tangents, lines below it (one MILP solve each, valid whether it is convex or not): every
class of identical blocks becomes its blocks' total kept bytes ``K`` and total recompute
``C >= n * g - w * K`` for each tangent ``(w, g)``. Values outside the blocks keep one binary
each, as in the moments bound. The MILP is small, and its dual bound holds for every plan.

One case needs care: a head moment's recomputation can reach into the blocks (the head
recomputes the logits from the last block's output, which, unsaved, is recomputed from that
block's values, and so on down the residual stream). A value a block saved only for that is
then freed before the moment, and what the block holds there is no longer what it kept. So
the MILP follows the head's own recomputation (what it has recomputed by each moment, a
closure over the outside values) and, from the first moment by which it has recomputed a value
read from a block, counts the blocks it may have reached by what they hold once their outputs
are recomputed: the front of :func:`~remat.solver.fronts.kept_problem`'s ``after`` variant.

The tangents' weights are bisected towards the one touching the front where the knapsack's
optimum keeps, round by round while the time lasts; each round's bound is valid.

**The last block's backward.** On GPT-2 small the step peaks in the last block's backward, not
at the head: every other block still holds what it kept, and the last block holds what its own
backward needs while it recomputes. So the last rounds (half of the time, and the last
round in any case) take the last block out of its class and write its exact model into the
knapsack (:mod:`remat.solver.milp`'s MILP of its :func:`~remat.solver.fronts.kept_problem`,
without its moment cuts, its forward or its first stage, which the head rows count: a
relaxation), and one more row: its peak over its backward, plus what the other blocks hold,
within the budget less what is live outside the blocks at every moment of that backward. The
other blocks hold what they kept, except where the last block's backward recomputes into them
(it reads the block before's output, and an unsaved one is recomputed from that block, and so
on down): a block reached so holds at least the lesser of what it kept and what it holds after
(the ``after`` front), and at each weight the lesser of the two tangents is a line below that
(their after-front tangents are solved at the tangents' weights). The bytes the block problem
holds longer than the step does (the gradient flowing in, the gradients it passes on, the
block before's output, freed once the last block's backward has read it) are given back to
the budget, so that the row never counts more than is live. At the head's moments the last
block holds what it kept, or, once the head's recomputation has reached into it (only if a
value the head reads from it is unsaved), at least what it holds after its first stage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import pulp

from remat.problem import Problem, Role
from remat.solver import clock
from remat.solver.backend import backend, best_bound, objective_scale
from remat.solver.bound import Moment, backward_moments, read_span
from remat.solver.compress import Compressed, compress
from remat.solver.config import SolverConfig
from remat.solver.fronts import (
    OUTSIDE_READS,
    KeptProblem,
    Tangent,
    kept_problem,
    outside_reads,
    tangent,
)
from remat.solver.milp_model import MilpModel
from remat.solver.structure import Structure, find_structure

ROUNDS = 8
"""Tangents per class at most: each is one solve of the block's MILP relaxation, and the
weights are bisected towards the one that touches the front where the knapsack keeps."""
POINT_S = 10.0
"""At most this long for one tangent."""
UNIT = 1e6
"""Bytes per unit of memory in the knapsack: in bytes, its rows' coefficients span ~1e-3 to
~1e10 and HiGHS reported an "optimal" solution far from it (a bound above a fitting plan)."""
MAX_CLASSES = 4
"""Beyond this many classes of blocks the fronts cost more than they give: no bound."""
TAIL_SHARE = 1 / 2
"""Of the time, what the rounds with the last block's backward get (module docstring): each
builds the block's exact model and solves a knapsack with its binaries."""
MATCHED = 3
"""The latest tangents a tail round matches with ``after`` tangents at their weights."""


@dataclasses.dataclass(frozen=True)
class _Knapsack:
    bound_s: float
    kept: tuple[float | None, ...]
    """Per class, the bytes one of its blocks keeps on average in the optimum (``None``:
    no block there), before the head's recomputation reaches into the blocks..."""
    kept_after: tuple[float | None, ...]
    """...and, of the blocks it reaches, after."""


def head_moments(problem: Problem, structure: Structure) -> list[int]:
    """The backward ops that run before any block's backward and before any backward op
    reads a block's forward value (their indices among the backward ops)."""
    backward = [v for v in problem.values if v.role is Role.BACKWARD]
    first_read, _ = read_span(problem, backward)
    index = {v.name: k for k, v in enumerate(backward)}
    starts = [index[n] for b in structure.blocks for n in b.backward]
    starts += [first_read[n] for b in structure.blocks for n in b.forward if n in first_read]
    return list(range(min(starts, default=0)))


@clock.counted
def block_bound(
    problem: Problem,
    budget_bytes: int,
    config: SolverConfig,
    *,
    structure: Structure | None = None,
    rounds: int = ROUNDS,
) -> float | None:
    """Seconds of recomputation every plan of ``problem`` (remat's executor) that fits
    ``budget_bytes`` needs at least, from its blocks' fronts, in ``config.time_limit_s``;
    ``None`` where the problem has no blocks, no head moment, too many classes, or the time
    was too short for any front."""
    if problem.executor != "graph":
        return None
    deadline = clock.now() + config.time_limit_s
    structure = structure or find_structure(problem)
    heads = head_moments(problem, structure)
    if not structure.blocks or not heads or len(structure.classes) > MAX_CLASSES:
        return None

    def per_solve() -> SolverConfig:
        left = deadline - clock.now()
        return dataclasses.replace(config, time_limit_s=max(1.0, min(POINT_S, left)))

    kps = []
    for c in structure.classes:
        kp = kept_problem(problem, structure.blocks[c[0]])
        assert kp is not None  # only the ``after`` variant can be missing
        kps.append(kp)
    fed = _read_from_blocks(problem, structure)
    reachable: list[bool] = []
    afters: list[KeptProblem | None] = []
    for c in structure.classes:
        # The head reaches a block through the values outside ones read. What a reached block
        # holds is its ``after`` front only if it is reached all at once (one such value: the
        # head's first recomputation of it reaches every block it ever reaches) and that value
        # is one the front recomputes (read by a backward op outside the block). Otherwise a
        # reached block counts for nothing once the head has reached into the blocks.
        mine = {structure.correspondence(k, c[0])[n] for k in c for n in fed
                if n in structure.blocks[k].forward}  # fmt: skip
        variant = kept_problem(problem, structure.blocks[c[0]], after=True)
        reads = set(variant.problem.by_name[OUTSIDE_READS].inputs) if variant else set()
        reachable.append(bool(mine))
        afters.append(variant if len(fed) == 1 and mine <= reads else None)
    moments = backward_moments(problem, at=heads)
    fronts = [
        _Front(kp, after, kp.slope(), can)
        for kp, after, can in zip(kps, afters, reachable, strict=True)
    ]
    best: float | None = None
    reached = [True] * len(fronts)  # whether the last knapsack has blocks the head reaches
    tail = _tail(problem, structure)
    share = 0.0 if tail is None else TAIL_SHARE
    tail_at = deadline - share * (deadline - clock.now())
    for r in range(rounds):
        late = tail is not None and (r == rounds - 1 or clock.now() >= tail_at)
        for front, after in zip(fronts, reached, strict=True):
            if clock.now() >= deadline:
                break
            front.extend(per_solve, after=after or not front.after_lines)
        if not all(f.lines for f in fronts):
            if clock.now() >= deadline:
                return best
            continue
        if late:  # half of what is left at most, so that the knapsack keeps time to solve
            stop = clock.now() + (deadline - clock.now()) / 2
            for front in fronts:
                front.match(per_solve, stop)
        last = (tail, tail.model()) if tail is not None and late else None
        left = max(1.0, (deadline if late else tail_at) - clock.now())
        found = _knapsack(problem, budget_bytes, structure, moments, fronts, config, left, last)
        if found is None:
            return best
        best = found.bound_s if best is None else max(best, found.bound_s)
        if config.progress:
            n = sum(len(f.lines) + len(f.after_lines) for f in fronts)
            where = " and the last block's backward" if late else ""
            config.progress(f"block bound: {best * 1e3:.4g} ms from {n} tangents{where}")
        if clock.now() >= deadline:
            return best
        for front, each, each_after in zip(fronts, found.kept, found.kept_after, strict=True):
            front.aim(each, each_after)
        reached = [each is not None for each in found.kept_after]
    return best


class _Front:
    """A class's tangents, before and after the head's recomputation reaches into the blocks
    (module docstring), and the weights of the next ones: bisected so that they touch the
    front where the knapsack's blocks keep."""

    def __init__(
        self, kp: KeptProblem, after: KeptProblem | None, weight: float, reachable: bool
    ) -> None:
        self.kp, self.after, self.reachable = kp, after, reachable
        self.lines: list[Tangent] = []
        self.after_lines: list[Tangent] = []
        self.weights = [weight, weight]
        self.brackets = [[0.0, math.inf], [0.0, math.inf]]
        self.matched: dict[float, Tangent] = {}
        """Tangents of the ``after`` front at the weights of :attr:`lines` (the tail's)."""

    def match(self, per_solve: Callable[[], SolverConfig], deadline: float) -> None:
        """The ``after`` front's tangents at the weights of the latest tangents (nearest where
        the knapsack keeps), while time lasts."""
        if self.after is None:
            return
        for t in self.lines[-MATCHED:]:
            if t.weight not in self.matched and clock.now() < deadline:
                line = tangent(self.after, t.weight, per_solve())
                if line is not None:
                    self.matched[t.weight] = line

    def extend(self, per_solve: Callable[[], SolverConfig], *, after: bool) -> None:
        """One more tangent at each weight (``after``: of the reached blocks too; their
        tangents cannot raise the bound while the knapsack reaches none)."""
        for j, (kp, lines) in enumerate(((self.kp, self.lines), (self.after, self.after_lines))):
            if kp is not None and (j == 0 or after):
                line = tangent(kp, self.weights[j], per_solve())
                if line is not None:
                    lines.append(line)

    def aim(self, each: float | None, each_after: float | None) -> None:
        """A tangent touching where a block keeps more than the knapsack's share weighs kept
        bytes too little: weigh them more next time (less where it touches below)."""
        for j, (lines, share) in enumerate(((self.lines, each), (self.after_lines, each_after))):
            if not lines or share is None:
                continue
            lo, hi = self.brackets[j]
            w = lines[-1].weight
            if lines[-1].kept > share:
                lo = max(lo, w)
            else:
                hi = min(hi, w)
            self.brackets[j] = [lo, hi]
            self.weights[j] = 2 * lo if math.isinf(hi) else (lo + hi) / 2 if lo else hi / 2


@dataclasses.dataclass(frozen=True)
class _Tail:
    """The tail knapsack's constants: the last block's problem and its rows' bytes."""

    kp: KeptProblem
    """The last block's :func:`kept_problem`..."""
    comp: Compressed
    """...compressed, as its model sees it."""
    fed: tuple[str, ...]
    """Its values that values outside the blocks read (the head's way in), as ``comp``
    names them: all saved, the head's recomputation never reaches into the block."""
    room: int
    """Bytes the tail row gives the block and the other blocks, less the budget: what is live
    outside the blocks at every moment of the block's backward, negated, plus what the block
    problem holds longer than the step does (the gradient flowing in, those passed on), plus
    what the block before the last keeps only for the last block's backward to read."""

    def model(self) -> MilpModel:
        """The block's exact model, into which a knapsack writes its rows: a relaxation,
        without its moment cuts, its forward (the other blocks hold more there than the tail
        row counts) and its first stage (the head's reads of the block, at the head's moments:
        the head rows count those, where the tail row would count the blocks as reached).
        One block's model builds in about a second: no deadline."""
        return MilpModel(
            self.comp.problem, None, self.comp.fold, forward_memory=False, memory_from=1
        )


def _tail(problem: Problem, structure: Structure) -> _Tail | None:
    """The last block's tail rows' constants; ``None`` if nothing outside the blocks reads it
    (no head whose moments come before its backward)."""
    last = structure.blocks[-1]
    kp = kept_problem(problem, last)
    assert kp is not None
    if OUTSIDE_READS not in kp.problem.by_name:
        return None
    values = problem.by_name
    sub = kp.problem
    grads = set(problem.grad_outputs)
    longer = {s for v in sub.values if v.role is Role.TANGENT for s in v.storages}
    longer |= {s for n in sub.grad_outputs if n not in grads for s in values[n].storages}
    inside = set(sub.storage_bytes)
    owned = {s for b in structure.blocks for n in b.forward for s in values[n].allocates}
    backward = [v for v in problem.values if v.role is Role.BACKWARD]
    index = {v.name: k for k, v in enumerate(backward)}
    ks = [index[n] for n in last.backward]
    during = min(
        problem.storages_bytes(m.fixed - inside - owned)
        for m in backward_moments(problem, at=range(min(ks), max(ks) + 1))
    )
    room = -during + sub.storages_bytes(s for s in longer if s in sub.storage_bytes)
    if len(structure.blocks) > 1:  # the block before: what the last block's backward reads
        before = structure.blocks[-2]
        read = set(outside_reads(problem, before))
        own = {s for n in before.forward if n not in read for s in values[n].storages}
        room += problem.storages_bytes({s for n in read for s in values[n].allocates} - own)
    comp = compress(sub)
    fed = _read_from_blocks(problem, structure)
    fed_here = tuple(comp.rep.get(f, f) for f in fed if f in sub.by_name)
    return _Tail(kp, comp, fed_here, room)


def _read_from_blocks(problem: Problem, structure: Structure) -> set[str]:
    """The blocks' forward values that forward values outside the blocks read."""
    values = problem.by_name
    in_block = {n for b in structure.blocks for n in b.forward}
    return {
        i
        for n in problem.forward_names
        if n not in in_block
        for i in values[n].inputs
        if i in in_block
    }


def _knapsack(
    problem: Problem,
    budget: int,
    structure: Structure,
    moments: Sequence[Moment],
    fronts: Sequence[_Front],
    config: SolverConfig,
    time_limit_s: float,
    tail: tuple[_Tail, MilpModel] | None = None,
) -> _Knapsack | None:
    """The MILP of the module docstring (``tail``: with the last block's model and its
    backward's rows); ``None`` if it proved nothing."""
    values = problem.by_name
    scale = objective_scale([values[n].time_s for n in problem.forward_names])
    lp = pulp.LpProblem("block_bound", pulp.LpMinimize) if tail is None else tail[1].lp
    out = _outside(lp, problem, structure)
    cost = [scale * values[n].time_s * out.redo[n] for n in out.names]
    last = len(structure.blocks) - 1
    sizes = [len(c) - (tail is not None and last in c) for c in structure.classes]
    classes = [_ClassVars(lp, ci, n, f, scale, tail is not None) for ci, (n, f) in enumerate(
        zip(sizes, fronts, strict=True))]  # fmt: skip
    cost += [c.cost for c in classes]
    if tail is not None:
        cost.append(scale / tail[1].scale * tail[1].cost)
    lp.setObjective(pulp.lpSum(cost))
    before = pulp.lpSum(c.kept + c.reached_before + c.touched_before for c in classes)
    last_held: list[pulp.LpVariable] = []
    if tail is not None:
        last_held.append(_tail_rows(lp, budget, *tail, classes))
        before = before + pulp.lpSum(b / UNIT * v for b, v in tail[1].kept_terms)
    _start_row(lp, problem, budget, out, before)
    blocks = _Blocks(classes=classes, last_held=last_held, most=_most(problem, structure))
    _head_rows(lp, problem, budget, out, blocks, moments)
    lp.solve(backend(config, time_limit_s, {}))
    return _solution(lp, scale, classes)


@dataclasses.dataclass(frozen=True)
class _Outside:
    """The knapsack's values outside the blocks, one binary each as in the moments bound, and
    the storages it counts by them: not those live whatever the plan, nor the blocks'."""

    names: list[str]
    saved: dict[str, pulp.LpVariable]
    redo: dict[str, pulp.LpVariable]
    """Whether the value is recomputed (never, for a random one)."""
    in_block: set[str]
    """The blocks' forward values..."""
    owned: set[str]
    """...and the storages they allocate, which the fronts count."""
    held: set[str]
    """Storages live whatever the plan: the user outputs' and the tangents'."""
    nbytes: dict[str, float]
    """Every storage's bytes in :data:`UNIT`."""


def _outside(lp: pulp.LpProblem, problem: Problem, structure: Structure) -> _Outside:
    """The outside values' binaries, with their rows: what the backward reads is saved or
    recomputed, and a recomputation has its outside inputs saved or recomputed too."""
    values = problem.by_name
    in_block = {n for b in structure.blocks for n in b.forward}
    owned = {s for n in in_block for s in values[n].allocates}
    outside = sorted(n for n in problem.forward_names if n not in in_block)
    held = {s for n in problem.user_outputs for s in values[n].storages}
    held |= {s for v in problem.values if v.role is Role.TANGENT for s in v.storages}
    nbytes = {s: b / UNIT for s, b in problem.storage_bytes.items()}
    saved = {n: lp.add_variable(f"s{k}", 0, 1, cat=pulp.LpBinary) for k, n in enumerate(outside)}
    redo = {
        n: lp.add_variable(f"r{k}", 0, 0 if values[n].never_recomputed else 1)
        for k, n in enumerate(outside)
    }
    for n in problem.backward_reads:
        if n in saved:
            lp += saved[n] + redo[n] >= 1
    for n in outside:
        for i in values[n].inputs:
            if i in saved:  # a block's value is the block's to keep (its front pays for it)
                lp += saved[i] + redo[i] >= redo[n]
    return _Outside(
        names=outside,
        saved=saved,
        redo=redo,
        in_block=in_block,
        owned=owned,
        held=held,
        nbytes=nbytes,
    )


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The blocks' side of the head moments' rows."""

    classes: list[_ClassVars]
    last_held: list[pulp.LpVariable]
    """What the last block holds at the head's moments, where it has its own model (tail)."""
    most: float
    """The bytes every block's forward allocates (:data:`UNIT`): more than the reached blocks
    can hold, so a row with it subtracted binds nothing."""


def _most(problem: Problem, structure: Structure) -> float:
    """:attr:`_Blocks.most`: a class's blocks are alike, so its first one's bytes count for
    each."""
    values = problem.by_name
    total = sum(
        len(cls)
        * problem.storages_bytes(
            {s for n in structure.blocks[cls[0]].forward for s in values[n].allocates}
        )
        for cls in structure.classes
    )
    return total / UNIT


def _start_row(
    lp: pulp.LpProblem,
    problem: Problem,
    budget: int,
    out: _Outside,
    before: pulp.LpAffineExpression,
) -> None:
    """The backward's start: what is live whatever the plan, every saved outside value (each
    storage once, however many values keep it) and ``before``, what the blocks keep, fit."""
    values = problem.by_name
    live: dict[str, pulp.LpVariable] = {}
    for n in out.names:
        for s in values[n].storages:
            if s in out.held or s in out.owned or not out.nbytes.get(s, 0):
                continue
            if s not in live:
                live[s] = lp.add_variable(f"m{len(live)}", 0, 1)
            lp += live[s] >= out.saved[n]
    fixed0 = problem.storages_bytes(out.held)
    lp += (
        pulp.lpSum(out.nbytes[s] * x for s, x in live.items()) + before <= (budget - fixed0) / UNIT
    )


def _head_rows(
    lp: pulp.LpProblem,
    problem: Problem,
    budget: int,
    out: _Outside,
    blocks: _Blocks,
    moments: Sequence[Moment],
) -> None:
    """Each head moment: what is live whatever the plan, the saved outside values read after
    it, and what the blocks hold, fit. A block holds what it kept until the head's
    recomputation may have reached it (:func:`_pulls`), what it holds after from then on."""
    saved, classes = out.saved, blocks.classes
    pulled = _pulls(problem, lp, saved, out.redo, out.in_block, moments)
    for c in classes:  # blocks the head's recomputation reaches exist only once it does
        lp += c.reached <= c.size * pulled[-1]
    any_saved: dict[tuple[str, tuple[str, ...]], pulp.LpVariable] = {}
    for m, pull in zip(moments, pulled, strict=True):
        fixed = m.fixed_bytes - problem.storages_bytes(m.fixed & out.owned)
        terms = []
        for s, on in m.later:
            mine = tuple(n for n in on if n in saved)
            if s in out.held or s in out.owned or not mine:
                continue
            x = any_saved.get((s, mine))
            if x is None:
                x = any_saved[(s, mine)] = lp.add_variable(f"q{len(any_saved)}", 0, 1)
                for n in mine:
                    lp += x >= saved[n]
            terms.append(out.nbytes[s] * x)
        now = []
        for j, c in enumerate(classes):  # the reached blocks' bytes: before, or after
            z = lp.add_variable(f"z{j}_{m.index}", 0)
            if c.front.after is not None:
                lp += z >= c.reached_after
            lp += z >= c.reached_before - blocks.most * pull
            now.append(z)
        now += blocks.last_held
        room = (budget - fixed) / UNIT
        untouched = [c.kept + c.touched_before for c in classes]  # the tail's reach is later
        lp += pulp.lpSum(terms) + pulp.lpSum(untouched + now) <= room


def _solution(lp: pulp.LpProblem, scale: float, classes: Sequence[_ClassVars]) -> _Knapsack | None:
    """The solved knapsack's dual bound in seconds, and where its optimum keeps, to aim the
    next tangents at; ``None`` if it proved nothing."""
    if pulp.LpStatus[lp.status] == "Infeasible":
        return None
    raw = best_bound(lp)
    if raw is None or not math.isfinite(raw):
        return None
    return _Knapsack(
        max(0.0, raw) / scale,
        tuple(
            c.share(c.kept, c.size - (c.reached.value() or 0.0) - (c.touched.value() or 0.0))
            for c in classes
        ),
        tuple(c.share(c.reached_after, c.reached.value() or 0.0) for c in classes),
    )


def _tail_rows(
    lp: pulp.LpProblem, budget: int, tail: _Tail, model: MilpModel, classes: Sequence[_ClassVars]
) -> pulp.LpVariable:
    """The last block's backward: its peak (every moment of its model) and what the other
    blocks hold, what they keep unless its recomputation reaches into them (module docstring).
    Returns what the block holds at the head's moments: what it kept, or, once the head's
    recomputation has reached in (only if a value it reads from the block is unsaved), what
    it holds once it has recomputed what the head reads (its first stage's op's moment)."""
    peak = model.budget_var
    assert peak is not None
    held = pulp.lpSum(c.kept + c.touched_held + c.reached_after for c in classes)
    lp += peak / UNIT + held <= (budget + tail.room) / UNIT
    kept = pulp.lpSum(b / UNIT * v for b, v in model.kept_terms)
    after = pulp.lpSum(b / UNIT * v for b, v in model.live_at[0])
    big = tail.kp.problem.storages_bytes(tail.kp.problem.storage_bytes) / UNIT
    z = lp.add_variable("zL", 0)
    pulled = lp.add_variable("pL", 0, 1, cat=pulp.LpBinary)
    lp += pulled <= pulp.lpSum([1 - model.s[f] if f in model.s else 1 for f in tail.fed])
    lp += z >= kept - big * pulled
    lp += z >= after - big * (1 - pulled)
    return z


class _ClassVars:
    """One class of blocks in the knapsack: how many the head's recomputation reaches, and
    the bytes the others keep, the reached ones keep before it and hold after it, each group's
    cost above every tangent (``size`` blocks, ``scale``: the objective's units per second;
    bytes in :data:`UNIT`, so a tangent's weight, ~1e-12 s/B, is a coefficient near 1).
    ``tail``: also how many of the others the last block's backward reaches, what they keep
    before and hold after."""

    def __init__(
        self, lp: pulp.LpProblem, ci: int, size: int, front: _Front, scale: float, tail: bool
    ):
        self.size = size
        self.reached = lp.add_variable(f"nB{ci}", 0, size)
        self.kept = lp.add_variable(f"K{ci}", 0)
        self.reached_before = lp.add_variable(f"KB{ci}", 0)
        self.reached_after = lp.add_variable(f"KBa{ci}", 0)
        self.touched = lp.add_variable(f"nT{ci}", 0, size if tail else 0)
        self.touched_before = lp.add_variable(f"KT{ci}", 0)
        self.touched_held = lp.add_variable(f"KTh{ci}", 0)
        rest = lp.add_variable(f"C{ci}", 0)
        reached = lp.add_variable(f"CB{ci}", 0)
        touched = lp.add_variable(f"CT{ci}", 0)
        lp += self.reached + self.touched <= size
        groups = (
            (rest, size - self.reached - self.touched, self.kept),
            (reached, self.reached, self.reached_before),
            (touched, self.touched, self.touched_before),
        )
        for cost, n, kept in groups:
            for t in front.lines:  # every block lies on or above each tangent
                lp += cost >= scale * (n * t.bound_s - t.weight * UNIT * kept)
        for t in front.after_lines:
            lp += reached >= scale * (
                self.reached * t.bound_s - t.weight * UNIT * self.reached_after
            )
        # A block the tail's recomputation reaches holds, during the last block's backward,
        # what it kept before and, once reached, what it holds after: at least the lesser, and
        # at each weight the lesser tangent is below every plan's (recompute + weight * that).
        lp += self.touched_held <= self.touched_before
        for t in front.lines:
            a = front.matched.get(t.weight)
            if a is not None:
                lp += touched >= scale * (
                    self.touched * min(t.bound_s, a.bound_s) - t.weight * UNIT * self.touched_held
                )
        if not front.matched:  # no such tangent: those blocks count nothing
            lp += self.touched_held == 0
        self.front = front
        if not front.reachable:  # nothing outside the blocks reads this class: never reached
            lp += self.reached == 0
            lp += self.touched == 0
        self.cost = rest + reached + touched

    @staticmethod
    def share(kept: pulp.LpVariable, blocks: float) -> float | None:
        return UNIT * (kept.value() or 0.0) / blocks if blocks > 0.5 else None


def _pulls(
    problem: Problem,
    lp: pulp.LpProblem,
    saved: dict[str, pulp.LpVariable],
    redo: dict[str, pulp.LpVariable],
    in_block: set[str],
    moments: Sequence[Moment],
) -> list[pulp.LpVariable]:
    """Per head moment, a variable that is 1 once the head has recomputed, by then, an
    outside value read from a block (so a block's value may have been recomputed and a value
    it kept only for that freed). What the head has recomputed by moment ``k`` is a closure:
    a value read by a backward op up to ``k`` and not saved, and the unsaved inputs of one."""
    values, users = problem.by_name, problem.users
    backward = [v for v in problem.values if v.role is Role.BACKWARD]
    first_read, _ = read_span(problem, backward)
    order = [v.name for v in reversed(problem.values) if v.name in saved]
    out: list[pulp.LpVariable] = []
    for j, m in enumerate(moments):
        read = {n for n in saved if first_read.get(n, m.index + 1) <= m.index}
        closure = set()
        stack = list(read)
        while stack:
            n = stack.pop()
            if n not in closure:
                closure.add(n)
                stack.extend(i for i in values[n].inputs if i in saved)
        pull = lp.add_variable(f"p{j}", 0, 1)
        if out:
            lp += pull >= out[-1]
        by_k: dict[str, pulp.LpVariable] = {}
        for n in order:
            if n not in closure or values[n].never_recomputed:
                continue
            c = by_k[n] = lp.add_variable(f"c{j}_{len(by_k)}", 0, 1)
            if n in read:
                lp += c >= 1 - saved[n]
            for u in users[n]:
                if u in by_k:
                    lp += c >= by_k[u] - saved[n]
            lp += redo[n] >= c
            if any(i in in_block for i in values[n].inputs):
                lp += pull >= c
        out.append(pull)
    return out
