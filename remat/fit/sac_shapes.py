"""A native plan's memory at every shape: its step traced at a few shapes, every moment fitted.

The ``sac`` executor's memory is not simulated but measured, by running PyTorch's checkpoint
on FakeTensors (:mod:`remat.executors.sac.trace`); so its formula comes from traces. The same
policies are traced at the shapes of :func:`remat.fit.graph_shapes.range_shapes`, and the bytes
of every moment of the step (each op's allocation, at the allocator and as live storages) are
fitted exactly as polynomials in batch and sequence length (:class:`remat.solver.formula.Fitter`)
and checked at the shapes they were not fitted on. A policy names ops, not sizes, so the step
runs the same ops at every shape; where it does not (a model that branches on a size),
:class:`FitError` says where. The peak is the maximum of the moments that can hold it
(:func:`remat.solver.formula.peak_candidates`); each op's FLOPs and bytes moved are fitted
too, for its roofline time at any shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from math import lcm
from typing import Any

import torch

from remat.executors.sac.events import OpEvent, StepTrace
from remat.executors.sac.regions import Policy
from remat.fit.graph_shapes import Dims, RangeShapes, range_shapes
from remat.fit.peak import RangeFormula
from remat.fit.workers import Mapped, mapped
from remat.measure.profiles import DeviceProfile
from remat.solver.formula import FitError, Fitter, Monomial, Poly, StepPolynomials
from remat.solver.formula import peak_candidates as _candidates

__all__ = [
    "NativeDynamic",
    "NativeRange",
    "NativeStep",
    "Sample",
    "moments",
    "sample_of",
    "schedule_sample",
    "collected",
    "fitted",
    "started",
    "trace_dynamic",
]

SampleAt = Callable[[int, int | None, str, Sequence[Policy]], "Sample"]
"""The step at batch ``b`` and length ``s`` (None: no sequence) under the named plan (one
policy per block): traced (:func:`sample_of`), or synthesized from shallow copies."""


@dataclass(frozen=True)
class NativeStep:
    """One plan's step over one range of shapes: its peak, and its ops' costs."""

    peak: RangeFormula
    monomials: tuple[Monomial, ...]
    flops: torch.Tensor
    """Per op, its FLOPs' coefficients over ``monomials`` (float64: for times, not bytes)."""
    moved: torch.Tensor
    """Per op, the coefficients of the bytes it moves."""
    dtypes: tuple[str, ...]
    timed: torch.Tensor
    """Per op, whether it launches a kernel (a view takes no time)."""
    recompute: torch.Tensor
    """Per op, whether it is a recomputation."""
    weights: torch.Tensor
    """Per op, how many times the step runs it (a deep stack's middle layers' ops stand for
    all of them, :mod:`remat.fit.deep`)."""

    def times(self, profile: DeviceProfile, b: int, s: int | None) -> torch.Tensor:
        """Each op's roofline seconds at ``(b, s)``, as the trace times it."""
        x = torch.tensor(
            [float(b**i * (s or 0) ** j) for i, j in self.monomials], dtype=torch.float64
        )
        flops, moved = self.flops @ x, self.moved @ x
        rate = torch.tensor([profile.flops_per_s(d) for d in self.dtypes], dtype=torch.float64)
        t = torch.maximum(flops / rate, moved / profile.bandwidth) + profile.op_overhead_s
        return torch.where(self.timed, t, torch.zeros_like(t)) * self.weights

    def recompute_pct(self, profile: DeviceProfile, b: int, s: int | None) -> float:
        t = self.times(profile, b, s)
        step = float(t.sum())
        return 100 * float(t[self.recompute].sum()) / step if step else 0.0


@dataclass(frozen=True)
class NativeRange:
    """Every plan's step over one range of shapes."""

    shapes: RangeShapes
    steps: Mapping[str, NativeStep]

    def contains(self, b: int, s: int | None) -> bool:
        return next(iter(self.steps.values())).peak.contains(b, s)


@dataclass(frozen=True)
class NativeDynamic:
    ranges: tuple[NativeRange, ...]
    dims: Dims
    policies: Mapping[str, tuple[Policy, ...]]
    """Each plan's policy per block."""

    def range_of(self, b: int, s: int | None) -> NativeRange | None:
        return next((r for r in self.ranges if r.contains(b, s)), None)


