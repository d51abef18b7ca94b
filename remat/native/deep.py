"""A deep stack's native step from two shallow copies, so a 70B plan is not traced 121 times.

With one policy for every block (the fit's plans), block ``k`` of an ``L``-block step is the
same ops at every depth, and every byte count at one of its moments is affine in ``k`` and
``L``: the blocks before it hold their saved activations (``k`` times a block's), the blocks
after it have left their gradients (``L - 1 - k`` times), and the rest does not depend on
either. The :data:`EDGE` blocks at each end differ from the middle ones (FSDP2 prefetches the
next block's parameters in a block's forward and reduces the previous one's gradients in its
backward, so a block's ops depend on its neighbours'; the last runs next to the loss), and
code outside the blocks depends on ``L`` alone. So copies with 5 and 6 blocks determine every
moment of the deep step: a middle moment at ``k`` is ``v(5, 2) + (k - 2) * B + (L - 5) * C``
with ``B = v(6, 3) - v(6, 2)`` and ``C = v(6, 2) - v(5, 2)``, and since it is affine in ``k``,
its maximum over the middle blocks is at ``k = 2`` or ``k = L - 3``: those two moments stand
for all of them. Each op's time is counted once per block it runs in.

Nothing here is trusted unchecked: the copies' steps must match op for op, and the caller
(:func:`remat.native.formula.native_dynamic`) compares the result with a trace of the deep
model itself at the example's shape; a mismatch falls back to tracing the deep model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from remat.native.dynamic import Sample, moments
from remat.native.trace import OpEvent, StepTrace
from remat.solver.chain import ChainCosts, ChainCostsBuilder
from remat.solver.formula import FitError

__all__ = ["EDGE", "SHALLOW", "deep_sample"]

EDGE = 2
"""Blocks at each end of the stack that differ from the middle ones."""
SHALLOW = (2 * EDGE + 1, 2 * EDGE + 2)
"""Blocks of the two copies: one middle block, then two."""

Key = tuple[object, ...]


def _position(block: int, layers: int) -> object:
    """``outside``, ``("edge", k)`` for the first and last :data:`EDGE` blocks (``k < 0``
    from the end), or the index of a middle block."""
    if block < 0:
        return "outside"
    if block < EDGE:
        return ("edge", block)
    if block >= layers - EDGE:
        return ("edge", block - layers)
    return block


def _keyed(
    trace: StepTrace, layers: int, events: Sequence[OpEvent] | None = None
) -> dict[object, list[tuple[Key, OpEvent]]]:
    """The trace's moments (or ``events``) grouped by position (``first``, ``last``, a
    middle block's index, ``outside``), each keyed by its phase, op and ordinal there. An op
    outside the blocks after a block's ops (in the same phase) goes with that block: FSDP2's
    hooks of the next block run there, once per block."""
    out: dict[object, list[tuple[Key, OpEvent]]] = {}
    seen: Counter[tuple[object, str, bool]] = Counter()
    last: dict[str, int] = {}
    for e in moments(trace) if events is None else events:
        inside = e.block >= 0
        if inside:
            last[e.phase] = e.block
        owner = e.block if inside else last.get(e.phase, -1)
        pos = _position(owner, layers)
        n = seen[(pos, e.phase, inside)]
        seen[(pos, e.phase, inside)] += 1
        out.setdefault(pos, []).append(((e.phase, inside, e.recompute, e.op, e.key, n), e))
    return out


def _keys(events: Sequence[tuple[Key, OpEvent]]) -> list[Key]:
    return [k for k, _ in events]


def _check(what: str, a: Sequence[tuple[Key, OpEvent]], b: Sequence[tuple[Key, OpEvent]]) -> None:
    if _keys(a) != _keys(b):
        raise FitError(f"the shallow copies' steps differ in {what}: not a stack of equal blocks")


ENDS: tuple[object, ...] = ("outside", *(("edge", k) for k in (*range(EDGE), *range(-EDGE, 0))))
"""The positions whose moments do not repeat: outside the blocks, and the blocks at each end."""


def _affine(
    v: OpEvent, deeper: OpEvent, extra: int, field: str, next_: OpEvent | None = None, k: int = 0
) -> int:
    """``v``'s ``field`` (bytes) ``extra`` blocks deeper, from its match one block deeper
    (``deeper``), and ``k`` blocks further into the middle, from ``deeper``'s next block
    (``next_``)."""
    further = k * (getattr(next_, field) - getattr(deeper, field)) if next_ is not None else 0
    return int(getattr(v, field) + extra * (getattr(deeper, field) - getattr(v, field)) + further)


def _matched(
    small: StepTrace, large: StepTrace, *, every_event: bool
) -> tuple[
    dict[object, list[tuple[Key, OpEvent]]], dict[object, list[tuple[Key, OpEvent]]], list[int]
]:
    """The copies' moments (``every_event``: all their events) by position, checked to
    match op for op, and the bytes each of the smaller copy's blocks saves (the larger's
    must be the same with one more middle block)."""
    n_small, n_large = SHALLOW
    s = _keyed(small, n_small, small.events if every_event else None)
    g = _keyed(large, n_large, large.events if every_event else None)
    for pos in ENDS:
        _check(f"{pos}", s.get(pos, []), g.get(pos, []))
    for k in (EDGE, EDGE + 1):
        _check(f"middle block {k}", s[EDGE], g[k])
    held = [end - start for start, end in small.forward_live]
    if [end - start for start, end in large.forward_live] != [*held[: EDGE + 1], *held[EDGE:]]:
        raise FitError("the shallow copies' blocks save different bytes: not equal blocks")
    return s, g, held


def deep_sample(small: StepTrace, large: StepTrace, layers: int) -> Sample:
    """The ``layers``-block step at one shape from its copies' traces there
    (:data:`SHALLOW` blocks)."""
    n_small, n_large = SHALLOW
    if layers <= n_large:
        raise ValueError(f"a deep stack has more than {n_large} blocks, not {layers}")
    s, g, held = _matched(small, large, every_event=False)
    middle = s[EDGE]
    extra = layers - n_small

    def label(pos: object) -> str:
        if isinstance(pos, tuple):
            k = int(pos[1])
            return f"block {k if k >= 0 else layers + k}"
        return str(pos)

    def extrapolated(
        name: str, v: OpEvent, deeper: OpEvent, next_: OpEvent | None = None, k: int = 0
    ) -> tuple[str, int, int]:
        """``v``'s bytes, at the allocator and as tensors, deeper (:func:`_affine`)."""
        return (
            name,
            _affine(v, deeper, extra, "allocated_bytes", next_, k),
            _affine(v, deeper, extra, "tensor_bytes", next_, k),
        )

    moments_ = [
        extrapolated(f"{e.phase}:{label(pos)}:{e.op}#{key[-1]}", e, f)
        for pos in ENDS
        for (key, e), (_, f) in zip(s.get(pos, []), g.get(pos, []), strict=True)
    ]
    for (key, e), (_, f1), (_, f2) in zip(middle, g[EDGE], g[EDGE + 1], strict=True):
        for k in (EDGE, layers - EDGE - 1):
            moments_.append(
                extrapolated(f"{e.phase}:block {k}:{e.op}#{key[-1]}", e, f1, f2, k - EDGE)
            )

    def between_ops(t: StepTrace, value: int, tensor: bool) -> int:
        """``value`` where it is a moment of its own (above every op's), else 0: a step's
        maximum is a different moment at each depth and does not extrapolate."""
        top = max((e.tensor_bytes if tensor else e.allocated_bytes) for e in t.events)
        return value if value > top else 0

    def affine(t: tuple[int, ...]) -> int:
        return t[0] + extra * (t[1] - t[0]) if any(t) else 0

    unseen = tuple(between_ops(t, t.unseen_peak_bytes, False) for t in (small, large))
    live = tuple(between_ops(t, t.tensor_peak_bytes, True) for t in (small, large))
    between = (
        ("between ops: unseen allocations", affine(unseen), False),
        ("between ops: live storages", affine(live), True),
    )
    ops: list[OpEvent] = []
    weights: list[int] = []
    for pos in [*ENDS, EDGE]:
        weight = layers - 2 * EDGE if pos == EDGE else 1
        for _, e in s.get(pos, []):
            ops.append(e)
            weights.append(weight)
    peak = max([m[1] for m in moments_] + [b[1] for b in between])
    tensor_peak = max([m[2] for m in moments_] + [b[1] for b in between if b[2]])
    return Sample(
        tuple(moments_),
        between,
        tuple(ops),
        tuple(weights),
        sum(held) + (layers - n_small) * held[EDGE],
        peak,
        tensor_peak,
    )


