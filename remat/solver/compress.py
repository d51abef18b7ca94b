"""Lossless compression of a problem before the MILP: views merged into what they view.

A forward *view* (an op that allocates nothing and references exactly the storages of its
first input: ``view``, ``transpose``, ``expand``, ``slice``, ``detach``, a ``getitem`` of a
``split``, ...) costs no time (:func:`remat.measure.costs.node_time`) and no bytes. Saving a view
keeps its base's storage, exactly as saving the base does, but leaves the base to be recomputed
if anything else reads it; saving the base instead costs the same bytes and lets the view be
recomputed for free. So some optimal plan never saves a view, and such a plan behaves the same
whether the view is a separate value or every read of it is a read of its base: the storage is
held from the base's materialisation to the last read of either. Merging therefore loses
nothing, and removes ~40% of a transformer's forward values (and their recompute variables).

Getitems of tuple ops (e.g. the mean and rstd of ``native_layer_norm``) reference one of
several storages, not all of their input's, and are kept.

A second, also lossless, reduction *folds chains*: a forward value ``n`` that the backward never
reads and that has a single forward consumer ``c`` no larger than itself (the ``pow -> mul ->
add -> mul`` chains of a tanh-GELU) is never worth saving: saving ``c`` instead holds fewer
bytes at every moment and recomputes a subset. Unsaved, ``n`` is needed exactly when ``c`` is
recomputed, so the MILP gives both one recompute variable per stage (:attr:`Compressed.fold`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from remat.problem import EXTERNAL_ROLES, Problem, Role


@dataclass(frozen=True)
class Compressed:
    problem: Problem
    """The smaller problem: views removed, their readers reading the base instead."""
    rep: Mapping[str, str]
    """Each removed view -> the value standing for it (a forward or external value)."""
    fold: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Values never saved -> their single consumer, recomputed in the same stage as it."""

    def leader(self, name: str) -> str:
        """The value whose recompute variables ``name`` shares (itself if not folded)."""
        while name in self.fold:
            name = self.fold[name]
        return name

    def lower(self, saved: Iterable[str]) -> frozenset[str]:
        """A plan's saved set (:attr:`Plan.saved`: values its backward reads) in the compressed
        problem's terms: a saved view becomes its saved base (same bytes, never more
        recomputation), a saved folded value its consumer."""
        values = self.problem.by_name
        out = set()
        for n in saved:
            r = self.leader(self.rep.get(n, n))
            if values[r].role is Role.FORWARD:
                out.add(r)
        return frozenset(out)


def compress(problem: Problem) -> Compressed:
    """Views merged into their bases, then chains folded."""
    rep = _mergeable_views(problem)

    def base_of(name: str) -> str:
        while name in rep:
            name = rep[name]
        return name

    new_values = []
    for v in problem.values:
        if v.name in rep:
            continue
        inputs = tuple(dict.fromkeys(base_of(i) for i in v.inputs))
        new_values.append(dataclasses.replace(v, inputs=inputs) if inputs != v.inputs else v)
    smaller = dataclasses.replace(problem, values=tuple(new_values))
    return Compressed(problem=smaller, rep={v: base_of(v) for v in rep}, fold=_fold_chains(smaller))