def trace_dynamic(
    sample_at: SampleAt,
    plans: Mapping[str, Sequence[Policy]],
    dims: Dims,
    *,
    max_seq: int | None = None,
    batch: int | None = None,
    progress: Callable[[str], None] | None = None,
    workers: int | None = 1,
) -> NativeDynamic:
    """Every plan of ``plans`` (name -> one policy per block) traced at the shapes of each
    range and fitted (module docstring). ``workers``: processes tracing at once
    (:func:`remat.fit.workers.mapped`; None: one per core where the traces take long)."""
    has_seq = dims.seq is not None
    ranges = range_shapes(dims, max_seq=max_seq, batch=batch)
    units = [
        (b, s if has_seq else None, name, tuple(policies))
        for r in ranges
        for b, s in (*r.fit, *r.check)
        for name, policies in plans.items()
    ]
    traced = collected(started(sample_at, units, workers, progress), units, progress, has_seq)
    samples = {(b, s, name): x for (b, s, name, _), x in zip(units, traced, strict=True)}
    return fitted(ranges, plans, dims, samples)


def started(
    work: Callable[..., Any],
    units: Sequence[tuple[Any, ...]],
    workers: int | None,
    progress: Callable[[str], None] | None,
) -> Mapped:
    """``work(*unit)`` for each unit on ``workers`` processes
    (:func:`remat.fit.workers.mapped`), started."""

    def announce(count: int) -> None:
        if progress:
            progress(f"tracing {len(units)} steps on {count} processes")

    return mapped(work, units, workers, announce)


def collected(
    results: Mapped,
    units: Sequence[tuple[Any, ...]],
    progress: Callable[[str], None] | None,
    has_seq: bool,
    on: Callable[[tuple[Any, ...]], str] | None = None,
) -> list[Any]:
    """The results of :func:`started` for units ``(b, s, name, ...)``, each announced as it
    comes; ``on(unit)`` says what it was traced on (" on the 5-block copy")."""
    out = []
    with results:
        for k, x in enumerate(results):
            out.append(x)
            if progress:
                b, s, name = units[k][:3]
                where = f"b={b}" + (f", s={s}" if has_seq else "")
                what = on(units[k]) if on is not None else ""
                progress(f"traced {name}{what} at {where} ({k + 1} of {len(units)})")
    return out


def fitted(
    ranges: Sequence[RangeShapes],
    plans: Mapping[str, Sequence[Policy]],
    dims: Dims,
    samples: Mapping[tuple[int, int | None, str], Sample],
) -> NativeDynamic:
    """Every plan's samples (by ``(b, s, name)``, ``s`` None without a sequence) at the
    shapes of each range, fitted."""
    has_seq = dims.seq is not None
    out = []
    for r in ranges:
        shapes = (*r.fit, *r.check)
        steps = {
            name: _fit_step(
                name, r, shapes, [samples[(b, s if has_seq else None, name)] for b, s in shapes]
            )
            for name in plans
        }
        out.append(NativeRange(r, steps))
    return NativeDynamic(tuple(out), dims, {n: tuple(p) for n, p in plans.items()})


@dataclass(frozen=True)
class Sample:
    """One plan's step at one shape, as the fit reads it: a traced step
    (:func:`sample_of`), or one synthesized for a deeper stack (:mod:`remat.fit.deep`)."""

    moments: tuple[tuple[str, int, int], ...]
    """``(name, allocator bytes, tensor bytes)`` of each moment that can hold the peak."""
    between: tuple[tuple[str, int, bool], ...]
    """``(label, allocator bytes, also a tensor moment)`` of moments between ops."""
    ops: tuple[OpEvent, ...]
    """The ops whose times the step sums, each ``weights[k]`` times."""
    weights: tuple[int, ...]
    saved: int
    """Bytes the forward leaves to the backward."""
    peak: int
    tensor_peak: int


