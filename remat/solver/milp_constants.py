"""The exact MILP's constants: the live bytes every plan has, along the forward and the backward.

:class:`remat.solver.milp_model.MilpModel` writes each memory row as these bytes plus the
bytes its variables make live (saved or recomputed forward storages). They depend on the
problem alone, not on a variable, a budget or a cut, and their maximum is the floor below
which no budget is feasible; so they are computed here, without pulp, before the model
decides whether to build anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.problem import Problem, Role, Value


@dataclass(frozen=True)
class BackwardConstants:
    """Plan-independent live bytes along the backward (tangents, backward values, user
    outputs), and which forward storages backward values hold (views of forward values)."""

    base: list[int]
    """At each backward op, while it runs (its kernel's scratch included)..."""
    after: list[int]
    """... and once it has freed what it read last."""
    hold: list[frozenset[str]]
    """Forward storages backward values hold at each backward op..."""
    hold_after: list[frozenset[str]]
    """... and after it."""
    gap_max: list[dict[frozenset[str], int]]
    """Per stage, over the backward ops strictly between it and the one before (the gap):
    the largest base for each set of forward storages backward values hold there."""
    pre_base: list[int]
    """Per stage, the live base right before its recomputations start..."""
    pre_hold: list[frozenset[str]]
    """... and the forward storages backward values hold then."""
    tail_max: int
    """The largest base after the last stage."""


@dataclass(frozen=True)
class ForwardConstants:
    """Plan-independent live bytes along the forward when nothing is saved."""

    core: set[str]
    """Forward values every plan computes (outputs, mutations, values never recomputed, and
    what they read); the others run only to produce a saved value."""
    death: dict[str, int]
    """Core storage -> the forward position of its last core reader (its natural death)."""
    base: list[int]
    """At each forward op."""


def backward_constants(
    problem: Problem,
    bw: list[Value],
    stage_k: list[int],
    user_storages: set[str],
    owned_by_fwd: set[str],
) -> BackwardConstants:
    """Walk the backward once, counting what it allocates and frees whatever the plan.
    ``stage_k``: each stage's position in ``bw``."""
    p = problem
    values = p.by_name
    last: dict[str, int] = {}
    for k, v in enumerate(bw):
        for i in v.inputs:
            last[i] = k
    grads = set(p.grad_outputs) if p.grads_held else set()
    tangent_storages = {s for t in p.values if t.role is Role.TANGENT for s in t.storages}
    const = p.storages_bytes(user_storages) + p.storages_bytes(tangent_storages)
    # The engine holds the tangents all backward long: views of them add nothing.
    holders: dict[str, int] = dict.fromkeys(tangent_storages, 1)
    live = const
    bw_base: list[int] = []
    bw_after: list[int] = []
    bw_hold: list[frozenset[str]] = []  # forward storages backward values hold at op k
    bw_hold_after: list[frozenset[str]] = []
    fwd_held: dict[str, int] = {}
    for k, v in enumerate(bw):
        for s in v.storages:
            if s in owned_by_fwd:
                fwd_held[s] = fwd_held.get(s, 0) + 1
                continue
            if s in user_storages:
                continue
            if holders.get(s, 0) == 0:
                live += p.storage_bytes[s]
            holders[s] = holders.get(s, 0) + 1
        bw_base.append(live + v.scratch_bytes)  # the kernel's scratch, while it runs
        bw_hold.append(frozenset(s for s, c in fwd_held.items() if c))
        dead = [i for i in v.inputs if last.get(i) == k and values[i].role is Role.BACKWARD]
        if v.name not in last and v.name not in grads:
            dead.append(v.name)
        for d in dead:
            if d in grads:
                continue
            for s in values[d].storages:
                if s in owned_by_fwd:
                    fwd_held[s] -= 1
                    continue
                if s in user_storages:
                    continue
                holders[s] -= 1
                if holders[s] == 0:
                    live -= p.storage_bytes[s]
        bw_after.append(live)
        bw_hold_after.append(frozenset(s for s, c in fwd_held.items() if c))
    # The backward ops strictly between two stages (the gaps): the largest base for each
    # set of forward storages backward values hold there; and the live base right before
    # each stage's recomputations start.
    gap_max: list[dict[frozenset[str], int]] = []
    pre_base: list[int] = []
    pre_hold: list[frozenset[str]] = []
    prev = -1
    start = const  # tangents allocated, outputs held: the "output gradients" moment
    for t in range(len(stage_k)):
        k = stage_k[t]
        gap: dict[frozenset[str], int] = {frozenset(): start} if t == 0 else {}
        for kk in range(prev + 1, k):
            held = bw_hold[kk]
            gap[held] = max(gap.get(held, 0), bw_base[kk])
        gap_max.append(gap)
        pre_base.append(bw_after[k - 1] if k > 0 else start)
        pre_hold.append(bw_hold_after[k - 1] if k > 0 else frozenset())
        prev = k
    tail_max = max(bw_base[prev + 1 :], default=0)
    return BackwardConstants(
        bw_base, bw_after, bw_hold, bw_hold_after, gap_max, pre_base, pre_hold, tail_max
    )


def forward_constants(
    problem: Problem,
    fwd: list[str],
    pos: dict[str, int],
    fwd_storages: dict[str, list[str]],
    user_storages: set[str],
) -> ForwardConstants:
    """Live bytes along the forward when nothing is saved, and each core storage's death.
    ``fwd_storages``: forward storage -> its forward holders."""
    p = problem
    values = p.by_name
    keep = set(p.user_outputs) | set(p.mutation_outputs)
    targets = keep | {n for n in fwd if values[n].never_recomputed}
    core: set[str] = set()
    for n in reversed(fwd):
        if n in targets:
            core.add(n)
            targets.update(values[n].inputs)
    last: dict[str, int] = {}
    for n in fwd:
        if n in core:
            for i in values[n].inputs:
                last[i] = pos[n]
    end = len(fwd)
    for n in keep:
        last[n] = end
    death: dict[str, int] = {}
    for s, holders in fwd_storages.items():
        core_holders = [h for h in holders if h in core]
        if core_holders:
            death[s] = max(last.get(h, pos[h]) for h in core_holders)
    alloc = {s: pos[n] for n in fwd for s in values[n].allocates}
    fw_base: list[int] = []
    for k, n in enumerate(fwd):
        live = p.storages_bytes(
            s for s, d in death.items() if alloc[s] <= k <= d and (n in core or alloc[s] < k)
        )
        live += p.storages_bytes(s for s in user_storages if alloc.get(s, end) <= k)
        # An optional op's scratch counts only if it runs (the model's f[n]).
        fw_base.append(live + (values[n].scratch_bytes if n in core else 0))
    return ForwardConstants(core, death, fw_base)
