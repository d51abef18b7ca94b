"""A deep stack's native step from two shallow copies, so a 70B plan is not traced 121 times.

With one policy for every block (the fit's plans), block ``k`` of an ``L``-block step is the
same ops at every depth, and every byte count at one of its moments is affine in ``k`` and
``L``: the blocks before it hold their saved activations (``k`` times a block's), the blocks
after it have left their gradients (``L - 1 - k`` times), and the rest does not depend on
either. A few blocks at each end (:class:`Edges`) differ from the middle ones, and code
outside the blocks depends on ``L`` alone. Under FSDP2 the first two differ (as traced, the
second's backward ends without an allocation the middle ones' end with) and the last (it runs
next to the loss); so copies with 4 and 5 blocks determine every moment of the deep step: a middle
moment at ``k`` is ``v(4, 2) + (k - 2) * B + (L - 4) * C`` with ``B = v(5, 3) - v(5, 2)``
and ``C = v(5, 2) - v(4, 2)``, and since it is affine in ``k``, its maximum over the middle
blocks is at ``k = 2`` or ``k = L - 2``: those two moments stand for all of them. Each op's
time is counted once per block it runs in.

One block more (``C``) or one block further (``B``) adds, at each moment, either what a block
holds whatever the shape (its parameters' and gradients' shards) or that plus the activations
it saves (a block before the moment that has not run its backward): ``c + d * held`` with
``c`` a constant, ``d`` 0 or 1 and ``held`` the bytes a middle block saves at the shape. So
the larger copy is traced at two shapes of each range, which give every moment's ``c`` and
``d`` (:func:`increments`), and elsewhere synthesized from the smaller copy's trace there
(:func:`larger`); a moment the two shapes do not fit this way has the larger copy traced at
every shape.

Nothing here is trusted unchecked: the copies' steps must match op for op, and the caller
(:func:`remat.fit.sac_formula.native_dynamic`) compares the result with a trace of the deep
model itself at the example's shape; a mismatch falls back to tracing the deep model.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.executors.sac.events import OpEvent, StepTrace
from remat.fit.sac_shapes import Sample, moments
from remat.solver.chain_dp import ChainCosts, ChainCostsBuilder
from remat.solver.formula import FitError

__all__ = [
    "EDGES",
    "WIDE",
    "CopyStep",
    "Edges",
    "Increments",
    "deep_sample",
    "increments",
    "larger",
    "matched",
]


@dataclass(frozen=True)
class Edges:
    """How many blocks at each end of the stack differ from the middle ones: the copies have
    these and one middle block, then two."""

    head: int
    tail: int

    @property
    def copies(self) -> tuple[int, int]:
        """Blocks of the two copies."""
        return (self.head + self.tail + 1, self.head + self.tail + 2)

    @property
    def ends(self) -> tuple[object, ...]:
        """The positions whose moments do not repeat: outside the blocks, and the blocks at
        each end."""
        edge = (*range(self.head), *range(-self.tail, 0))
        return ("outside", *(("edge", k) for k in edge))

    def position(self, block: int, layers: int) -> object:
        """``outside``, ``("edge", k)`` for a block at either end (``k < 0`` from the end),
        or the index of a middle block."""
        if block < 0:
            return "outside"
        if block < self.head:
            return ("edge", block)
        if block >= layers - self.tail:
            return ("edge", block - layers)
        return block

    def middle(self, layers: int) -> range:
        """The middle blocks of a ``layers``-block stack."""
        return range(self.head, layers - self.tail)


EDGES = Edges(head=2, tail=1)
"""The edges of a stack under FSDP2 (module docstring), tried first (a stack without FSDP2
matches them too)."""
WIDE = Edges(head=2, tail=2)
"""The wider edges, for a stack whose block before the last differs from the middle ones too:
where the copies for :data:`EDGES` do not match."""

Key = tuple[object, ...]
Keyed = dict[object, list[tuple[Key, OpEvent]]]


def _keyed(
    trace: StepTrace, layers: int, edges: Edges, events: Sequence[OpEvent] | None = None
) -> Keyed:
    """The trace's moments (or ``events``) grouped by position (``first``, ``last``, a
    middle block's index, ``outside``), each keyed by its phase, op and ordinal there. An op
    outside the blocks after a block's ops (in the same phase) goes with that block: FSDP2's
    hooks of the next block run there, once per block."""
    out: Keyed = {}
    seen: Counter[tuple[object, str, bool]] = Counter()
    last: dict[str, int] = {}
    for e in moments(trace) if events is None else events:
        inside = e.block >= 0
        if inside:
            last[e.phase] = e.block
        owner = e.block if inside else last.get(e.phase, -1)
        pos = edges.position(owner, layers)
        n = seen[(pos, e.phase, inside)]
        seen[(pos, e.phase, inside)] += 1
        out.setdefault(pos, []).append(((e.phase, inside, e.recompute, e.op, e.key, n), e))
    return out


@dataclass(frozen=True)
class CopyStep:
    """A shallow copy's step as the extrapolation reads it: its moments (or every event) by
    position, the bytes each block saves, and its moments between ops where they are above
    every op's (else 0: a step's maximum is a different moment at each depth). Small enough
    to send back from a worker process."""

    blocks: int
    edges: Edges
    keyed: Keyed
    held: tuple[int, ...]
    unseen: int
    """Bytes allocated between ops that no dispatch saw, where above every op's; else 0."""
    live: int
    """Live storages between ops, where above every op's; else 0."""

    @staticmethod
    def of(trace: StepTrace, blocks: int, edges: Edges, *, every_event: bool = False) -> CopyStep:
        top = max(e.allocated_bytes for e in trace.events)
        top_tensors = max(e.tensor_bytes for e in trace.events)
        return CopyStep(
            blocks,
            edges,
            _keyed(trace, blocks, edges, trace.events if every_event else None),
            tuple(end - start for start, end in trace.forward_live),
            trace.unseen_peak_bytes if trace.unseen_peak_bytes > top else 0,
            trace.tensor_peak_bytes if trace.tensor_peak_bytes > top_tensors else 0,
        )


