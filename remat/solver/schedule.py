"""The executor's exact order, as a pure function of a problem and a saved set.

Both the simulator (:mod:`remat.solver.simulate`) and the rewriter (:mod:`remat.executors.graph`)
call :func:`build_schedule`, so the order remat predicts is by construction the order it runs.

The executor:

* runs, in the forward, every forward op needed for the user outputs, the buffer updates and the
  saved values, plus every random op (so the random stream is consumed exactly as in eager);
* runs the backward ops in the joint graph's order (the order autograd ran them while tracing);
* before each backward op, recomputes the forward values it needs that are neither saved nor
  already recomputed, in graph order, and keeps each until its last use: a value is recomputed
  at most once;
* never recomputes a random op: a plan that would need to is invalid;
* never recomputes an op while a value holding its output's old storage (a saved view of it,
  say) is still to be used: the recomputation would allocate a second copy of that storage.
  Such an op is saved instead. For an op with one output that is never worse: its storage is
  live until then anyway, and saving it holds that one copy no longer than the recomputed copy
  would have lived, without the recompute time. (An op with several outputs, saved whole,
  may hold its other outputs longer: still correct, possibly not the cheapest.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from remat.problem import EXTERNAL_ROLES, Problem, Role
from remat.solver.offload import Offload


class InvalidPlanError(ValueError):
    """A saved set the executor cannot run (saves a non-forward value, recomputes a random op)."""


@dataclass(frozen=True)
class Schedule:
    forward: tuple[str, ...]
    """Ops of the forward graph, in execution order."""
    saved: tuple[str, ...]
    """Forward values handed from the forward to the backward (graph order)."""
    external_reads: tuple[str, ...]
    """Parameters, buffers and inputs the backward reads (free to keep: the caller holds them)."""
    backward: tuple[str, ...]
    """Ops of the backward graph in execution order, recomputations inlined."""
    recomputed: tuple[str, ...]
    """Forward ops the backward re-runs (each exactly once)."""
    held_until: Mapping[str, str] = field(default_factory=dict)
    """Saved values the executor itself holds at least until this backward op (PyTorch's
    checkpoint holds a region's inputs to the end of its backward); the others are freed
    after their last use."""
    dispatch_s: float = 0.0
    """The executor's own time beside the ops' (``sac``: the policies' calls)."""
    offloaded: tuple[Offload, ...] = ()
    """Saved values the executor copies to host memory and back, each at the points of this
    order it names (:mod:`remat.solver.offload`); the others stay on the device."""


def build_schedule(problem: Problem, saved: Iterable[str]) -> Schedule:
    """The forward and backward op orders that realise ``saved`` on remat's own executor
    (``problem.executor == "graph"``; :func:`remat.solver.executor.schedule_of` serves
    every executor)."""
    if problem.executor != "graph":
        raise ValueError(f"build_schedule is the graph executor's; this is {problem.executor!r}")
    values = problem.by_name
    index = problem.index
    saved_set = frozenset(saved)
    bad = sorted(s for s in saved_set if s not in values or values[s].role is not Role.FORWARD)
    if bad:
        raise InvalidPlanError(f"only forward values can be saved; not forward: {bad[:5]}")

    external = {v.name for v in problem.values if v.role in EXTERNAL_ROLES}
    while True:
        backward, recomputed = _backward_order(problem, saved_set, external)
        promote = _second_copies(problem, saved_set, backward, frozenset(recomputed))
        if not promote:
            break
        saved_set |= promote

    read = {i for name in backward for i in values[name].inputs}
    saved_used = tuple(sorted(saved_set & read, key=index.__getitem__))
    external_reads = tuple(sorted(external & read, key=index.__getitem__))

    targets = set(problem.user_outputs) | set(problem.mutation_outputs) | set(saved_used)
    targets |= {v.name for v in problem.values if v.role is Role.FORWARD and v.never_recomputed}
    needed: set[str] = set()
    for v in reversed(problem.values):
        if v.role is Role.FORWARD and v.name in targets:
            needed.add(v.name)
            targets.update(v.inputs)
    forward = tuple(v.name for v in problem.values if v.name in needed)
    return Schedule(
        forward=forward,
        saved=saved_used,
        external_reads=external_reads,
        backward=tuple(backward),
        recomputed=tuple(recomputed),
    )


def _backward_order(
    problem: Problem, saved: frozenset[str], external: set[str]
) -> tuple[list[str], list[str]]:
    """Backward ops in order with recomputations inlined, and the recomputed ops."""
    index = problem.index
    available = external | saved | {v.name for v in problem.values if v.role is Role.TANGENT}
    backward: list[str] = []
    recomputed: list[str] = []
    for v in problem.values:
        if v.role is not Role.BACKWARD:
            continue
        missing = recompute_closure(problem, v.inputs, available)
        for name in sorted(missing, key=index.__getitem__):
            backward.append(name)
            recomputed.append(name)
        available |= missing
        backward.append(v.name)
        available.add(v.name)
    return backward, recomputed


def _second_copies(
    problem: Problem, saved: frozenset[str], backward: list[str], recomputed: frozenset[str]
) -> frozenset[str]:
    """Recomputed ops that would allocate a storage some live value still holds.

    A value holds its storages from its op (from the start for saved values) to its last use
    in the backward graph; gradients and user outputs (the caller's) to the end. When a recomputed op runs, any other live
    holder of a storage it allocates holds the forward's copy: the op would make a second.
    """
    values = problem.by_name
    end = len(backward)
    last: dict[str, int] = {}
    for k, name in enumerate(backward):
        for i in values[name].inputs:
            last[i] = k
    for g in problem.grad_outputs if problem.grads_held else ():
        last[g] = end
    owned = {s for n in recomputed for s in values[n].allocates}
    if not owned:
        return frozenset()
    # Live holders of the recomputed ops' storages, as (storage -> holder -> last use).
    live: dict[str, dict[str, int]] = {s: {} for s in owned}
    for n in saved:
        for s in values[n].storages:
            if s in live and n in last:
                live[s][n] = last[n]
    for n in problem.user_outputs:  # the caller holds them all step long
        for s in values[n].storages:
            if s in live:
                live[s][f"{n} (caller's copy)"] = end
    promote = set()
    for k, name in enumerate(backward):
        v = values[name]
        if name in recomputed:
            for s in v.allocates:
                if any(u >= k for h, u in live[s].items() if h != name):
                    promote.add(name)
        for s in v.storages:
            if s in live:
                live[s][name] = last.get(name, k)
    return frozenset(promote)


def recompute_closure(
    problem: Problem, names: Iterable[str], available: AbstractSet[str]
) -> set[str]:
    """Forward values that must be recomputed so that all of ``names`` are available."""
    values = problem.by_name
    missing: set[str] = set()
    stack = [n for n in names if n not in available]
    while stack:
        name = stack.pop()
        if name in missing or name in available:
            continue
        v = values[name]
        if v.role is not Role.FORWARD:
            raise InvalidPlanError(f"{name} ({v.role.value}) is needed but not available")
        if v.random:
            raise InvalidPlanError(
                f"{name} ({v.op}) draws random numbers and would be recomputed with fresh "
                "randomness: a plan must save it (or what the backward reads of it)"
            )
        if v.pinned:
            raise InvalidPlanError(
                f"{name} ({v.op}) is computed once, outside remat's graphs (the loss, or the "
                "output it reads): a plan must save it where the backward reads it"
            )
        missing.add(name)
        stack.extend(i for i in v.inputs if i not in available and i not in missing)
    return missing
