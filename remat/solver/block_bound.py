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

from remat.problem import Problem, Role
from remat.solver import clock
from remat.solver.block_knapsack import Front, Tail, knapsack
from remat.solver.bound import backward_moments, read_span
from remat.solver.compress import compress
from remat.solver.config import SolverConfig
from remat.solver.fronts import (
    OUTSIDE_READS,
    KeptProblem,
    kept_problem,
    outside_reads,
)
from remat.solver.structure import Structure, find_structure

ROUNDS = 8
"""Tangents per class at most: each is one solve of the block's MILP relaxation, and the
weights are bisected towards the one that touches the front where the knapsack keeps."""
POINT_S = 10.0
"""At most this long for one tangent."""
MAX_CLASSES = 4
"""Beyond this many classes of blocks the fronts cost more than they give: no bound."""
TAIL_SHARE = 1 / 2
"""Of the time, what the rounds with the last block's backward get (module docstring): each
builds the block's exact model and solves a knapsack with its binaries."""


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
        Front(kp, after, kp.slope(), can)
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
        found = knapsack(problem, budget_bytes, structure, moments, fronts, config, left, last)
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


def _tail(problem: Problem, structure: Structure) -> Tail | None:
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
    return Tail(kp, comp, fed_here, room)


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
