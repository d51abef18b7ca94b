"""A lower bound on recompute time that scales to 70B graphs: the moments of the backward.

When the backward starts (:mod:`remat.solver.simulate`), every saved value, every user output
and every output gradient is live. Later, at each backward op, the op's inputs (saved or
recomputed: either way they are live then), its outputs and its kernel's scratch, every
gradient still to be read (the backward's own values, whose order no plan changes), the
parameters' gradients produced so far (when they are held), the output gradients, and every
forward value between its first and last backward read (saved, or recomputed by its first:
an executor recomputes a value once) are live, and so is the storage of any saved value still
needed after ``t``. So a plan whose peak fits ``B`` satisfies, at the backward's start and at
each such moment ``t``,

    bytes(what is live at t whatever the plan) + bytes(saved values needed after t) <= B,

and it recomputes, once each, what the backward reads and it did not save, with whatever those
recomputations read in turn. A saved value is needed after ``t`` while the backward still
reads it; on an executor that recomputes on demand (:attr:`~remat.solver.executor.
ExecutorModel.on_demand`), also while a recomputation it feeds cannot have run yet: one of
its forward users (or theirs) is first read after ``t``. Keeping only these moments leaves a
MILP with one binary per forward value and no time index -- small enough for a 70B Llama,
whose exact MILP cannot even be built -- and its optimum, or any dual bound HiGHS proves for
it, is a lower bound on the recompute time of every plan that fits ``B``. The chain solver
records it, so a plan for a large model says how far from the optimum it can at most be.

What it leaves out only makes the bound lower, never wrong: when recomputations run (a
value recomputed for an early op and read late is live in between), and how long a saved
value lives for the recomputations it feeds past what the rules above see. Modelling the
first exactly at a few moments is tight on small graphs but adds two variables per forward
value per moment, which HiGHS does not solve at 7B in the plan's time.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import pulp

from remat.problem import Problem, Role, Value
from remat.solver import clock
from remat.solver.backend import backend, best_bound, objective_scale
from remat.solver.config import SolverConfig
from remat.solver.executor import executor_of

MOMENTS = 48
"""Backward moments kept in the MILP at most (each is a row over the saved values read after
it); more make the bound tighter and the MILP larger."""

_NEVER = 1 << 62


@dataclass(frozen=True)
class Moment:
    """One backward op's moment: the bytes live there whatever the plan, and every other
    storage with the forward values on it still needed after it (the storage is live there
    when any of them is saved)."""

    index: int
    fixed_bytes: int
    later: tuple[tuple[str, tuple[str, ...]], ...]
    fixed: frozenset[str] = frozenset()
    """The storages counted in ``fixed_bytes`` (scratch aside)."""


def read_span(problem: Problem, backward: Sequence[Value]) -> tuple[dict[str, int], dict[str, int]]:
    """Each forward value's first and last read among the ``backward`` ops (their indices)."""
    fwd = problem.forward_names
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, v in enumerate(backward):
        for i in v.inputs:
            if i in fwd:
                first.setdefault(i, k)
                last[i] = k
    return first, last


def recompute_horizons(problem: Problem, first_read: Mapping[str, int]) -> dict[str, int]:
    """For each forward value the backward does not read itself, the first backward op that
    can read one of the forward values computed from it. Saved, it feeds only
    recomputations; an on-demand executor recomputes a value just before the first backward
    op that needs it, so it is live before that op."""
    fwd = problem.forward_names
    users = problem.users
    earliest: dict[str, int] = {}
    for v in reversed(problem.values):
        if v.name in fwd:
            e = first_read.get(v.name, _NEVER)
            earliest[v.name] = min([e, *(earliest[u] for u in users[v.name] if u in fwd)])
    out = {}
    for n in fwd:
        h = min((earliest[u] for u in users[n] if u in fwd), default=_NEVER)
        if n not in first_read and not problem.by_name[n].never_recomputed and h < _NEVER:
            out[n] = h
    return out


def view_reads(problem: Problem, last: Mapping[str, int]) -> dict[str, int]:
    """Each forward value's last backward read of itself or of a view of its storage computed
    from it through views alone (``last``: :func:`read_span`'s). Saved, a value holds its
    storage at least that long: the view is read from that storage, either recomputed from
    the value (which is held until then) or recomputed earlier and holding it itself, and no
    executor makes a second copy of a storage still held."""
    values, users, fwd = problem.by_name, problem.users, problem.forward_names
    out: dict[str, int] = {}
    for v in reversed(problem.values):
        if v.name not in fwd:
            continue
        top = last.get(v.name, -1)
        mine = set(v.storages)
        for u in users[v.name]:
            w = values[u]
            if u in out and w.storages and not w.allocates and set(w.storages) <= mine:
                top = max(top, out[u])
        out[v.name] = top
    return {n: k for n, k in out.items() if k >= 0}


