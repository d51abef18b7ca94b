"""The knapsack MILP of :mod:`remat.solver.block_bound`: its rows (the values outside the
blocks, each class of blocks through its fronts' tangents, the head moments, the last block's
tail) and the records it is built from. Separate because the bound's rounds and the model's
rows change for different reasons.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import pulp

from remat.problem import Problem, Role
from remat.solver import clock
from remat.solver.backend import backend, best_bound, objective_scale
from remat.solver.bound import Moment, read_span
from remat.solver.compress import Compressed
from remat.solver.config import SolverConfig
from remat.solver.fronts import (
    KeptProblem,
    Tangent,
    tangent,
)
from remat.solver.milp_model import MilpModel
from remat.solver.structure import Structure

UNIT = 1e6
"""Bytes per unit of memory in the knapsack: in bytes, its rows' coefficients span ~1e-3 to
~1e10 and HiGHS reported an "optimal" solution far from it (a bound above a fitting plan)."""


MATCHED = 3
"""The latest tangents a tail round matches with ``after`` tangents at their weights."""


@dataclasses.dataclass(frozen=True)
class Knapsack:
    bound_s: float
    kept: tuple[float | None, ...]
    """Per class, the bytes one of its blocks keeps on average in the optimum (``None``:
    no block there), before the head's recomputation reaches into the blocks..."""
    kept_after: tuple[float | None, ...]
    """...and, of the blocks it reaches, after."""


class Front:
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
class Tail:
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


def knapsack(
    problem: Problem,
    budget: int,
    structure: Structure,
    moments: Sequence[Moment],
    fronts: Sequence[Front],
    config: SolverConfig,
    time_limit_s: float,
    tail: tuple[Tail, MilpModel] | None = None,
) -> Knapsack | None:
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


def _solution(lp: pulp.LpProblem, scale: float, classes: Sequence[_ClassVars]) -> Knapsack | None:
    """The solved knapsack's dual bound in seconds, and where its optimum keeps, to aim the
    next tangents at; ``None`` if it proved nothing."""
    if pulp.LpStatus[lp.status] == "Infeasible":
        return None
    raw = best_bound(lp)
    if raw is None or not math.isfinite(raw):
        return None
    return Knapsack(
        max(0.0, raw) / scale,
        tuple(
            c.share(c.kept, c.size - (c.reached.value() or 0.0) - (c.touched.value() or 0.0))
            for c in classes
        ),
        tuple(c.share(c.reached_after, c.reached.value() or 0.0) for c in classes),
    )


def _tail_rows(
    lp: pulp.LpProblem, budget: int, tail: Tail, model: MilpModel, classes: Sequence[_ClassVars]
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
        self, lp: pulp.LpProblem, ci: int, size: int, front: Front, scale: float, tail: bool
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
