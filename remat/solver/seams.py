"""Seams: block boundaries that the chain's recomputation may cross, where that is cheap.

The chain solver's stitched plans save every block's input, so recomputation never crosses a
block boundary. But a block's output (the residual stream) can be the dearest value it keeps
per byte: with bf16 autocast over fp32 weights, a Llama block's output is an fp32 add of the
block's middle residual and its down projection's bf16 output. Keeping that output (134 MB at
70B, 4096 tokens) instead of the down projection's (67 MB) and recomputing the add (0.1 ms) at
the next block's backward frees 67 MB per block where the step peaks.

A seam is such a boundary: the block's output is dropped from the saved set, and a cheaper
replacement inside the block (the :class:`Swap`, found per menu option) is saved instead. The
executor recomputes a dropped output from the nearest kept boundary before it, once, and
holds it until its last use: seams come in runs with every ``m``-th boundary kept
(:func:`pattern`), as in Chen et al.'s sqrt(N) checkpoints. A run's recomputed outputs are
held through the backward of its blocks; the simulator charges them where they are live.

Only remat's own executor (``graph``) recomputes across blocks; PyTorch's checkpoint holds a
region's inputs, so ``sac`` problems have no seams.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from remat.problem import EXTERNAL_ROLES, Problem, Role
from remat.solver.plan import Proof, make_plan
from remat.solver.schedule import InvalidPlanError, recompute_closure
from remat.solver.structure import Structure

SEAM_EVERY = (2, 3, 4, 6, 8, 10, 12, 16)
"""Runs tried: every ``m``-th boundary kept, the others seams (:func:`patterns`)."""
SWAP_CANDIDATES = 6
"""A swap is searched among this many of the dearest ops (by time) of the output's
recomputation, and saves at most two of them."""


@dataclass(frozen=True)
class Swap:
    """What a block saves instead of its output at a seam, and what that costs."""

    saved: frozenset[str]
    """Values of the block saved in the output's place (may be empty)."""
    time_s: float
    """Recompute time added: the output's recomputation, beyond what the block's own
    backward recomputes anyway."""
    freed: int
    """Bytes no longer kept: the output's storage less the swap's new ones."""


def boundaries(problem: Problem, structure: Structure) -> dict[int, str]:
    """Block ``k`` -> its output, for each ``k`` whose forward leaves exactly one value that
    anything outside the block reads, and only block ``k + 1`` reads it: the boundaries a
    seam may drop. Empty for executors that cannot recompute across blocks."""
    if problem.executor != "graph":
        return {}
    values, users = problem.by_name, problem.users
    owner = {n: k for k, b in enumerate(structure.blocks) for n in (*b.forward, *b.backward)}
    user_outputs = set(problem.user_outputs) | set(problem.mutation_outputs)
    out: dict[int, str] = {}
    for k, block in enumerate(structure.blocks[:-1]):
        leaving = [n for n in block.forward if any(owner.get(u) != k for u in users[n])]
        if len(leaving) != 1:
            continue
        (name,) = leaving
        v = values[name]
        if v.never_recomputed or name in user_outputs or not v.allocates:
            continue
        if all(owner.get(u) in (k, k + 1) for u in users[name]):
            out[k] = name
    return out