def _keys(events: Sequence[tuple[Key, OpEvent]]) -> list[Key]:
    return [k for k, _ in events]


def _check(what: str, a: Sequence[tuple[Key, OpEvent]], b: Sequence[tuple[Key, OpEvent]]) -> None:
    if _keys(a) != _keys(b):
        raise FitError(f"the shallow copies' steps differ in {what}: not a stack of equal blocks")


def _affine(
    v: OpEvent, deeper: OpEvent, extra: int, field: str, next_: OpEvent | None = None, k: int = 0
) -> int:
    """``v``'s ``field`` (bytes) ``extra`` blocks deeper, from its match one block deeper
    (``deeper``), and ``k`` blocks further into the middle, from ``deeper``'s next block
    (``next_``)."""
    further = k * (getattr(next_, field) - getattr(deeper, field)) if next_ is not None else 0
    return int(getattr(v, field) + extra * (getattr(deeper, field) - getattr(v, field)) + further)


def _copy_step(x: StepTrace | CopyStep, blocks: int, edges: Edges, every_event: bool) -> CopyStep:
    if isinstance(x, CopyStep):
        if (x.blocks, x.edges) != (blocks, edges):
            raise ValueError(f"a copy of {x.blocks} blocks by {x.edges}, not {blocks} by {edges}")
        return x
    return CopyStep.of(x, blocks, edges, every_event=every_event)


def matched(
    small: StepTrace | CopyStep,
    large: StepTrace | CopyStep,
    edges: Edges,
    *,
    every_event: bool = False,
) -> tuple[CopyStep, CopyStep]:
    """The copies' moments (``every_event``: all their events) by position, checked to
    match op for op, and that their blocks save the same bytes (the larger's one more middle
    block); :class:`FitError` where they do not."""
    pair = zip((small, large), edges.copies, strict=True)
    s, g = (_copy_step(x, n, edges, every_event) for x, n in pair)
    for pos in edges.ends:
        _check(f"{pos}", s.keyed.get(pos, []), g.keyed.get(pos, []))
    h = edges.head
    for k in (h, h + 1):
        _check(f"middle block {k}", s.keyed[h], g.keyed[k])
    if list(g.held) != [*s.held[: h + 1], *s.held[h:]]:
        raise FitError("the shallow copies' blocks save different bytes: not equal blocks")
    return s, g


