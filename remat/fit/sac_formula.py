"""A model's native formula: its plans traced at the fit's shapes (:mod:`remat.fit.sac_shapes`)
on the model, or, for a deep stack of equal blocks, on two shallow copies
(:mod:`remat.fit.deep`) checked against the model itself."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from remat.budget import StaticMemory
from remat.executors.graph.loss import loss_at
from remat.executors.sac import regions
from remat.executors.sac.hf import kv_cache_off
from remat.executors.sac.passes import Stage, Traced, analyze
from remat.executors.sac.planner import FITTED_PLANS, NativeProblem, fixed_policies, uniform_plans
from remat.executors.sac.regions import Policy
from remat.fit.deep import EDGES, WIDE, CopyStep, Edges, deep_sample, increments, larger, matched
from remat.fit.graph_shapes import Dims, inputs_at, range_shapes
from remat.fit.peak import MemoryFormula
from remat.fit.sac_shapes import (
    NativeDynamic,
    Sample,
    collected,
    fitted,
    sample_of,
    schedule_sample,
    started,
    trace_dynamic,
)
from remat.fit.workers import Mapped
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile, get_profile
from remat.parallel.pipelining import Pipeline
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
    model: nn.Module,
    args: Any,
    kwargs: Any,
    request: Request,
    profile: DeviceProfile,
    loss: Loss | None = None,
) -> tuple[Traced, NativeProblem]:
    return analyze(
        model,
        regions.find_blocks(model, request.block_types),
        args,
        kwargs,
        request,
        profile,
        loss=loss,
    )


def native_dynamic(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    request: Request,
    *,
    plans: Sequence[str] = FITTED_PLANS,
    menus: bool = False,
    seq: bool | None = None,
    batch: int | None = None,
    copies: Copies | None = None,
    loss: Loss | None = None,
) -> tuple[NativeDynamic, NativeProblem]:
    """``model``'s step under each of ``plans`` (:data:`remat.executors.sac.planner.FITTED_PLANS`)
    and, with ``menus``, each uniform option of the chain DP's menus, fitted over every shape
    for the request's training options, on copies of ``model`` (it is not modified). The
    menus are chosen at the example's shape.

    ``copies``: for a stack of more blocks than the two copies together (10 or more), a
    builder of shallower copies: the shapes are traced on copies with 4 and 5 blocks
    (:mod:`remat.fit.deep`) and the result checked against traces of ``model`` at the
    example's shape under the fixed plans; where they differ, ``model`` itself is traced at
    every shape. ``loss``: the loop's loss, its target tiled and cropped as the inputs are
    (``model`` itself is then traced at every shape)."""
    dims = Dims.of(args, kwargs, seq)
    profile = get_profile(resolve_profile(model, request.device_profile))
    progress = request.progress
    with contextlib.ExitStack() as stack:
        stack.enter_context(kv_cache_off(model))
        deep = None
        if (
            copies is not None
            and loss is None
            and len(regions.find_blocks(model, request.block_types)) > sum(EDGES.copies)
        ):
            try:
                deep = stack.enter_context(
                    _Deep(copies, dims, args, kwargs, request, profile, plans, menus, batch)
                )
            except FitError as e:
                _no_match(request, e)
        traced, problem = _analyzed(model, args, kwargs, request, profile, loss)
        chosen = _plans(problem, plans, menus)
        if deep is not None:
            try:
                return deep.finish(traced, problem, chosen), problem
            except FitError as e:
                _no_match(request, e)
            deep.close()

        def sample_at(b: int, s: int | None, name: str, policies: Sequence[Policy]) -> Sample:
            a, kw = inputs_at(args, kwargs, dims, b, s)
            at = loss_at(loss, (args, kwargs), a, kw)
            target = None if at is None else at.target
            return sample_of(traced.trace(a, kw, policies, target=target))

        dynamic = trace_dynamic(sample_at, chosen, dims, max_seq=request.max_seq,
                                batch=batch, progress=progress, workers=request.workers)  # fmt: skip
    return dynamic, problem


def _no_match(request: Request, e: FitError) -> None:
    if request.progress:
        request.progress(f"the shallow copies do not match ({e}): tracing the model itself")


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
    range of shapes that holds that microbatch size
    (:func:`remat.fit.graph_shapes.range_shapes`)."""
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
    chosen = _plans(problem, FITTED_PLANS, menus)

    def sample_at(b: int, s: int | None, name: str, policies: Sequence[Policy]) -> Sample:
        a, _ = inputs_at(inputs, {}, dims, b, s)
        t = None if target is None else inputs_at((target,), {}, dims, b, s)[0][0]
        step = traced.trace(a, {}, policies, target=t, schedule_events=True)
        return schedule_sample(step)

    dynamic = trace_dynamic(
        sample_at, chosen, dims, max_seq=request.max_seq, batch=batch, progress=request.progress
    )
    return dynamic, problem