def _mergeable_views(problem: Problem) -> dict[str, str]:
    """``view -> its input`` for every view that can be merged without loss.

    Saving a view instead of its base can pay when the base is needed *after* the view's last
    use: the view frees the storage early and the base is recomputed later. So a view merges
    only if nothing else in its group (base and the other merged views) can be needed after
    the earliest moment a saved copy of the view could be released; then saving the base
    holds the storage no longer than saving the view would, and recomputes nothing more.
    """
    values = problem.by_name
    keep = set(problem.user_outputs) | set(problem.mutation_outputs)
    cand: dict[str, str] = {}
    for v in problem.values:
        if (
            v.role is not Role.FORWARD
            or v.never_recomputed
            or v.allocates
            or not v.inputs
            or v.name in keep
            or v.time_s != 0.0
            or set(v.storages) != set(values[v.inputs[0]].storages)
            or any(values[i].role not in EXTERNAL_ROLES for i in v.inputs[1:])
        ):
            continue
        cand[v.name] = v.inputs[0]

    # Backward positions where each forward value is read (direct) or may be needed (window:
    # also wherever a consumer may be recomputed; random consumers never are).
    index = problem.index
    fwd = [v for v in problem.values if v.role is Role.FORWARD]
    direct: dict[str, set[int]] = {v.name: set() for v in fwd}
    for v in problem.values:
        if v.role is Role.BACKWARD:
            for i in v.inputs:
                if i in direct:
                    direct[i].add(index[v.name])
    window: dict[str, set[int]] = {}
    for v in reversed(fwd):
        w = set(direct[v.name])
        for c in problem.users[v.name]:
            if c in window and not values[c].never_recomputed:
                w |= window[c]
        window[v.name] = w

    changed = True
    while changed:
        changed = False

        def base_of(name: str) -> str:
            while name in cand:
                name = cand[name]
            return name

        groups: dict[str, list[str]] = {}
        for name in cand:
            groups.setdefault(base_of(name), []).append(name)
        for base, members in groups.items():
            if values[base].role in EXTERNAL_ROLES:
                continue  # the caller holds it: always available, no bytes to hold
            if set(values[base].allocates) != set(values[base].storages):
                # The base does not own the storage (it is a view whose storage is not its
                # first input's, or a tuple projection): the argument above assumes it does.
                for view in members:
                    del cand[view]
                changed = True
                break
            group = {base, *members}
            ext = {
                u: direct[u].union(
                    *(window[c] for c in problem.users[u] if c in window and c not in group)
                )
                for u in group
            }
            for view in members:
                others = set().union(*(ext[u] for u in group if u != view))
                if others and max(others) > _held_at_least_until(direct[view], window[view]):
                    del cand[view]
                    changed = True
            if changed:
                break
    return cand


def _held_at_least_until(direct: set[int], window: set[int]) -> float:
    """A saved value is held at least until its last direct backward read; without one, at
    least until its first possible use (a saved value nothing uses is not kept at all)."""
    if direct:
        return max(direct)
    return min(window) if window else math.inf


def _core(problem: Problem) -> set[str]:
    """Forward values the forward computes whatever is saved (outputs, buffer updates, random
    ops and what they need)."""
    targets = set(problem.user_outputs) | set(problem.mutation_outputs)
    targets |= {v.name for v in problem.values if v.role is Role.FORWARD and v.never_recomputed}
    core: set[str] = set()
    for v in reversed(problem.values):
        if v.role is Role.FORWARD and v.name in targets:
            core.add(v.name)
            targets.update(v.inputs)
    return core


def _fold_chains(problem: Problem) -> dict[str, str]:
    """``n -> c`` for every ``n`` dominated by saving its single consumer ``c``.

    Saving ``c`` instead of ``n`` is never worse when: the backward never reads ``n`` (so only
    ``c``'s recomputation needs it); ``n`` and ``c`` own exactly the storages they hold and
    ``bytes(c) <= bytes(n)``; and the forward computes both whatever is saved (core), so
    holding ``c`` from the forward replaces holding ``n`` byte for byte or better.
    """
    values = problem.by_name
    reads = problem.backward_reads
    keep = set(problem.user_outputs) | set(problem.mutation_outputs)
    core = _core(problem)
    fold: dict[str, str] = {}
    for v in problem.values:
        if v.role is not Role.FORWARD or v.never_recomputed or v.name in reads or v.name in keep:
            continue
        users = [u for u in problem.users[v.name] if values[u].role is not Role.BACKWARD]
        if len(users) != 1 or v.name not in core:
            continue
        c = values[users[0]]
        if (
            c.never_recomputed
            or c.name not in core
            or set(c.storages) != set(c.allocates)
            or set(v.storages) != set(v.allocates)
            or problem.storages_bytes(c.allocates) > problem.storages_bytes(v.allocates)
        ):
            continue
        fold[v.name] = c.name
    return fold
