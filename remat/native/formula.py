"""A model's native formula: its plans traced at the fit's shapes (:mod:`remat.native.dynamic`)
on the model, or, for a deep stack of equal blocks, on two shallow copies
(:mod:`remat.native.deep`) checked against the model itself."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from remat.budget import StaticMemory
from remat.graph.dynamic import Dims, inputs_at, range_shapes
from remat.graph.profiles import DeviceProfile, get_profile
from remat.native import regions
from remat.native.api import Stage, Traced, analyze, kv_cache_off
from remat.native.deep import SHALLOW, CopyStep, deep_sample, increments, larger
from remat.native.dynamic import (
    NativeDynamic,
    Sample,
    fitted,
    sample_of,
    schedule_sample,
    trace_dynamic,
    traced_units,
)
from remat.native.pipelining import Pipeline
from remat.native.planner import NATIVE_PLANS, NativeProblem, fixed_policies, uniform_plans
from remat.native.regions import Policy
from remat.peak_formula import MemoryFormula
from remat.request import Request, resolve_profile
from remat.solver.formula import FitError

__all__ = ["Copies", "formula_of", "native_dynamic", "stage_dynamic"]

Copies = Callable[[int], nn.Module]
"""Builds a copy of the model with ``n`` blocks (the same configuration otherwise)."""


def _plans(
    problem: NativeProblem, names: Sequence[str], menus: bool
) -> dict[str, tuple[Policy, ...]]:
    chosen = {name: fixed_policies(problem, name) for name in names}
    if menus:
        seen = set(chosen.values())
        for name, policies in uniform_plans(problem).items():
            if policies not in seen:
                seen.add(policies)
                chosen[name] = policies
    return chosen


def _analyzed(
    model: nn.Module, args: Any, kwargs: Any, request: Request, profile: DeviceProfile
) -> tuple[Traced, NativeProblem]:
    return analyze(
        model, regions.find_blocks(model, request.block_types), args, kwargs, request, profile
    )


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
    copies: Copies | None = None,
) -> tuple[NativeDynamic, NativeProblem]:
    """``model``'s step under each of ``plans`` (:data:`remat.native.planner.NATIVE_PLANS`)
    and, with ``menus``, each uniform option of the chain DP's menus, fitted over every shape
    for the request's training options, on copies of ``model`` (it is not modified). The
    menus are chosen at the example's shape.

    ``copies``: for a stack of more blocks than the two copies together (12 or more), a
    builder of shallower copies: the shapes are traced on copies with 5 and 6 blocks
    (:mod:`remat.native.deep`) and the result checked against traces of ``model`` at the
    example's shape under the fixed plans; where they differ, ``model`` itself is traced at
    every shape."""
    dims = Dims.of(args, kwargs, seq)
    profile = get_profile(resolve_profile(model, request.device_profile))
    progress = request.progress
    with kv_cache_off(model):
        traced, problem = _analyzed(model, args, kwargs, request, profile)
        chosen = _plans(problem, plans, menus)
        if copies is not None and len(problem.blocks) > sum(SHALLOW):
            try:
                dynamic = _deep(traced, problem, chosen, copies, dims, args, kwargs, request,
                                profile, menus, plans, batch)  # fmt: skip
                return dynamic, problem
            except FitError as e:
                if progress:
                    progress(f"the shallow copies do not match ({e}): tracing the model itself")

        def sample_at(b: int, s: int | None, name: str, policies: Sequence[Policy]) -> Sample:
            a, kw = inputs_at(args, kwargs, dims, b, s)
            return sample_of(traced.trace(a, kw, policies))

        dynamic = trace_dynamic(sample_at, chosen, dims, max_seq=request.max_seq,
                                batch=batch, progress=progress, workers=request.workers)  # fmt: skip
    return dynamic, problem


def stage_dynamic(
    module: nn.Module,
    inputs: tuple[Any, ...],
    pipeline: Pipeline,
    target: Any,
    request: Request,
    *,
    menus: bool = True,
    batch: int | None = None,
) -> tuple[NativeDynamic, NativeProblem]:
    """A pipeline rank's stage (or its stages, one ``nn.ModuleList`` with one input each) at
    every microbatch shape: each plan's whole ``schedule.step()`` traced at the fit's shapes
    and every moment of it fitted, as :func:`native_dynamic` fits one step's. The schedule
    runs the same actions in the same order at every shape, so each moment's bytes are
    polynomials in ``(b, s)`` as one step's are, and the peak over the step (every microbatch
    in flight, the receive buffers) is exact at every shape, not scaled from one
    microbatch's. ``inputs``: one microbatch's (token ids or the activations received, dim 1
    the sequence); ``target``: the last stage's, of the tokens' shape. ``batch``: only the
    range of shapes that holds that microbatch size (:func:`remat.graph.dynamic.range_shapes`)."""
    dims = Dims.of(inputs, {}, seq=True)
    profile = get_profile(resolve_profile(module, request.device_profile))
    traced, problem = analyze(
        module,
        regions.find_blocks(module, request.block_types),
        inputs,
        {},
        request,
        profile,
        stage=Stage(pipeline, target),
    )
    chosen = _plans(problem, NATIVE_PLANS, menus)

    def sample_at(b: int, s: int | None, name: str, policies: Sequence[Policy]) -> Sample:
        a, _ = inputs_at(inputs, {}, dims, b, s)
        t = None if target is None else inputs_at((target,), {}, dims, b, s)[0][0]
        step = traced.trace(a, {}, policies, target=t, schedule_events=True)
        return schedule_sample(step)

    dynamic = trace_dynamic(
        sample_at, chosen, dims, max_seq=request.max_seq, batch=batch, progress=request.progress
    )
    return dynamic, problem


def _deep(
    traced: Traced,
    problem: NativeProblem,
    chosen: Mapping[str, tuple[Policy, ...]],
    copies: Copies,
    dims: Dims,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    request: Request,
    profile: DeviceProfile,
    menus: bool,
    plans: Sequence[str],
    batch: int | None,
) -> NativeDynamic:
    """:func:`native_dynamic` from copies with :data:`~remat.native.deep.SHALLOW` blocks,
    checked against the model's own steps at the example's shape (``problem``'s baseline, the
    analysis's trace with every block eager, stands for ``keep_all``'s)."""
    layers = len(problem.blocks)
    shallow: list[tuple[Traced, dict[str, tuple[Policy, ...]]]] = []
    with contextlib.ExitStack() as stack:
        for n in SHALLOW:
            copy = copies(n)
            stack.enter_context(kv_cache_off(copy))
            t, p = _analyzed(copy, args, kwargs, request, profile)
            if len(p.blocks) != n:
                raise FitError(f"the copy built with {n} blocks has {len(p.blocks)}")
            mine = _plans(p, plans, menus)
            if list(mine) != list(chosen):
                raise FitError("the copies' menus differ from the model's")
            shallow.append((t, mine))

        dynamic = _from_copies(shallow, chosen, dims, args, kwargs, layers, request, batch)
    b, s = dims.batch, dims.seq
    r = dynamic.range_of(b, s)
    if r is None:
        raise FitError(f"no range holds the example's shape b={b}, s={s}")
    for name in plans:
        if request.progress:
            request.progress(f"checking {name} on the {layers}-block model")
        eager = all(p is None for p in chosen[name])
        full = problem.baseline if eager else traced.trace(args, kwargs, chosen[name])
        step = r.steps[name]
        got = (step.peak.peak(b, s)[0], step.peak.peak(b, s, tensors=True)[0])
        if got != (full.peak_bytes, full.tensor_peak_bytes):
            raise FitError(
                f"plan {name!r}: the copies give peaks {got} at the example's shape, the model "
                f"{(full.peak_bytes, full.tensor_peak_bytes)}"
            )
    return dynamic


_Unit = tuple[int, int | None, str, int]
"""``(b, s, plan, copy)``: a step of one copy (0: the smaller) at one shape."""


def _from_copies(
    shallow: Sequence[tuple[Traced, Mapping[str, tuple[Policy, ...]]]],
    chosen: Mapping[str, tuple[Policy, ...]],
    dims: Dims,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    layers: int,
    request: Request,
    batch: int | None,
) -> NativeDynamic:
    """Every plan's deep step at each shape of the ranges: the 5-block copy traced at every
    shape, the 6-block copy at two shapes of each range and synthesized from the 5-block's
    elsewhere (:func:`remat.native.deep.larger`), or traced there too where the two shapes
    do not give its increments (:func:`remat.native.deep.increments`)."""
    has_seq = dims.seq is not None
    ranges = range_shapes(dims, max_seq=request.max_seq, batch=batch)

    def traced(b: int, s: int | None, name: str, which: int) -> CopyStep:
        t, mine = shallow[which]
        a, kw = inputs_at(args, kwargs, dims, b, s)
        return CopyStep.of(t.trace(a, kw, mine[name]), SHALLOW[which])

    def on(unit: tuple[Any, ...]) -> str:
        return f" on the {SHALLOW[unit[3]]}-block copy"

    def run(units: list[_Unit]) -> None:
        got = traced_units(traced, units, request.workers, request.progress, has_seq, on)
        steps.update(zip(units, got, strict=True))

    shapes = [[(b, s if has_seq else None) for b, s in (*r.fit, *r.check)] for r in ranges]
    anchors = [list(dict.fromkeys([at[0], at[-1]])) for at in shapes]
    steps: dict[_Unit, CopyStep] = {}
    run([(b, s, name, 0) for at in shapes for b, s in at for name in chosen]
        + [(b, s, name, 1) for at in anchors for b, s in at for name in chosen])  # fmt: skip
    synthesized: list[_Unit] = []
    more: list[_Unit] = []
    for at, two in zip(shapes, anchors, strict=True):
        for name in chosen:
            pairs = [(steps[(b, s, name, 0)], steps[(b, s, name, 1)]) for b, s in two]
            inc = increments(pairs) if len(pairs) == 2 else None
            for b, s in at:
                unit = (b, s, name, 1)
                if unit in steps:
                    continue
                synth = larger(steps[(b, s, name, 0)], inc) if inc is not None else None
                if synth is None:
                    more.append(unit)
                else:
                    steps[unit] = synth
                    synthesized.append(unit)
    run(more)
    if request.progress:
        total = sum(map(len, shapes)) * len(chosen)
        request.progress(
            f"{len(synthesized)} of {total} {SHALLOW[1]}-block steps synthesized from the "
            f"{SHALLOW[0]}-block copy's"
        )
    samples = {
        (b, s, name): deep_sample(steps[(b, s, name, 0)], steps[(b, s, name, 1)], layers)
        for at in shapes
        for b, s in at
        for name in chosen
    }
    return fitted(ranges, chosen, dims, samples)


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