Slot = tuple[object, int]
"""A moment of the larger copy: its position (one of :attr:`Edges.ends`, or its two middle
blocks ``head`` and ``head + 1``) and its index there."""
Increment = tuple[int, int, int, int]
"""``(c, d)`` at the allocator, then ``(c, d)`` as tensors: the larger copy's bytes at a slot
are the smaller's plus ``c + d * held`` (its middle block ``head + 1`` over its ``head``)."""
Increments = Mapping[Slot, Increment]


def _bases(s: CopyStep, g: CopyStep) -> dict[Slot, tuple[OpEvent, OpEvent]]:
    """Each slot's event in the larger copy and the one it adds to."""
    out = {}
    for pos in s.edges.ends:
        for i, ((_, e), (_, f)) in enumerate(
            zip(s.keyed.get(pos, []), g.keyed.get(pos, []), strict=True)
        ):
            out[(pos, i)] = (e, f)
    h = s.edges.head
    for i, ((_, e), (_, f1), (_, f2)) in enumerate(
        zip(s.keyed[h], g.keyed[h], g.keyed[h + 1], strict=True)
    ):
        out[(h, i)] = (e, f1)
        out[(h + 1, i)] = (f1, f2)
    return out


def increments(
    anchors: Sequence[tuple[CopyStep, CopyStep]],
) -> Increments | None:
    """Every slot's increment from both copies traced at two shapes (``(small, large)``
    each), or None where they do not give one: the middle block saves the same bytes at
    both, a slot's difference grows by other than 0 or a block's saved bytes, or a moment
    between ops is above every op's."""
    (s1, g1), (s2, g2) = (matched(s, g, s.edges) for s, g in anchors)
    h1, h2 = s1.held[s1.edges.head], s2.held[s2.edges.head]
    if h1 == h2 or any((x.unseen, x.live) != (0, 0) for x in (s1, g1, s2, g2)):
        return None
    one, two = _bases(s1, g1), _bases(s2, g2)
    if one.keys() != two.keys():
        return None
    out: dict[Slot, Increment] = {}
    for slot, (e1, f1) in one.items():
        e2, f2 = two[slot]
        pair: list[int] = []
        for field in ("allocated_bytes", "tensor_bytes"):
            d1 = getattr(f1, field) - getattr(e1, field)
            d2 = getattr(f2, field) - getattr(e2, field)
            if d2 - d1 == 0:
                pair += [d1, 0]
            elif d2 - d1 == h2 - h1:
                pair += [d1 - h1, 1]
            else:
                return None
        out[slot] = (pair[0], pair[1], pair[2], pair[3])
    return out


def larger(small: CopyStep, inc: Increments) -> CopyStep | None:
    """The larger copy's step at ``small``'s shape, from ``small`` and the slots'
    increments; None where ``small`` has a moment between ops above every op's (which the
    increments do not carry)."""
    if small.unseen or small.live:
        return None
    edges, head = small.edges, small.edges.head
    h = small.held[head]

    def add(e: OpEvent, slot: Slot) -> OpEvent:
        ca, da, ct, dt = inc[slot]
        return dataclasses.replace(
            e,
            allocated_bytes=e.allocated_bytes + ca + da * h,
            tensor_bytes=e.tensor_bytes + ct + dt * h,
        )

    keyed: Keyed = {}
    for pos in edges.ends:
        if pos in small.keyed:
            keyed[pos] = [(k, add(e, (pos, i))) for i, (k, e) in enumerate(small.keyed[pos])]
    first = [(k, add(e, (head, i))) for i, (k, e) in enumerate(small.keyed[head])]
    keyed[head] = first
    keyed[head + 1] = [(k, add(e, (head + 1, i))) for i, (k, e) in enumerate(first)]
    held = (*small.held[: head + 1], *small.held[head:])
    return CopyStep(edges.copies[1], edges, keyed, held, 0, 0)