def deep_costs(small: StepTrace, large: StepTrace, layers: int) -> ChainCosts:
    """:func:`remat.native.planner.costs` of the ``layers``-region step under one policy for
    every region (a uniform plan of the chain DP), from its copies' traces under it. Every
    event is extrapolated (views too: a block's first op can hold its peak), as
    :func:`deep_sample` does the moments: the regions at the ends, and each middle region
    ``k``."""
    s, g, held = _matched(small, large, every_event=True)
    costs = ChainCostsBuilder([*held[:EDGE], *[held[EDGE]] * (layers - 2 * EDGE), *held[-EDGE:]])
    extra = layers - SHALLOW[0]

    def add(e: OpEvent, region: int, value: int, pos: object) -> None:
        region = region if e.block >= 0 else -1
        costs.add(e.phase, region, value, before_regions=pos == "outside")
        if e.recompute:
            costs.recompute(region, e.time_s)

    for pos in ENDS:
        region = -1
        if isinstance(pos, tuple):
            k = int(pos[1])
            region = k if k >= 0 else layers + k
        for (_, e), (_, f) in zip(s.get(pos, []), g.get(pos, []), strict=True):
            add(e, region, _affine(e, f, extra, "allocated_bytes"), pos)
    for (_, e), (_, f1), (_, f2) in zip(s[EDGE], g[EDGE], g[EDGE + 1], strict=True):
        for k in range(EDGE, layers - EDGE):
            add(e, k, _affine(e, f1, extra, "allocated_bytes", f2, k - EDGE), EDGE)
    return costs.costs()
