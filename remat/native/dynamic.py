"""A native plan's memory at every shape: its step traced at a few shapes, every moment fitted.

The ``sac`` executor's memory is not simulated but measured, by running PyTorch's checkpoint
on FakeTensors (:mod:`remat.native.trace`); so its formula comes from traces. The same
policies are traced at the shapes of :func:`remat.graph.dynamic.range_shapes`, and the bytes
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
from dataclasses import dataclass
from fractions import Fraction
from math import lcm
from typing import Any

import torch
from torch import nn

from remat.budget import StaticMemory
from remat.graph.dynamic import Dims, RangeShapes, inputs_at, range_shapes
from remat.graph.profiles import DeviceProfile, get_profile
from remat.native import regions
from remat.native.api import analyze, kv_cache_off
from remat.native.planner import NATIVE_PLANS, NativeProblem, fixed_policies, uniform_plans
from remat.native.regions import Policy
from remat.native.trace import OpEvent, StepTrace
from remat.peak_formula import MemoryFormula, RangeFormula
from remat.request import Request, resolve_profile
from remat.solver.formula import FitError, Fitter, Monomial, Poly, StepPolynomials
from remat.solver.formula import peak_candidates as _candidates

__all__ = [
    "NativeDynamic",
    "NativeRange",
    "NativeStep",
    "formula_of",
    "native_dynamic",
    "trace_dynamic",
]

TraceAt = Callable[[int, int | None, Sequence[Policy]], StepTrace]
"""Traces the step at batch ``b`` and length ``s`` (None: no sequence) with one policy per
block."""


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

    def times(self, profile: DeviceProfile, b: int, s: int | None) -> torch.Tensor:
        """Each op's roofline seconds at ``(b, s)``, as the trace times it."""
        x = torch.tensor(
            [float(b**i * (s or 0) ** j) for i, j in self.monomials], dtype=torch.float64
        )
        flops, moved = self.flops @ x, self.moved @ x
        rate = torch.tensor([profile.flops_per_s(d) for d in self.dtypes], dtype=torch.float64)
        t = torch.maximum(flops / rate, moved / profile.bandwidth) + profile.op_overhead_s
        return torch.where(self.timed, t, torch.zeros_like(t))

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
    trace_at: TraceAt,
    plans: Mapping[str, Sequence[Policy]],
    dims: Dims,
    *,
    max_seq: int | None = None,
    batch: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> NativeDynamic:
    """Every plan of ``plans`` (name -> one policy per block) traced at the shapes of each
    range and fitted (module docstring)."""
    has_seq = dims.seq is not None
    ranges = []
    for r in range_shapes(dims, max_seq=max_seq, batch=batch):
        shapes = (*r.fit, *r.check)
        traces: dict[str, list[StepTrace]] = {name: [] for name in plans}
        for b, s in shapes:
            for name, policies in plans.items():
                if progress:
                    where = f"b={b}" + (f", s={s}" if has_seq else "")
                    progress(f"tracing {name} at {where}")
                traces[name].append(trace_at(b, s if has_seq else None, policies))
        steps = {name: _fit_step(name, r, shapes, t) for name, t in traces.items()}
        ranges.append(NativeRange(r, steps))
    return NativeDynamic(tuple(ranges), dims, {n: tuple(p) for n, p in plans.items()})


def _signature(e: OpEvent) -> tuple[object, ...]:
    return (e.op, e.phase, e.block, e.recompute, e.key)


def moments(trace: StepTrace) -> list[OpEvent]:
    """The ops that move bytes or allocate. The others (views, ``prim`` queries) are left
    out: their bytes are those after the op before them, less what was freed since (what is
    allocated between ops is the trace's ``unseen_peak_bytes``), so they never hold the peak;
    and whether they run can depend on a size (indexing ``x[:, :s]`` skips the slice where
    ``s`` is the whole dimension)."""
    return [e for e in trace.events if e.moved_bytes or e.new_bytes or e.scratch_bytes]