def deep_sample(
    small: StepTrace | CopyStep, large: StepTrace | CopyStep, layers: int, edges: Edges
) -> Sample:
    """The ``layers``-block step at one shape from its copies' traces there
    (``edges.copies`` blocks)."""
    n_small, n_large = edges.copies
    if layers <= n_large:
        raise ValueError(f"a deep stack has more than {n_large} blocks, not {layers}")
    sc, gc = matched(small, large, edges)
    s, g, held = sc.keyed, gc.keyed, sc.held
    head, middle = edges.head, s[edges.head]
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
        for pos in edges.ends
        for (key, e), (_, f) in zip(s.get(pos, []), g.get(pos, []), strict=True)
    ]
    for (key, e), (_, f1), (_, f2) in zip(middle, g[head], g[head + 1], strict=True):
        for k in (head, edges.middle(layers)[-1]):
            moments_.append(
                extrapolated(f"{e.phase}:block {k}:{e.op}#{key[-1]}", e, f1, f2, k - head)
            )

    def affine(t: tuple[int, int]) -> int:
        return t[0] + extra * (t[1] - t[0]) if any(t) else 0

    between = (
        ("between ops: unseen allocations", affine((sc.unseen, gc.unseen)), False),
        ("between ops: live storages", affine((sc.live, gc.live)), True),
    )
    ops: list[OpEvent] = []
    weights: list[int] = []
    for pos in [*edges.ends, head]:
        weight = len(edges.middle(layers)) if pos == head else 1
        for _, e in s.get(pos, []):
            ops.append(e)
            weights.append(weight)
    peak = max([m[1] for m in moments_] + [b[1] for b in between])
    tensor_peak = max([m[2] for m in moments_] + [b[1] for b in between if b[2]])
    return Sample(
        moments=tuple(moments_),
        between=between,
        ops=tuple(ops),
        weights=tuple(weights),
        saved=sum(held) + (layers - n_small) * held[head],
        peak=peak,
        tensor_peak=tensor_peak,
    )


def deep_costs(small: StepTrace, large: StepTrace, layers: int, edges: Edges) -> ChainCosts:
    """:func:`remat.executors.sac.planner.costs` of the ``layers``-region step under one policy for
    every region (a uniform plan of the chain DP), from its copies' traces under it. Every
    event is extrapolated (views too: a block's first op can hold its peak), as
    :func:`deep_sample` does the moments: the regions at the ends, and each middle region
    ``k``."""
    sc, gc = matched(small, large, edges, every_event=True)
    s, g, held = sc.keyed, gc.keyed, sc.held
    head, tail, inner = edges.head, edges.tail, edges.middle(layers)
    costs = ChainCostsBuilder([*held[:head], *[held[head]] * len(inner), *held[-tail:]])
    extra = layers - edges.copies[0]
    source: dict[int, int] = {}
    """Region of the deep step -> the small copy's region it is read from."""

    def add(e: OpEvent, region: int, value: int, pos: object) -> None:
        region = region if e.block >= 0 else -1
        costs.add(e.phase, region, value, before_regions=pos == "outside")
        if e.recompute:
            costs.recompute(region, e.time_s)
        if region >= 0:
            source.setdefault(region, e.block)

    for pos in edges.ends:
        region = -1
        if isinstance(pos, tuple):
            k = int(pos[1])
            region = k if k >= 0 else layers + k
        for (_, e), (_, f) in zip(s.get(pos, []), g.get(pos, []), strict=True):
            add(e, region, _affine(e, f, extra, "allocated_bytes"), pos)
    for (_, e), (_, f1), (_, f2) in zip(s[head], g[head], g[head + 1], strict=True):
        for k in inner:
            add(e, k, _affine(e, f1, extra, "allocated_bytes", f2, k - head), head)
    if small.dispatch_s:  # a policy's dispatch does not grow with the depth
        for region, block in source.items():
            costs.recompute(region, small.dispatch_s[block])
    return costs.costs()