def schedule_sample(trace: StepTrace) -> Sample:
    """A pipeline stage's step as the fit reads it: the moments of its whole
    ``schedule.step()`` (traced with ``schedule_events``), which hold its peak; the ops and
    saved bytes of one microbatch's step, which every microbatch repeats (a recompute share
    is the same over one as over all)."""
    sched = trace.schedule
    if sched is None or not sched.events:
        raise ValueError("trace the stage with schedule_events=True")
    one = sample_of(trace)
    return replace(
        one,
        moments=tuple(
            (event_name(trace, e), e.allocated_bytes, e.tensor_bytes)
            for e in sched.events
            if e.moved_bytes or e.new_bytes or e.scratch_bytes
        ),
        between=(
            ("between ops: unseen allocations", sched.unseen_peak_bytes, False),
            ("between ops: live storages", sched.tensor_peak_bytes, True),
        ),
        peak=sched.peak_bytes,
        tensor_peak=sched.tensor_peak_bytes,
    )


def _signature(e: OpEvent) -> tuple[object, ...]:
    return (e.op, e.phase, e.block, e.recompute, e.key)


def moments(trace: StepTrace) -> list[OpEvent]:
    """The ops that move bytes or allocate. The others (views, ``prim`` queries) are left
    out: their bytes are those after the op before them, less what was freed since (what is
    allocated between ops is the trace's ``unseen_peak_bytes``), so they never hold the peak;
    and whether they run can depend on a size (indexing ``x[:, :s]`` skips the slice where
    ``s`` is the whole dimension)."""
    return [e for e in trace.events if e.moved_bytes or e.new_bytes or e.scratch_bytes]


def event_name(trace: StepTrace, e: OpEvent) -> str:
    where = trace.blocks[e.block] if e.block >= 0 else "outside"
    return f"{e.phase}:{where}:{e.op}" + (" (recompute)" if e.recompute else "")


def sample_of(trace: StepTrace) -> Sample:
    events = moments(trace)
    return Sample(
        moments=tuple((event_name(trace, e), e.allocated_bytes, e.tensor_bytes) for e in events),
        between=(
            ("between ops: unseen allocations", trace.unseen_peak_bytes, False),
            ("between ops: live storages", trace.tensor_peak_bytes, True),
        ),
        ops=tuple(events),
        weights=(1,) * len(events),
        saved=sum(end - start for start, end in trace.forward_live),
        peak=trace.peak_bytes,
        tensor_peak=trace.tensor_peak_bytes,
    )


def _check_same_ops(name: str, shapes: Sequence[tuple[int, int]], samples: list[Sample]) -> None:
    def sig(x: Sample) -> list[object]:
        return [m[0] for m in x.moments] + [_signature(e) for e in x.ops]

    ref = sig(samples[0])
    for (b, s), x in zip(shapes[1:], samples[1:], strict=True):
        got = sig(x)
        if got == ref:
            continue
        k = next(
            (i for i, (p, q) in enumerate(zip(ref, got, strict=False)) if p != q),
            min(len(ref), len(got)),
        )
        what = f"{ref[k]}" if k < len(ref) else "its end"
        raise FitError(
            f"plan {name!r}: the step runs other ops at b={b}, s={s} than at b={shapes[0][0]}, "
            f"s={shapes[0][1]}, from {what}: the model branches on a size. Plan each shape "
            "separately."
        )


class _Rows:
    """Fits many quantities sampled at the same shapes in integer arithmetic: coefficient
    rows over ``basis``, divided by ``scale``, checked at the check shapes."""

    def __init__(self, r: RangeShapes) -> None:
        self.fitter = Fitter.over(list(r.fit))
        self.scale = lcm(1, *(c.denominator for row in self.fitter.inverse for c in row))
        self.inverse = [[int(c * self.scale) for c in row] for row in self.fitter.inverse]
        self.n_fit = len(r.fit)
        self.check = r.check
        self._done: dict[tuple[int, ...], tuple[int, ...]] = {}

    @property
    def basis(self) -> tuple[Monomial, ...]:
        return self.fitter.basis

    def __call__(self, samples: tuple[int, ...], what: Callable[[], str]) -> tuple[int, ...]:
        row = self._done.get(samples)
        if row is not None:
            return row
        fit = samples[: self.n_fit]
        row = tuple(sum(c * v for c, v in zip(inv, fit, strict=True)) for inv in self.inverse)
        for (b, s), got in zip(self.check, samples[self.n_fit :], strict=True):
            value = sum(c * b**i * s**j for c, (i, j) in zip(row, self.basis, strict=True))
            if value != got * self.scale:
                poly = self.poly(row)
                raise FitError(
                    f"{what()} is not a polynomial of degree <= 2 in s (1 in b): fitted {poly}, "
                    f"which gives {poly(b, s)} at b={b}, s={s}, where the trace has {got}"
                )
        self._done[samples] = row
        return row

    def poly(self, row: Sequence[int]) -> Poly:
        return Poly.of({m: Fraction(c, self.scale) for m, c in zip(self.basis, row, strict=True)})