def _check_same_ops(
    name: str, shapes: Sequence[tuple[int, int]], traces: list[list[OpEvent]]
) -> None:
    ref = [_signature(e) for e in traces[0]]
    for (b, s), t in zip(shapes[1:], traces[1:], strict=True):
        sig = [_signature(e) for e in t]
        if sig == ref:
            continue
        k = next(
            (i for i, (x, y) in enumerate(zip(ref, sig, strict=False)) if x != y),
            min(len(ref), len(sig)),
        )
        what = f"op {k} ({ref[k][0]}, {ref[k][1]})" if k < len(ref) else "its end"
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
    name: str, r: RangeShapes, shapes: Sequence[tuple[int, int]], traces: list[StepTrace]
) -> NativeStep:
    streams = [moments(t) for t in traces]
    _check_same_ops(name, shapes, streams)
    rows = _Rows(r)
    events = streams[0]
    per_event = list(zip(*streams, strict=True))

    def where(k: int, what: str = "the bytes") -> Callable[[], str]:
        e = events[k]
        block = traces[0].blocks[e.block] if e.block >= 0 else "outside the blocks"
        return lambda: f"plan {name!r}: {what} at op {k} ({e.op}, {e.phase}, {block})"

    names = [f"{e.phase}:{traces[0].blocks[e.block] if e.block >= 0 else 'outside'}:{e.op}"
             for e in events]  # fmt: skip
    allocated = [rows(tuple(x.allocated_bytes for x in es), where(k))
                 for k, es in enumerate(per_event)]  # fmt: skip
    tensors = [rows(tuple(x.tensor_bytes for x in es), where(k))
               for k, es in enumerate(per_event)]  # fmt: skip
    # Moments between ops, where they exceed every op's at some shape.
    between = (
        ("between ops: unseen allocations", [t.unseen_peak_bytes for t in traces], False),
        ("between ops: live storages", [t.tensor_peak_bytes for t in traces], True),
    )
    extra_alloc: list[tuple[str, tuple[int, ...]]] = []
    extra_tensor: list[tuple[str, tuple[int, ...]]] = []
    for label, values, tensor in between:
        tops = [max(e.tensor_bytes if tensor else e.allocated_bytes for e in t)
                for t in streams]  # fmt: skip
        if any(v > top for v, top in zip(values, tops, strict=True)):
            row = rows(tuple(values), functools.partial(str, f"plan {name!r}: {label}"))
            extra_alloc.append((label, row))
            if tensor:
                extra_tensor.append((label, row))
    saved = rows(
        tuple(sum(end - start for start, end in t.forward_live) for t in traces),
        lambda: f"plan {name!r}: the bytes the forward saves",
    )

    def polys(base: list[tuple[int, ...]], extra: list[tuple[str, tuple[int, ...]]]) -> Any:
        return StepPolynomials(
            rows.basis,
            rows.scale,
            (*names, *(n for n, _ in extra)),
            (*base, *(row for _, row in extra)),
            rows.poly(saved),
        )

    b_min, s_min = r.b_range[0], r.s_range[0] or 0
    alloc_candidates = tuple(_candidates(polys(allocated, extra_alloc), b_min, s_min))
    tensor_candidates = tuple(_candidates(polys(tensors, extra_tensor), b_min, s_min))
    peak = RangeFormula(
        r.b_range[0],
        r.b_range[1],
        r.s_range[0],
        r.s_range[1],
        alloc_candidates,
        rows.poly(saved),
        tensor_candidates,
    )
    for (b, s), t in zip(shapes, traces, strict=True):
        got = (peak.peak(b, s)[0], peak.peak(b, s, tensors=True)[0])
        if got != (t.peak_bytes, t.tensor_peak_bytes):
            raise FitError(
                f"plan {name!r} at b={b}, s={s}: the fitted peaks {got} are not the trace's "
                f"{(t.peak_bytes, t.tensor_peak_bytes)}"
            )
    return NativeStep(
        peak,
        rows.basis,
        _float_rows(rows, per_event, "flops", where),
        _float_rows(rows, per_event, "moved_bytes", where),
        tuple(e.dtype for e in events),
        torch.tensor([e.time_s > 0 for e in events]),
        torch.tensor([e.recompute for e in events]),
    )


def _float_rows(
    rows: _Rows,
    per_event: list[tuple[OpEvent, ...]],
    field: str,
    where: Callable[[int, str], Callable[[], str]],
) -> torch.Tensor:
    """``field`` of every op as float coefficient rows (exactly fitted, then rounded)."""
    fitted = [
        [float(c) for c in rows(tuple(getattr(x, field) for x in es), where(k, field))]
        for k, es in enumerate(per_event)
    ]
    return torch.tensor(fitted, dtype=torch.float64).reshape(len(per_event), -1) / rows.scale


def native_dynamic(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    request: Request,
    *,
    plans: Sequence[str] = NATIVE_PLANS,
    menus: bool = False,
    seq: bool | None = None,
    batch: int | None = None,
) -> tuple[NativeDynamic, NativeProblem]:
    """``model``'s step under each of ``plans`` (:data:`remat.native.planner.NATIVE_PLANS`)
    and, with ``menus``, each uniform option of the chain DP's menus, fitted over every shape
    (:func:`trace_dynamic`) for the request's training options, on a copy of ``model``
    (``model`` is not modified). The menus are chosen at the example's shape."""
    dims = Dims.of(args, kwargs, seq)
    profile = get_profile(resolve_profile(model, request.device_profile))
    blocks = regions.find_blocks(model, request.block_types)
    with kv_cache_off(model):
        traced, problem = analyze(model, blocks, args, kwargs, request, profile)
        chosen = {name: fixed_policies(problem, name) for name in plans}
        if menus:
            seen = set(chosen.values())
            for name, policies in uniform_plans(problem).items():
                if policies not in seen:
                    seen.add(policies)
                    chosen[name] = policies

        def trace_at(b: int, s: int | None, policies: Sequence[Policy]) -> StepTrace:
            a, kw = inputs_at(args, kwargs, dims, b, s)
            return traced.trace(a, kw, policies)

        dynamic = trace_dynamic(
            trace_at,
            chosen,
            dims,
            max_seq=request.max_seq,
            batch=batch,
            progress=request.progress,
        )
    return dynamic, problem


def formula_of(dynamic: NativeDynamic, plan: str, static: StaticMemory) -> MemoryFormula:
    """The device peak of the native plan ``plan`` (traced in ``dynamic``) over its ranges."""
    ranges = []
    for r in dynamic.ranges:
        if plan not in r.steps:
            raise ValueError(f"plan {plan!r} was not traced; traced: {', '.join(r.steps)}")
        ranges.append(r.steps[plan].peak)
    return MemoryFormula(
        f"native:{plan}",
        static,
        tuple(ranges),
        dynamic.dims.seq is not None,
        ("PyTorch's selective checkpointing on the blocks (remat.apply), traced on FakeTensors",),
    )
