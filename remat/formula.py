"""Will it fit? A training step's peak memory as an exact formula in batch and sequence length.

    f = remat.memory_formula(model, example_inputs, plan="keep_all")
    print(f)                      # the formula, per range of shapes, with its pieces
    f.peak_bytes(b=4, s=2048)     # device bytes: static + the step's peak, to the byte
    f.expr                        # a sympy expression in b and s

The step is captured at a few shapes and every size fitted exactly
(:mod:`remat.graph.dynamic`); a plan's live bytes at every moment are then polynomials, and
the peak is their maximum (:mod:`remat.solver.formula`). Evaluated at any shape of its ranges
it equals the simulator's peak for a concrete capture at that shape, which is the measured
peak of a real run (``tests/test_formula.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.budget import Options, StaticMemory
from remat.graph.dynamic import (
    Dims,
    DynamicProblem,
    ShapeRange,
    capture_dynamic,
    range_text,
    within,
)
from remat.graph.profiles import DeviceProfile
from remat.pipeline import analyze
from remat.request import as_args, model_static_memory, resolve_profile
from remat.solver.formula import Poly, peak_candidates, step_polynomials
from remat.solver.plan import Plan, make_plan
from remat.solver.registry import solve

__all__ = ["MemoryFormula", "RangeFormula", "analyze_dynamic", "formula_of", "memory_formula"]


@dataclass(frozen=True)
class RangeFormula:
    """The step's peak over one range of shapes: the maximum of ``candidates``."""

    b_min: int
    b_max: int | None
    s_min: int | None
    s_max: int | None
    candidates: tuple[tuple[str, Poly], ...]
    """``(moment, bytes)``: the moments of the step that can hold its peak somewhere in the
    range (every other moment is provably below one of them)."""
    saved: Poly
    """Bytes the forward leaves to the backward."""
    tensor_candidates: tuple[tuple[str, Poly], ...] = ()
    """The same without kernel scratch: live storages, what a live-storage meter sees."""

    def contains(self, b: int, s: int | None) -> bool:
        return within(self, b, s)

    def peak(self, b: int, s: int | None, *, tensors: bool = False) -> tuple[int, str]:
        s_ = 0 if s is None else s
        candidates = self.tensor_candidates if tensors else self.candidates
        value, moment = max((p.at(b, s_), name) for name, p in candidates)
        return value, moment

    @property
    def description(self) -> str:
        return range_text(self)