def find_swap(sub: Problem, output: str, saved: Iterable[str]) -> Swap | None:
    """The cheapest replacement for ``output`` in the block problem ``sub`` under the option
    ``saved`` (maybe nothing: the output dropped, its recomputation paid in full), or None
    where the output holds no storage of its own or its recomputation would need a random
    op. Why this search: the output's recomputation
    runs the block's ops that neither ``saved`` keeps nor the block's own backward recomputes
    anyway; saving one or two of the dearest of them (by time) cuts it short, and is worth it
    while what they hold is less than the output."""
    values = sub.by_name
    saved = frozenset(saved)
    try:
        plan = make_plan(sub, saved, solver="", reason="", proof=Proof.HEURISTIC)
    except InvalidPlanError:
        return None
    external = {v.name for v in sub.values if v.role in EXTERNAL_ROLES or v.role is Role.TANGENT}
    kept = saved | set(plan.schedule.saved)
    available = (kept | set(plan.recomputed) | external) - {output}
    held = {s for n in kept - {output} for s in values[n].storages}
    own = sub.storages_bytes(set(values[output].allocates) - held)

    def closure(extra: Iterable[str]) -> tuple[float, int] | None:
        try:
            again = recompute_closure(sub, [output], available | set(extra))
        except InvalidPlanError:
            return None
        new = {s for n in extra for s in values[n].storages} - held
        return sum(values[n].time_s for n in again), sub.storages_bytes(new)

    plain = closure(())
    if plain is None or own == 0:
        return None
    best = Swap(frozenset(), plain[0], own)
    try:
        whole = recompute_closure(sub, [output], available)
    except InvalidPlanError:
        return None
    dear = sorted(
        (n for n in whole if n != output and values[n].allocates),
        key=lambda n: values[n].time_s,
        reverse=True,
    )[:SWAP_CANDIDATES]
    for r in (1, 2):
        for extra in itertools.combinations(dear, r):
            found = closure(extra)
            if found is None:
                continue
            time_s, cost = found
            if cost < own and (time_s, cost) < (best.time_s, own - best.freed):
                best = Swap(frozenset(extra), time_s, own - cost)
    return best


def patterns(seams: Iterable[int]) -> list[frozenset[int]]:
    """Runs of seams to try: for each ``m`` of :data:`SEAM_EVERY`, every ``m``-th boundary
    kept, counted from the first block and from the last (the backward's first runs hold
    their recomputed outputs while the most is live, so where the runs end matters)."""
    seams = sorted(seams)
    if not seams:
        return []
    last = seams[-1]
    out: dict[frozenset[int], None] = {}
    for every in SEAM_EVERY:
        out[frozenset(k for k in seams if k % every != every - 1)] = None
        out[frozenset(k for k in seams if (last - k) % every != 0)] = None
    return [p for p in out if p]


def outside_candidates(
    problem: Problem, inside: Iterable[str], saved: Iterable[str], recomputed: Iterable[str]
) -> list[tuple[float, str]]:
    """Values a plan saves outside the blocks (``inside``: every block's values) whose
    recomputation reads only values saved, recomputed anyway, or outside the blocks:
    ``(seconds per byte freed, name)``, cheapest first. Why: the chain keeps whatever the
    backward outside the blocks reads, yet some of it is a cast or a lookup that costs less per
    byte than any trade inside a block (Llama-70B: the head's bf16 weight, 524 MB for a 0.47 ms
    cast; the embedding's output, 134 MB for 0.36 ms)."""
    values = problem.by_name
    inside = set(inside)
    saved = set(saved)
    external = {v.name for v in problem.values if v.role is not Role.FORWARD}
    available = saved | set(recomputed) | external
    out: list[tuple[float, str]] = []
    for name in saved - inside:
        v = values[name]
        others = {s for n in saved if n != name for s in values[n].storages}
        own = problem.storages_bytes(set(v.storages) - others)
        if own == 0 or v.never_recomputed:
            continue
        try:
            again = recompute_closure(problem, [name], available - {name})
        except InvalidPlanError:
            continue
        if again & inside:
            continue
        out.append((sum(values[n].time_s for n in again) / own, name))
    return sorted(out)


def apply_seams(
    saved: Iterable[str],
    outputs: Mapping[int, str],
    swaps: Mapping[int, Swap | None],
) -> frozenset[str]:
    """``saved`` with each seam's output dropped and its swap saved (``swaps``: per dropped
    boundary, already in the block's names; None keeps the output)."""
    out = set(saved)
    for k, sw in swaps.items():
        if sw is None:
            continue
        out.discard(outputs[k])
        out |= sw.saved
    return frozenset(out)