def _needed_after(
    problem: Problem, first: Mapping[str, int], last: Mapping[str, int]
) -> dict[str, list[tuple[int, str]]]:
    """Per storage, ``(last moment it is needed at, value)`` of the forward values on it
    (``first``, ``last``: :func:`read_span`)."""
    # remat's executor never copies a held storage; PyTorch's checkpoint may (its replay
    # allocates afresh), so there a saved value's views say nothing of it.
    need = view_reads(problem, last) if problem.executor == "graph" else dict(last)
    if executor_of(problem).on_demand:
        for n, h in recompute_horizons(problem, first).items():
            need[n] = max(need.get(n, -1), h - 1)
    out: dict[str, list[tuple[int, str]]] = {}
    for n, k in need.items():
        for s in problem.by_name[n].storages:
            if problem.storage_bytes.get(s, 0):
                out.setdefault(s, []).append((k, n))
    for pairs in out.values():
        pairs.sort()
    return out


def backward_moments(
    problem: Problem, limit: int = MOMENTS, *, at: Collection[int] | None = None
) -> list[Moment]:
    """The backward ops' moments most likely to bind, at most ``limit`` (any subset gives a
    valid bound): a moment is kept only if more is live there whatever the plan than at every
    earlier one, since an earlier moment has the later one's saved values after it too (a
    heuristic: the earlier one may count a storage as always live that the later one counts
    as saved). ``at``: instead, the moments of exactly these backward ops (their indices)."""
    values = problem.by_name
    fwd = problem.forward_names
    backward = [v for v in problem.values if v.role is Role.BACKWARD]
    first_read, last_read = read_span(problem, backward)
    last_use = {i: k for k, v in enumerate(backward) for i in v.inputs if i not in fwd}
    needed = _needed_after(problem, first_read, last_read)
    spans: dict[int, list[str]] = {}  # a value read twice or more: live between its reads
    ends: dict[int, list[str]] = {}
    for n, k in first_read.items():
        if last_read[n] > k:
            spans.setdefault(k, []).append(n)
            ends.setdefault(last_read[n], []).append(n)
    refs: dict[str, int] = {}

    def hold(storages: Sequence[str]) -> None:
        for s in storages:
            refs[s] = refs.get(s, 0) + 1

    def drop(storages: Sequence[str]) -> None:
        for s in storages:
            refs[s] -= 1
            if not refs[s]:
                del refs[s]

    for n in (*problem.user_outputs, *(v.name for v in values.values() if v.role is Role.TANGENT)):
        hold(values[n].storages)
    grads = set(problem.grad_outputs) if problem.grads_held else set()
    nbytes = problem.storage_bytes
    out: list[Moment] = []
    top = -1
    for k, v in enumerate(backward):
        hold(v.storages)
        for n in spans.get(k, ()):
            hold(values[n].storages)
        here = set(refs)
        for i in v.inputs:
            here.update(values[i].storages)
        fixed = sum(nbytes.get(s, 0) for s in here) + v.scratch_bytes
        if (fixed > top) if at is None else (k in at):
            top = max(top, fixed)
            later = tuple(
                (s, tuple(n for d, n in pairs if d > k))
                for s, pairs in needed.items()
                if s not in here and pairs[-1][0] > k
            )
            out.append(Moment(k, fixed, later, frozenset(here)))
        for i in dict.fromkeys(v.inputs):
            if values[i].role is Role.BACKWARD and last_use.get(i) == k and i not in grads:
                drop(values[i].storages)
        if v.name not in last_use and v.name not in grads:
            drop(v.storages)
        for n in ends.get(k, ()):
            drop(values[n].storages)
    if at is None and len(out) > limit:  # evenly over the backward, the most loaded one kept
        step = len(out) / limit
        picked = {int(j * step) for j in range(limit - 1)} | {len(out) - 1}
        out = [m for j, m in enumerate(out) if j in picked]
    return out


@clock.counted
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
        n: lp.add_variable(f"r{k}", 0, 0 if values[n].never_recomputed else 1)
        for k, n in enumerate(names)
    }
    lp += pulp.lpSum(scale * values[n].time_s * redo[n] for n in fwd)
    for n in problem.backward_reads:
        lp += saved[n] + redo[n] >= 1
    for n in fwd:
        for i in values[n].inputs:
            if i in fwd:
                lp += saved[i] + redo[i] >= redo[n]
    live: dict[str, pulp.LpVariable] = {}
    for n in names:
        for s in values[n].storages:
            if s in held or problem.storage_bytes.get(s, 0) == 0:
                continue
            if s not in live:
                live[s] = lp.add_variable(f"m{len(live)}", 0, 1)
            lp += live[s] >= saved[n]
    nbytes = problem.storage_bytes
    lp += pulp.lpSum(nbytes[s] * x for s, x in live.items()) <= budget_bytes - fixed
    any_saved: dict[tuple[str, tuple[str, ...]], pulp.LpVariable] = {}
    for m in rows:
        terms = []
        for s, on in m.later:
            if s in held:
                continue
            x = any_saved.get((s, on))
            if x is None:  # live when any value on it still needed is saved
                x = any_saved[(s, on)] = lp.add_variable(f"q{len(any_saved)}", 0, 1)
                for n in on:
                    lp += x >= saved[n]
            terms.append(nbytes[s] * x)
        if terms:
            lp += pulp.lpSum(terms) <= budget_bytes - m.fixed_bytes
    lp.solve(backend(config, max(1.0, config.time_limit_s), {}))
    # The dual bound, not the objective: "optimal" means within the solver's relative gap.
    raw = best_bound(lp) if pulp.LpStatus[lp.status] != "Infeasible" else None
    if raw is None or not math.isfinite(raw):
        return None
    return max(0.0, raw) / scale
