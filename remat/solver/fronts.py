"""A block's exact front: the least recompute time of one block for each bound on what it keeps.

While the backward runs the blocks in reverse, every block not yet reached holds what it kept
for its backward. Once the loss and the head have done their work, the backward's first
moments therefore hold every block's kept bytes at once: where a 7B-70B step peaks. What one
block keeps and what it then recomputes trade against each other inside the block alone, so
that trade-off, a monotone staircase, can be measured once per class of identical blocks by
the exact MILP and composed over the chain (:mod:`remat.solver.block_bound`).

The block is cut out (:func:`remat.solver.structure.block_problem`) with its outputs *not* held
by a caller: the backward ops outside the block that read its values (the next block reads its
input, the head reads the last block's output) are the block problem's first backward op,
so what is live when its backward starts is exactly what the block kept: its saved
values needed by its backward and by those outside reads, feeders of recomputations
included. The exact MILP's relaxation, with no budget and ``weight`` seconds
per byte kept added to its objective (:func:`remat.solver.milp.kept_tradeoff`), bounds
``recompute + weight * kept`` from below over every plan of the block: a tangent below the
whole staircase, valid whether it is convex or not, and one solve where walking the staircase
step by step takes one per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from remat.problem import Problem, Role, Value
from remat.solver import clock
from remat.solver.config import SolverConfig
from remat.solver.fixed import must_save
from remat.solver.milp import kept_tradeoff
from remat.solver.plan import Plan, Proof, make_plan
from remat.solver.structure import Block, block_problem

OUTSIDE_READS = "__outside_reads__"


@dataclass(frozen=True)
class KeptProblem:
    """One block as a problem whose first backward op reads what the backward outside the
    block reads of it (module docstring)."""

    problem: Problem
    fixed_bytes: int
    """Bytes live when the backward starts whatever the plan: the gradients flowing in."""
    most: int
    """What keep-all keeps: keeping more never recomputes less."""
    stage: int = 0
    """The stage before which what is kept is measured (:func:`~remat.solver.milp.kept_tradeoff`):
    0, the backward's start; 1, after the outside reads (:func:`kept_problem`'s ``after``)."""

    def kept(self, plan: Plan) -> int:
        """The bytes ``plan`` (of :attr:`problem`) keeps when its backward starts (before the
        outside reads, whatever :attr:`stage`)."""
        at = next(t for t in plan.simulation.timeline if t.name == "output gradients")
        return at.allocated_bytes - self.fixed_bytes

    def slope(self) -> float:
        """The front's average slope, seconds per byte: recomputing everything that can be,
        over keep-all's kept (the unit of the tangents' weights)."""
        least = make_plan(
            self.problem, must_save(self.problem), solver="", reason="", proof=Proof.HEURISTIC
        )
        return least.recompute_time_s / max(1, self.most)


def outside_reads(problem: Problem, block: Block) -> tuple[str, ...]:
    """The block's forward values that backward ops outside it read (the next block's
    backward reads its input; the head reads the last block's output), in forward order."""
    values, users, inside = problem.by_name, problem.users, set(block.backward)
    return tuple(
        n
        for n in block.forward
        if any(values[u].role is Role.BACKWARD and u not in inside for u in users[n])
    )


def kept_problem(problem: Problem, block: Block, *, after: bool = False) -> KeptProblem | None:
    """``block`` of ``problem`` as a :class:`KeptProblem`. ``after``: what the block holds
    once the outside reads have been served, its outputs recomputed by then and held until
    they are read again (a second outside-reads op at the end): what it holds once the head
    has recomputed them from it (:mod:`remat.solver.block_bound`); ``None`` if nothing outside
    reads the block."""
    sub = block_problem(problem, block)
    read_outside = outside_reads(problem, block)
    if after and not read_outside:
        return None
    ops = list(sub.values)
    if read_outside:
        first = next(k for k, v in enumerate(ops) if v.role is Role.BACKWARD)
        ops.insert(first, Value(OUTSIDE_READS, Role.BACKWARD, "outside reads", read_outside))
        if after:
            again = Value(OUTSIDE_READS + "again", Role.BACKWARD, "outside reads", read_outside)
            ops.append(again)
    kp = dataclasses.replace(sub, values=tuple(ops), user_outputs=())
    tangents = {s for v in ops if v.role is Role.TANGENT for s in v.storages}
    fixed = kp.storages_bytes(s for s in tangents if s in kp.storage_bytes)
    keep_all = make_plan(
        kp, kp.backward_reads | set(must_save(kp)), solver="", reason="", proof=Proof.HEURISTIC
    )
    partial = KeptProblem(kp, fixed, 0, 1 if after else 0)
    return dataclasses.replace(partial, most=partial.kept(keep_all))


@dataclass(frozen=True)
class Tangent:
    """A line below the block's front: every plan of the block recomputes at least
    ``bound_s - weight * kept`` seconds, whatever it keeps (valid whether the staircase is
    convex or not: it bounds ``recompute + weight * kept`` over all plans at once)."""

    weight: float
    """Seconds per byte kept."""
    bound_s: float
    kept: int
    """What the solver's best plan at this weight keeps (where the line touches the front,
    when that plan is optimal): the next weight is chosen from it."""


@clock.counted
def tangent(kp: KeptProblem, weight: float, config: SolverConfig) -> Tangent | None:
    """The tangent of ``kp``'s front at ``weight`` (seconds per byte), from the exact MILP's
    relaxation in ``config``'s time; ``None`` if nothing was proven."""
    found = kept_tradeoff(kp.problem, weight, config, stage=kp.stage)
    return None if found is None else Tangent(weight, found.bound_s, found.kept)