_Unit = tuple[int, int | None, str, int]
"""``(b, s, plan, copy)``: a step of one copy (0: the smaller) at one shape."""
_Copy = tuple[Traced, dict[str, tuple[Policy, ...]]]
"""An analysed copy, and its plans by name."""


class _Deep:
    """:func:`native_dynamic` from two shallow copies (:class:`~remat.fit.deep.Edges`): the
    smaller traced at every shape, the larger at two shapes of each range and synthesized
    from the smaller's elsewhere (:func:`remat.fit.deep.larger`), or traced
    there too where the two shapes do not give its increments
    (:func:`remat.fit.deep.increments`); then checked against the model's own steps at
    the example's shape. The copies' traces start on the workers as it is made, so the
    model's analysis and checks in this process overlap them; a ``with`` block stops them
    where the fit gives up."""

    def __init__(
        self,
        copies: Copies,
        dims: Dims,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        request: Request,
        profile: DeviceProfile,
        plans: Sequence[str],
        menus: bool,
        batch: int | None,
    ) -> None:
        self.dims, self.args, self.kwargs, self.request = dims, args, kwargs, request
        self.plans, self.has_seq = plans, dims.seq is not None
        self._stack = contextlib.ExitStack()
        try:
            self._start(copies, profile, menus, batch)
        except BaseException:
            self.close()
            raise

    def _start(
        self, copies: Copies, profile: DeviceProfile, menus: bool, batch: int | None
    ) -> None:
        """Analyse the copies and start their traces."""
        self.edges, self.shallow = self._copies(copies, profile, menus)
        names = list(self.shallow[0][1])
        if list(self.shallow[1][1]) != names:
            raise FitError("the copies' menus differ from each other")
        self.ranges = range_shapes(self.dims, max_seq=self.request.max_seq, batch=batch)
        self.shapes = [
            [(b, s if self.has_seq else None) for b, s in (*r.fit, *r.check)] for r in self.ranges
        ]
        self.anchors = [list(dict.fromkeys([at[0], at[-1]])) for at in self.shapes]
        self.units: list[_Unit] = [
            *((b, s, name, 0) for at in self.shapes for b, s in at for name in names),
            *((b, s, name, 1) for at in self.anchors for b, s in at for name in names),
        ]
        workers, progress = self.request.workers, self.request.progress
        self.pending = started(self._traced, self.units, workers, progress)
        self._stack.callback(self.pending.close)

    def _copies(
        self, copies: Copies, profile: DeviceProfile, menus: bool
    ) -> tuple[Edges, list[_Copy]]:
        """The two copies for :data:`~remat.fit.deep.EDGES`, or for
        :data:`~remat.fit.deep.WIDE` where their analysis steps (every block eager, at the
        example's shape) do not match as the narrower edges say; with their edges."""
        built: dict[int, tuple[_Copy, NativeProblem]] = {}

        def pair(edges: Edges) -> list[_Copy]:
            for n in edges.copies:
                if n not in built:
                    built[n] = self._copy(copies, n, profile, menus)
            (small, p_small), (large, p_large) = (built[n] for n in edges.copies)
            matched(p_small.baseline, p_large.baseline, edges)
            return [small, large]

        try:
            return EDGES, pair(EDGES)
        except FitError as e:
            if self.request.progress:
                self.request.progress(f"{e}: copies with {WIDE.copies} blocks instead")
        return WIDE, pair(WIDE)

    def _copy(
        self, copies: Copies, n: int, profile: DeviceProfile, menus: bool
    ) -> tuple[_Copy, NativeProblem]:
        """The copy with ``n`` blocks, analysed (its KV cache off while this fit lasts), and
        its plans."""
        copy = copies(n)
        self._stack.enter_context(kv_cache_off(copy))
        t, p = _analyzed(copy, self.args, self.kwargs, self.request, profile)
        if len(p.blocks) != n:
            raise FitError(f"the copy built with {n} blocks has {len(p.blocks)}")
        return (t, _plans(p, self.plans, menus)), p

    def _traced(self, b: int, s: int | None, name: str, which: int) -> CopyStep:
        t, mine = self.shallow[which]
        a, kw = inputs_at(self.args, self.kwargs, self.dims, b, s)
        return CopyStep.of(t.trace(a, kw, mine[name]), self.edges.copies[which], self.edges)

    def _collected(self, results: Mapped, units: Sequence[_Unit]) -> dict[_Unit, CopyStep]:
        def on(unit: tuple[Any, ...]) -> str:
            return f" on the {self.edges.copies[unit[3]]}-block copy"

        got = collected(results, units, self.request.progress, self.has_seq, on)
        return dict(zip(units, got, strict=True))

    def finish(
        self, traced: Traced, problem: NativeProblem, chosen: Mapping[str, tuple[Policy, ...]]
    ) -> NativeDynamic:
        """The fit, once the model is analysed (``problem``, its plans ``chosen``)."""
        layers = len(problem.blocks)
        if list(self.shallow[0][1]) != list(chosen):
            raise FitError("the copies' menus differ from the model's")
        full = self._model_peaks(traced, problem, chosen)
        steps = self._collected(self.pending, self.units)
        more = self._synthesized(steps, chosen)
        steps.update(self._collected(started(self._traced, more, self.request.workers,
                                             self.request.progress), more))  # fmt: skip
        samples = {
            (b, s, name): deep_sample(
                steps[(b, s, name, 0)], steps[(b, s, name, 1)], layers, self.edges
            )
            for at in self.shapes
            for b, s in at
            for name in chosen
        }
        dynamic = fitted(self.ranges, chosen, self.dims, samples)
        b, s = self.dims.batch, self.dims.seq
        r = dynamic.range_of(b, s)
        if r is None:
            raise FitError(f"no range holds the example's shape b={b}, s={s}")
        for name, peaks in full.items():
            step = r.steps[name]
            got = (step.peak.peak(b, s)[0], step.peak.peak(b, s, tensors=True)[0])
            if got != peaks:
                raise FitError(
                    f"plan {name!r}: the copies give peaks {got} at the example's shape, the "
                    f"model {peaks}"
                )
        return dynamic

    def _model_peaks(
        self, traced: Traced, problem: NativeProblem, chosen: Mapping[str, tuple[Policy, ...]]
    ) -> dict[str, tuple[int, int]]:
        """The model's own peaks at the example's shape under each fixed plan (the analysis's
        trace, every block eager, stands for ``keep_all``'s)."""
        out = {}
        for name in self.plans:
            policies = chosen[name]
            if self.request.progress:
                self.request.progress(f"checking {name} on the {len(problem.blocks)}-block model")
            eager = all(p is None for p in policies)
            full = problem.baseline if eager else traced.trace(self.args, self.kwargs, policies)
            out[name] = (full.peak_bytes, full.tensor_peak_bytes)
        return out

    def _synthesized(
        self, steps: dict[_Unit, CopyStep], chosen: Mapping[str, tuple[Policy, ...]]
    ) -> list[_Unit]:
        """The larger copy's steps ``steps`` lacks, synthesized into it; the units that could
        not be."""
        done: list[_Unit] = []
        more: list[_Unit] = []
        for at, two in zip(self.shapes, self.anchors, strict=True):
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
                        done.append(unit)
        if self.request.progress:
            total = sum(map(len, self.shapes)) * len(chosen)
            self.request.progress(
                f"{len(done)} of {total} {self.edges.copies[1]}-block steps synthesized from "
                f"the {self.edges.copies[0]}-block copy's"
            )
        return more

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> _Deep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