@dataclass(frozen=True)
class MemoryFormula:
    """One plan's device memory at every batch ``b`` and length ``s`` of its ranges."""

    plan: str
    static: StaticMemory
    """Held across steps (parameters, optimizer state, gradient shards): a constant."""
    ranges: tuple[RangeFormula, ...]
    has_seq: bool
    notes: tuple[str, ...] = ()

    def _range(self, b: int, s: int | None) -> RangeFormula:
        if self.has_seq and s is None:
            raise ValueError("this model has a sequence dimension: pass s")
        for r in self.ranges:
            if r.contains(b, s):
                return r
        covered = "; ".join(r.description for r in self.ranges)
        raise ValueError(f"(b={b}, s={s}) is outside the formula's ranges ({covered})")

    def step_peak_bytes(self, b: int, s: int | None = None) -> int:
        """The step's peak (activations, gradients, scratch): ``plan.predicted_peak_bytes``."""
        return self._range(b, s).peak(b, s)[0]

    def tensor_peak_bytes(self, b: int, s: int | None = None) -> int:
        """The step's peak of live storages alone: ``plan.predicted_tensor_peak_bytes``."""
        return self._range(b, s).peak(b, s, tensors=True)[0]

    def peak_bytes(self, b: int, s: int | None = None) -> int:
        """Device bytes at the step's peak: static memory plus the step's peak."""
        return self.static.total + self.step_peak_bytes(b, s)

    def max_step_peak_bytes(self, b: int, lo: int, hi: int) -> tuple[int, int]:
        """``(bytes, s)``: the step's largest peak over the lengths ``lo <= s <= hi`` at
        batch ``b`` and a length where it is reached, exactly (not sampled)."""
        r = self._range(b, lo)
        if self._range(b, hi) is not r:
            raise ValueError(f"lengths {lo}..{hi} span two of the formula's ranges")
        return max(p.max_over_s(b, lo, hi) for _, p in r.candidates)

    def peak_moment(self, b: int, s: int | None = None) -> str:
        """Where in the step the peak falls (``phase:op``)."""
        return self._range(b, s).peak(b, s)[1]

    def saved_bytes(self, b: int, s: int | None = None) -> int:
        return self._range(b, s).saved.at(b, 0 if s is None else s)

    def pieces(self, b: int, s: int | None = None) -> dict[str, int]:
        """``static``, ``saved`` (activations kept for the backward) and ``transient`` (the
        rest of the step's peak: gradients, the running op's inputs, outputs and scratch)."""
        step = self.step_peak_bytes(b, s)
        saved = self.saved_bytes(b, s)
        return {"static": self.static.total, "saved": saved, "transient": step - saved}

    @property
    def expr(self) -> Any:
        """The device peak as a sympy expression: a ``Piecewise`` over the ranges of a
        ``Max`` over the candidate moments, plus the static bytes."""
        import sympy

        b, s = sympy.symbols("b s", integer=True, positive=True)
        pieces = []
        for r in self.ranges:
            peak = sympy.Max(*(p.to_sympy() for _, p in r.candidates))
            cond = sympy.Eq(b, r.b_min) if r.b_max == r.b_min else b >= r.b_min
            pieces.append((self.static.total + peak, cond))
        return sympy.Piecewise(*pieces)

    def __str__(self) -> str:
        lines = [f"plan {self.plan!r}: device bytes = static + step peak"]
        lines.append(f"  static = {self.static.total} (parameters, optimizer state, shards)")
        for r in self.ranges:
            lines.append(f"  {r.description}:")
            lines.append(f"    saved for backward = {r.saved}")
            lines.append("    step peak = max of")
            for name, p in r.candidates:
                lines.append(f"      {p}    [{name}]")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def analyze_dynamic(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    precision: str = "fp32",
    grads_held: bool = True,
    device_profile: str | DeviceProfile = "auto",
    max_seq: int | None = None,
    seq: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> DynamicProblem:
    """The model's step at every shape: captured at the fit's shapes around the example's
    (:func:`remat.graph.dynamic.capture_dynamic`). ``seq``: whether dim 1 of the first input
    is a sequence (default: when it holds integers, as token ids do)."""
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    profile = resolve_profile(model, device_profile)
    dims = Dims.of(args, kwargs, seq)

    def one(a: tuple[Any, ...], kw: Mapping[str, Any]) -> Any:
        return analyze(
            model, a, kw, device_profile=profile, precision=precision, grads_held=grads_held
        )

    return capture_dynamic(one, args, kwargs, dims, max_seq=max_seq, progress=progress)


def _schedule_of(r: ShapeRange, plan: str | Plan) -> Any:
    if isinstance(plan, str):
        return solve(r.template, solver=plan, budget_bytes=None).schedule
    missing = [n for n in plan.saved if n not in r.template.by_name]
    if missing:
        raise ValueError(f"the plan keeps {missing[0]!r}, which this range's graph lacks")
    return make_plan(
        r.template, plan.saved, solver=plan.solver, reason=plan.reason, proof=plan.proof
    ).schedule


def formula_of(dynamic: DynamicProblem, plan: str | Plan, static: StaticMemory) -> MemoryFormula:
    """The device peak of ``plan`` over ``dynamic``'s ranges. A named plan (``keep_all``,
    ``keep_matmuls``, ``block``, ``megatron``, ...) is chosen per range; a :class:`Plan` (one
    saved set) covers the ranges whose graph has its values."""
    ranges = []
    notes = []
    for r in dynamic.ranges:
        try:
            schedule = _schedule_of(r, plan)
        except ValueError as e:
            if isinstance(plan, str):
                raise
            notes.append(f"{range_text(r)} not covered: {e}")
            continue
        moments = step_polynomials(r.template, schedule, r.storage, r.scratch)
        saved = moments.saved
        candidates = peak_candidates(moments, r.b_min, r.s_min or 0)
        if r.scratch:
            live = step_polynomials(r.template, schedule, r.storage)
            tensor_candidates = peak_candidates(live, r.b_min, r.s_min or 0)
        else:
            tensor_candidates = candidates
        ranges.append(
            RangeFormula(
                r.b_min,
                r.b_max,
                r.s_min,
                r.s_max,
                tuple(candidates),
                saved,
                tuple(tensor_candidates),
            )
        )
    if not ranges:
        raise ValueError(f"the plan covers none of the ranges: {'; '.join(notes)}")
    name = plan if isinstance(plan, str) else plan.solver
    return MemoryFormula(name, static, tuple(ranges), dynamic.dims.seq is not None, tuple(notes))


def memory_formula(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: str | Plan = "keep_all",
    precision: str = "fp32",
    optimizer: str = "adamw",
    zero_stage: int = 0,
    world_size: int = 1,
    device_profile: str | DeviceProfile = "auto",
    max_seq: int | None = None,
    seq: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> MemoryFormula:
    """The device's peak memory for ``plan`` as an exact formula in the batch ``b`` and, for
    a model with a sequence dimension (dim 1 of the first input, token ids), its length ``s``.

    ``example_inputs`` must have a length of at least 8 (the fit captures at lengths around
    it); ``max_seq`` bounds the lengths the formula claims (the model's positions). The model
    is not modified. See :class:`MemoryFormula` for what it answers.
    """
    options = Options(
        optimizer=optimizer, precision=precision, zero_stage=zero_stage, world_size=world_size
    )
    dynamic = analyze_dynamic(
        model,
        example_inputs,
        example_kwargs=example_kwargs,
        precision=precision,
        grads_held=not options.grads_released,
        device_profile=device_profile,
        max_seq=max_seq,
        seq=seq,
        progress=progress,
    )
    return formula_of(dynamic, plan, model_static_memory(model, options))
