"""A lower bound on recompute time that scales to 70B graphs: the moments of the backward.

When the backward starts (:mod:`remat.solver.simulate`), every saved value, every user output
and every output gradient is live. Later, at each backward op, the op's inputs (saved or
recomputed: either way they are live then), its outputs and its kernel's scratch, every
gradient still to be read (the backward's own values, whose order no plan changes), the
parameters' gradients produced so far (when they are held) and the output gradients are live,
and so is every saved value some later backward op reads. So a plan whose peak fits ``B``
satisfies, at the backward's start and at each such moment ``t``,

    bytes(what is live at t whatever the plan) + bytes(saved values read after t) <= B,

and it recomputes, once each, what the backward reads and it did not save, with whatever those
recomputations read in turn. Keeping only these moments leaves a MILP with one binary per
forward value and no time index -- small enough for a 70B Llama, whose exact MILP cannot even
be built -- and its optimum, or any dual bound HiGHS proves for it, is a lower bound on the
recompute time of every plan that fits ``B``. The chain solver records it, so a plan for a
large model says how far from the optimum it can at most be.

What it does not see: when recomputed values are made (a recomputation lives from before its
first use, not only at it), and where a saved value is also read by a recomputation (its life
is counted to its last backward read only). Both only make the bound lower, never wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from remat.problem import Problem, Role
from remat.solver.backend import backend, best_bound, objective_scale
from remat.solver.config import SolverConfig

MOMENTS = 48
"""Backward moments kept in the MILP at most (each is a row over the saved values read after
it); more make the bound tighter and the MILP larger."""


@dataclass(frozen=True)
class Moment:
    """One backward op's moment: the bytes live there whatever the plan, and the saved
    storages whose values are read after it (each live there when any of them is saved)."""

    index: int
    fixed_bytes: int
    later: tuple[str, ...]


def backward_moments(problem: Problem, limit: int = MOMENTS) -> list[Moment]:
    """The backward ops' moments most likely to bind, at most ``limit`` (any subset gives a
    valid bound): a moment is kept only if more is live there whatever the plan than at every
    earlier one, since an earlier moment has the later one's saved values after it too (a
    heuristic: the earlier one may count a storage as always live that the later one counts
    as saved)."""
    values = problem.by_name
    fwd = problem.forward_names
    backward = [v for v in problem.values if v.role is Role.BACKWARD]
    last_read: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for k, v in enumerate(backward):
        for i in v.inputs:
            if i in fwd:
                last_read[i] = k
            elif values[i].role is Role.BACKWARD:
                last_use[i] = k
    # A saved storage is counted at t only while every saved value on it is read after t.
    first_done: dict[str, int] = {}
    for n, k in last_read.items():
        for s in values[n].storages:
            if problem.storage_bytes.get(s, 0):
                first_done[s] = min(first_done.get(s, k), k)
    held_names = [*problem.user_outputs]
    held_names += [v.name for v in problem.values if v.role is Role.TANGENT]
    refs: dict[str, int] = {}

    def hold(storages: Sequence[str]) -> None:
        for s in storages:
            refs[s] = refs.get(s, 0) + 1

    def drop(storages: Sequence[str]) -> None:
        for s in storages:
            refs[s] -= 1
            if not refs[s]:
                del refs[s]

    for n in held_names:
        hold(values[n].storages)
    grads = set(problem.grad_outputs) if problem.grads_held else set()
    nbytes = problem.storage_bytes
    out: list[Moment] = []
    top = -1
    for k, v in enumerate(backward):
        hold(v.storages)
        here = set(refs)
        for i in v.inputs:
            here.update(values[i].storages)
        fixed = sum(nbytes.get(s, 0) for s in here) + v.scratch_bytes
        if fixed > top:
            top = fixed
            later = tuple(s for s, d in first_done.items() if d > k and s not in here)
            out.append(Moment(k, fixed, later))
        for i in dict.fromkeys(v.inputs):
            if values[i].role is Role.BACKWARD and last_use.get(i) == k and i not in grads:
                drop(values[i].storages)
        if v.name not in last_use and v.name not in grads:
            drop(v.storages)
    if len(out) > limit:  # evenly over the backward, the most loaded one kept
        step = len(out) / limit
        picked = {int(j * step) for j in range(limit - 1)} | {len(out) - 1}
        out = [m for j, m in enumerate(out) if j in picked]
    return out


def backward_bound(
    problem: Problem, budget_bytes: int, config: SolverConfig, *, moments: int = MOMENTS
) -> float | None:
    """Seconds of recomputation every plan that fits ``budget_bytes`` needs at least; ``None``
    if the solver proved nothing in ``config.time_limit_s`` (or no plan can fit: then the
    budget is below the least peak, which the solvers report themselves). ``moments``: the
    backward ops' moments kept (:func:`backward_moments`; 0: the backward's start alone)."""
    values = problem.by_name
    forward = [v for v in problem.values if v.role is Role.FORWARD]
    fwd = {v.name for v in forward}
    # Live whatever the plan: user outputs and output gradients (each storage counted once).
    held = {s for n in problem.user_outputs for s in values[n].storages}
    held |= {s for v in problem.values if v.role is Role.TANGENT for s in v.storages}
    fixed = problem.storages_bytes(held)
    rows = backward_moments(problem, moments) if moments else []
    if fixed > budget_bytes or any(m.fixed_bytes > budget_bytes for m in rows):
        return None
    scale = objective_scale([v.time_s for v in forward])
    lp = pulp.LpProblem("backward_moments", pulp.LpMinimize)
    names = sorted(fwd)
    saved = {n: lp.add_variable(f"s{k}", 0, 1, cat=pulp.LpBinary) for k, n in enumerate(names)}
    # Recomputation may be fractional: a relaxation of a relaxation is still a lower bound.
    redo = {
        n: lp.add_variable(f"r{k}", 0, 0 if values[n].random else 1) for k, n in enumerate(names)
    }
    lp += pulp.lpSum(scale * values[n].time_s * redo[n] for n in fwd)
    reads = problem.backward_reads
    for n in reads:
        lp += saved[n] + redo[n] >= 1
    for n in fwd:
        for i in values[n].inputs:
            if i in fwd:
                lp += saved[i] + redo[i] >= redo[n]
    live: dict[str, pulp.LpVariable] = {}
    read_live: dict[str, pulp.LpVariable] = {}
    for n in names:
        for s in values[n].storages:
            if s in held or problem.storage_bytes.get(s, 0) == 0:
                continue
            if s not in live:
                live[s] = lp.add_variable(f"m{len(live)}", 0, 1)
            lp += live[s] >= saved[n]
            if n in reads:
                if s not in read_live:
                    read_live[s] = lp.add_variable(f"q{len(read_live)}", 0, 1)
                lp += read_live[s] >= saved[n]
    nbytes = problem.storage_bytes
    lp += pulp.lpSum(nbytes[s] * x for s, x in live.items()) <= budget_bytes - fixed
    for m in rows:
        later = [s for s in m.later if s in read_live]
        if later:
            lp += (
                pulp.lpSum(nbytes[s] * read_live[s] for s in later) <= budget_bytes - m.fixed_bytes
            )
    lp.solve(backend(config, max(1.0, config.time_limit_s), {}))
    # The dual bound, not the objective: "optimal" means within the solver's relative gap.
    raw = best_bound(lp) if pulp.LpStatus[lp.status] != "Infeasible" else None
    if raw is None or not math.isfinite(raw):
        return None
    return max(0.0, raw) / scale