def _fit_step(
    name: str, r: RangeShapes, shapes: Sequence[tuple[int, int]], samples: list[Sample]
) -> NativeStep:
    _check_same_ops(name, shapes, samples)
    rows = _Rows(r)
    first = samples[0]

    def fitted(what: str, values: Sequence[int]) -> tuple[int, ...]:
        return rows(tuple(values), functools.partial(str, f"plan {name!r}: {what}"))

    names = [m[0] for m in first.moments]
    per_moment = list(zip(*(x.moments for x in samples), strict=True))
    allocated = [fitted(f"the bytes at {names[k]}", [m[1] for m in ms])
                 for k, ms in enumerate(per_moment)]  # fmt: skip
    tensors = [fitted(f"the tensor bytes at {names[k]}", [m[2] for m in ms])
               for k, ms in enumerate(per_moment)]  # fmt: skip
    # Moments between ops, where they exceed every op's at some shape.
    extra_alloc: list[tuple[str, tuple[int, ...]]] = []
    extra_tensor: list[tuple[str, tuple[int, ...]]] = []
    for j, (label, _, tensor) in enumerate(first.between):
        values = [x.between[j][1] for x in samples]
        tops = [max(m[2] if tensor else m[1] for m in x.moments) for x in samples]
        if any(v > top for v, top in zip(values, tops, strict=True)):
            row = fitted(label, values)
            extra_alloc.append((label, row))
            if tensor:
                extra_tensor.append((label, row))
    saved = fitted("the bytes the forward saves", [x.saved for x in samples])

    def polys(base: list[tuple[int, ...]], extra: list[tuple[str, tuple[int, ...]]]) -> Any:
        return StepPolynomials(
            rows.basis,
            rows.scale,
            (*names, *(n for n, _ in extra)),
            (*base, *(row for _, row in extra)),
            rows.poly(saved),
        )

    b_min, s_min = r.b_range[0], r.s_range[0] or 0
    peak = RangeFormula(
        b_min=r.b_range[0],
        b_max=r.b_range[1],
        s_min=r.s_range[0],
        s_max=r.s_range[1],
        candidates=tuple(_candidates(polys(allocated, extra_alloc), b_min, s_min)),
        saved=rows.poly(saved),
        tensor_candidates=tuple(_candidates(polys(tensors, extra_tensor), b_min, s_min)),
    )
    for (b, s), x in zip(shapes, samples, strict=True):
        got = (peak.peak(b, s)[0], peak.peak(b, s, tensors=True)[0])
        if got != (x.peak, x.tensor_peak):
            raise FitError(
                f"plan {name!r} at b={b}, s={s}: the fitted peaks {got} are not the step's "
                f"{(x.peak, x.tensor_peak)}"
            )
    per_op = list(zip(*(x.ops for x in samples), strict=True))
    return NativeStep(
        peak=peak,
        monomials=rows.basis,
        flops=_float_rows(rows, per_op, "flops", name),
        moved=_float_rows(rows, per_op, "moved_bytes", name),
        dtypes=tuple(e.dtype for e in first.ops),
        timed=torch.tensor([e.time_s > 0 for e in first.ops]),
        recompute=torch.tensor([e.recompute for e in first.ops]),
        weights=torch.tensor(first.weights, dtype=torch.float64),
    )


def _float_rows(
    rows: _Rows, per_op: list[tuple[OpEvent, ...]], field: str, name: str
) -> torch.Tensor:
    """``field`` of every op as float coefficient rows (exactly fitted, then rounded)."""

    def what(k: int) -> Callable[[], str]:
        e = per_op[k][0]
        return lambda: f"plan {name!r}: {field} of op {k} ({e.op}, {e.phase})"

    fitted = [
        [float(c) for c in rows(tuple(getattr(x, field) for x in es), what(k))]
        for k, es in enumerate(per_op)
    ]
    return torch.tensor(fitted, dtype=torch.float64).reshape(len(per_op), -1) / rows.scale
