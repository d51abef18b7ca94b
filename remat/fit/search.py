"""The search behind :func:`remat.fit.fit`: the longest sequence and the largest batch each
plan fits in a device budget, on a step fitted over shapes.

Every plan is a fixed saved set whose peak is an exact formula in ``(b, s)``
(:mod:`remat.fit.graph_formula`); its recompute share at a shape comes from the roofline of every op's
FLOPs and bytes, themselves polynomials. So a search over shapes evaluates formulas and never
re-captures. The plans:

* ``no checkpointing``, ``Megatron selective`` (attention scores recomputed), ``every block``
  (each repeated block's internals recomputed, as ``gradient_checkpointing_enable()``);
* ``least peak``: at each shape, the least peak of all the plans below;
* ``remat <= N%``: at each shape, the least-peak plan whose recompute is at most N% of the
  step's time, among the baselines and the chain solver's per-block menu applied to every
  block (its uniform plans, from keeping every activation to recomputing each block whole),
  menus solved once at the example's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from remat import _torch_compat as tc
from remat.budget import DeviceBudget, autocast_cache_hint
from remat.executors.graph.analyze import analyze
from remat.executors.graph.loss import loss_at
from remat.fit.graph_formula import MemoryFormula, RangeFormula, analyze_dynamic, formula_of
from remat.fit.graph_shapes import Dims, DynamicProblem, ShapeRange, capture_dynamic_deep
from remat.fit.questions import FitQuestion
from remat.fit.sac_formula import formula_of as native_formula_of
from remat.fit.sac_formula import native_dynamic
from remat.fit.sac_shapes import NativeDynamic
from remat.measure.profiles import DeviceProfile, get_profile
from remat.request import resolve_profile
from remat.solver.chain import chain_menu
from remat.solver.config import SolverConfig
from remat.solver.formula import peak_candidates, step_polynomials
from remat.solver.plan import Plan
from remat.solver.registry import solve

__all__ = [
    "CAPS",
    "FIXED",
    "FIXED_SAC",
    "FitReport",
    "FitRow",
    "fit_dynamic",
    "fit_graph",
    "fit_native",
    "fit_sac",
]

CAPS: tuple[float, ...] = (5.0, 10.0, 20.0)
FIXED = {"no checkpointing": "keep_all", "Megatron selective": "megatron", "every block": "block"}
"""Rows of fixed plans for remat's executor: row name -> plan."""
FIXED_SAC = {"no checkpointing": "keep_all", "keep matmuls": "keep_matmuls", "every block": "block"}
"""Rows of fixed plans for ``remat.apply``'s executor (``keep matmuls``: every block keeps the
outputs of its ops with FLOPs)."""


@dataclass(frozen=True)
class Candidate:
    """One saved set over one range of shapes: its peak formula and its schedule's ops."""

    name: str
    peak: RangeFormula
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    recomputed: tuple[str, ...]
    saved: frozenset[str] = frozenset()

    def recompute_pct(self, times: Mapping[str, float]) -> float:
        step = sum(times.get(n, 0.0) for n in (*self.forward, *self.backward))
        return 100 * sum(times.get(n, 0.0) for n in self.recomputed) / step if step else 0.0


@dataclass(frozen=True)
class Choice:
    plan: str
    """The saved set chosen at this shape (a baseline's name or ``chain option k``)."""
    step_peak_bytes: int
    recompute_pct: float


@dataclass(frozen=True)
class FitRow:
    """Where one plan stops fitting."""

    max_seq: int | None
    """The longest sequence at the report's batch (None: not even the shortest fits)."""
    max_batch: int | None
    """The largest batch at the report's sequence."""
    at_max_seq: Choice | None
    at_max_batch: Choice | None
    peak_bytes_at_max: int | None
    """Device bytes (static + step peak) at ``(batch, max_seq)``."""


@dataclass(frozen=True)
class FitReport:
    budget: DeviceBudget
    batch: int
    seq: int | None
    seq_limit: int | None
    """The longest sequence searched (the model's positions)."""
    batch_limit: int
    plans: Mapping[str, FitRow]
    formula: MemoryFormula
    """``no checkpointing``'s formula."""
    candidates: Mapping[str, int] = field(default_factory=dict)
    """Saved sets considered per range."""
    planner: _Chooser | None = field(default=None, repr=False, compare=False)

    def choose(self, plan: str, b: int, s: int | None) -> Choice | None:
        """The saved set row ``plan`` takes at ``(b, s)``, with its step peak and recompute
        share (None where the shape is outside the captured ranges)."""
        if self.planner is None:
            raise ValueError("this report has no planner")
        return self.planner.choose(plan, b, s)

    def hints(self) -> list[str]:
        """What to try where a plan fits nothing: under autocast (``bf16-mixed`` /
        ``fp16-mixed``) with ZeRO-3 on the ``sac`` executor, FSDP2's own mixed precision
        (``bf16-fsdp``) gathers 16-bit weights per block
        (:func:`remat.budget.autocast_cache_hint`)."""
        opts = self.budget.options
        none_fits = any(r.max_seq is None or r.max_batch is None for r in self.plans.values())
        hint = autocast_cache_hint(opts)
        if not (none_fits and hint is not None and self.formula.plan.startswith("native:")):
            return []
        return [hint]

    def to_json(self) -> dict[str, Any]:
        return {
            "hints": self.hints(),
            "plans": {
                name: {
                    "max_seq": row.max_seq,
                    "max_batch": row.max_batch,
                    "peak_bytes_at_max": row.peak_bytes_at_max,
                    "recompute_pct": None
                    if row.at_max_seq is None
                    else round(row.at_max_seq.recompute_pct, 3),
                }
                for name, row in self.plans.items()
            },
            "formula": str(self.formula.expr),
            "budget_bytes": self.budget.budget_bytes,
            "batch": self.batch,
            "seq": self.seq,
        }


class _Planner:
    """Every candidate saved set per range, evaluated at shapes from formulas alone."""

    def __init__(
        self, dynamic: DynamicProblem, config: SolverConfig, progress: Callable[[str], None] | None
    ) -> None:
        self.dynamic = dynamic
        self.by_range: list[tuple[ShapeRange, list[Candidate]]] = []
        for r in dynamic.ranges:
            plans: dict[str, Plan] = {}
            for name in (
                "keep_all",
                "megatron",
                "block",
                "keep_matmuls",
                "keep_inputs",
                "chen_sqrt",
            ):
                try:
                    plans[name] = solve(r.template, solver=name, budget_bytes=None, config=config)
                except ValueError:  # no blocks to checkpoint, no attention scores
                    continue
            if progress:
                progress("per-block menu for the chain solver")
            try:
                for k, p in enumerate(chain_menu(r.template, config).uniform):
                    plans[f"chain option {k}"] = p
            except ValueError:
                pass
            self.by_range.append((r, [self._candidate(r, n, p) for n, p in plans.items()]))
        self._times: dict[tuple[int, int | None], Any] = {}
        # Each candidate's step and recompute as indices into its range's timed ops: a fit
        # search sums them at dozens of shapes, over tens of thousands of ops at 70B.
        self._order = {id(r): list(r.moved) for r, _ in self.by_range}
        self._index: dict[tuple[int, str], tuple[Any, Any]] = {}
        for r, candidates in self.by_range:
            at = {n: k for k, n in enumerate(self._order[id(r)])}
            for c in candidates:
                step = [at[n] for n in (*c.forward, *c.backward) if n in at]
                rec = [at[n] for n in c.recomputed if n in at]
                self._index[(id(r), c.name)] = (
                    torch.tensor(step, dtype=torch.long),
                    torch.tensor(rec, dtype=torch.long),
                )

    @staticmethod
    def _candidate(r: ShapeRange, name: str, plan: Plan) -> Candidate:
        moments = step_polynomials(r.template, plan.schedule, r.storage, r.scratch)
        peak = RangeFormula(
            r.b_min,
            r.b_max,
            r.s_min,
            r.s_max,
            tuple(peak_candidates(moments, r.b_min, r.s_min or 0)),
            moments.saved,
        )
        sched = plan.schedule
        return Candidate(
            name, peak, sched.forward, sched.backward, sched.recomputed, frozenset(plan.saved)
        )

    def choices(self, b: int, s: int | None) -> list[tuple[Candidate, Choice]]:
        r, candidates = next((x for x in self.by_range if x[0].contains(b, s)), (None, []))
        if r is None:
            return []
        if (b, s) not in self._times:  # searches move on: keep the last shape's
            times = r.times_at(b, s)
            self._times = {
                (b, s): torch.tensor([times[n] for n in self._order[id(r)]], dtype=torch.float64)
            }
        times = self._times[(b, s)]
        out = []
        for c in candidates:
            step, rec = self._index[(id(r), c.name)]
            total = float(times[step].sum())
            pct = 100 * float(times[rec].sum()) / total if total else 0.0
            out.append((c, Choice(c.name, c.peak.peak(b, s)[0], pct)))
        return out

    def choose(self, plan: str, b: int, s: int | None) -> Choice | None:
        """The saved set ``plan`` (a row's name) takes at ``(b, s)``."""
        return _row_choice(plan, FIXED, [ch for _, ch in self.choices(b, s)])


class _NativePlanner:
    """Every traced native plan per range, evaluated at shapes from formulas alone."""

    def __init__(self, dynamic: NativeDynamic, profile: DeviceProfile) -> None:
        self.dynamic = dynamic
        self.profile = profile
        self._at: tuple[tuple[int, int | None], list[Choice]] | None = None

    def choices(self, b: int, s: int | None) -> list[Choice]:
        if self._at is not None and self._at[0] == (b, s):
            return self._at[1]
        r = self.dynamic.range_of(b, s)
        out = []
        if r is not None:
            for name, step in r.steps.items():
                pct = step.recompute_pct(self.profile, b, s)
                out.append(Choice(name, step.peak.peak(b, s)[0], pct))
        self._at = ((b, s), out)
        return out

    def choose(self, plan: str, b: int, s: int | None) -> Choice | None:
        return _row_choice(plan, FIXED_SAC, self.choices(b, s))


def _row_choice(plan: str, fixed: Mapping[str, str], options: list[Choice]) -> Choice | None:
    """Row ``plan``'s saved set among ``options``: a fixed plan's, or the least peak (within
    a recompute cap, for ``remat <= N%``)."""
    if plan in fixed:
        return next((ch for ch in options if ch.plan == fixed[plan]), None)
    if plan != "least peak":
        cap = float(plan.removeprefix("remat <= ").removesuffix("%"))
        options = [ch for ch in options if ch.recompute_pct <= cap + 1e-9]
    return min(options, key=lambda ch: (ch.step_peak_bytes, ch.recompute_pct), default=None)


class _Chooser(Protocol):
    def choose(self, plan: str, b: int, s: int | None) -> Choice | None: ...


def _largest(fits: Callable[[int], bool], lo: int, hi: int | None) -> int | None:
    """The largest ``n >= lo`` (up to ``hi``) with ``fits(n)``; ``fits`` is monotone."""
    if not fits(lo):
        return None
    if hi is None:  # double to a bound first
        hi = lo
        while fits(hi * 2) and hi < 2**24:
            hi *= 2
        hi *= 2
    elif fits(hi):
        return hi
    # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _search(
    planner: _Chooser,
    names: list[str],
    budget: DeviceBudget,
    *,
    batch: int,
    seq: int | None,
    s_min: int | None,
    seq_limit: int | None,
    batch_limit: int,
    progress: Callable[[str], None] | None,
) -> dict[str, FitRow]:
    """Each row's longest sequence at ``batch`` and largest batch at ``seq``."""
    step_budget = budget.step_budget_bytes
    rows: dict[str, FitRow] = {}
    for name in names:
        if progress:
            progress(f"searching: {name}")

        def fits(b: int, s: int | None, name: str = name) -> bool:
            ch = planner.choose(name, b, s)
            return ch is not None and ch.step_peak_bytes <= step_budget

        max_seq = (
            _largest(lambda s: fits(batch, s), s_min or 3, seq_limit) if seq is not None else None
        )
        max_batch = _largest(lambda b: fits(b, seq), 1, batch_limit)
        at_seq = planner.choose(name, batch, max_seq) if max_seq is not None else None
        at_batch = planner.choose(name, max_batch, seq) if max_batch is not None else None
        rows[name] = FitRow(
            max_seq,
            max_batch,
            at_seq,
            at_batch,
            None if at_seq is None else budget.static.total + at_seq.step_peak_bytes,
        )
    return rows


def _row_names(fixed: Mapping[str, str]) -> list[str]:
    return [*fixed, "least peak", *(f"remat <= {c:g}%" for c in CAPS)]


def fit_dynamic(
    dynamic: DynamicProblem,
    budget: DeviceBudget,
    *,
    batch: int,
    seq: int | None,
    seq_limit: int | None,
    batch_limit: int = 1 << 16,
    config: SolverConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> FitReport:
    """:func:`fit` on a captured :class:`DynamicProblem`."""
    config = config or SolverConfig(time_limit_s=10.0)
    planner = _Planner(dynamic, config, progress)
    s_min = next((r.s_min for r in dynamic.ranges if r.s_min is not None), None)
    rows = _search(
        planner, _row_names(FIXED), budget, batch=batch, seq=seq, s_min=s_min,
        seq_limit=seq_limit, batch_limit=batch_limit, progress=progress,
    )  # fmt: skip
    formula = formula_of(dynamic, "keep_all", budget.static)
    return FitReport(
        budget=budget,
        batch=batch,
        seq=seq,
        seq_limit=seq_limit,
        batch_limit=batch_limit,
        plans=rows,
        formula=formula,
        candidates={
            next(
                (r.description for r in formula.ranges if r.b_min == sr.b_min), str(sr.b_min)
            ): len(c)
            for sr, c in planner.by_range
        },
        planner=planner,
    )


def fit_native(
    dynamic: NativeDynamic,
    budget: DeviceBudget,
    profile: DeviceProfile,
    *,
    batch: int,
    seq: int | None,
    seq_limit: int | None,
    batch_limit: int = 1 << 16,
    progress: Callable[[str], None] | None = None,
) -> FitReport:
    """:func:`fit` for ``remat.apply``'s executor, on traced native plans
    (:func:`remat.fit.sac_formula.native_dynamic`, with ``keep_all`` among them)."""
    planner = _NativePlanner(dynamic, profile)
    s_min = next((r.shapes.s_range[0] for r in dynamic.ranges), None)
    rows = _search(
        planner, _row_names(FIXED_SAC), budget, batch=batch, seq=seq, s_min=s_min,
        seq_limit=seq_limit, batch_limit=batch_limit, progress=progress,
    )  # fmt: skip
    formula = native_formula_of(dynamic, "keep_all", budget.static)
    counts = {
        r.description: len(nr.steps) for r, nr in zip(formula.ranges, dynamic.ranges, strict=True)
    }
    return FitReport(
        budget=budget,
        batch=batch,
        seq=seq,
        seq_limit=seq_limit,
        batch_limit=batch_limit,
        plans=rows,
        formula=formula,
        candidates=counts,
        planner=planner,
    )


def fit_sac(question: FitQuestion) -> FitReport:
    """:func:`remat.fit.fit` for the ``sac`` executor: the fixed plans and the chain DP's
    menus, traced at the fit's shapes (:func:`remat.fit.sac_formula.native_dynamic`),
    searched by :func:`fit_native`."""
    q, req = question, question.request
    dims = Dims.of(q.args, q.kwargs)
    native, _ = native_dynamic(
        q.model, q.args, q.kwargs, req, menus=True, copies=q.copies, loss=q.loss
    )
    profile = get_profile(resolve_profile(q.model, req.device_profile))
    return fit_native(
        native, q.budget, profile, batch=dims.batch, seq=dims.seq, seq_limit=req.max_seq,
        batch_limit=q.max_batch, progress=req.progress,
    )  # fmt: skip


def fit_graph(question: FitQuestion) -> FitReport:
    """:func:`remat.fit.fit` for the whole-graph executor: the step captured at a few shapes
    (on ``question.shallow``'s copy for a deep stack), searched by :func:`fit_dynamic`."""
    model, args, kwargs, loss = question.model, question.args, question.kwargs, question.loss
    request, budget, max_batch = question.request, question.budget, question.max_batch
    dims = Dims.of(args, kwargs)
    precision, grads_held = request.training.precision, not request.training.grads_released
    profile = resolve_profile(model, request.device_profile)
    max_seq, progress = request.max_seq, request.progress
    if question.shallow is None:
        dynamic = analyze_dynamic(
            model, args, example_kwargs=kwargs, precision=precision, grads_held=grads_held,
            device_profile=profile, max_seq=max_seq, progress=progress, loss=loss,
        )  # fmt: skip
    else:
        copy, copy_layers, layers = question.shallow

        def on(m: nn.Module) -> Callable[[tuple[Any, ...], Mapping[str, Any]], Any]:
            mode = tc.fake_mode_of(m)

            def run(a: tuple[Any, ...], kw: Mapping[str, Any]) -> Any:
                at = loss_at(loss, (args, kwargs), a, kw)
                if mode is not None:  # fake inputs of another FakeTensorMode: same shapes here
                    a, kw = tc.tree_map(lambda x: _in_mode(x, mode), (a, dict(kw)))
                    if at is not None:
                        at = dataclasses.replace(
                            at, target=tc.tree_map(lambda x: _in_mode(x, mode), at.target)
                        )
                return analyze(
                    m, a, kw, device_profile=profile, precision=precision, grads_held=grads_held,
                    loss=at,
                )  # fmt: skip

            return run

        dynamic = capture_dynamic_deep(
            on(model), on(copy), args, kwargs, dims, layers=layers, shallow_layers=copy_layers,
            max_seq=max_seq, progress=progress,
        )  # fmt: skip
    return fit_dynamic(
        dynamic,
        budget,
        batch=dims.batch,
        seq=dims.seq,
        seq_limit=max_seq,
        batch_limit=max_batch,
        config=SolverConfig(time_limit_s=request.time_limit_s),
        progress=progress,
    )


def _in_mode(x: Any, mode: Any) -> Any:
    """A tensor of ``x``'s shape and dtype in FakeTensorMode ``mode`` (a fake input made by
    another mode cannot mix with ``mode``'s parameters)."""
    if not isinstance(x, torch.Tensor) or getattr(x, "fake_mode", mode) is mode:
        return x
    with mode:
        return torch.zeros(x.shape, dtype=x.dtype)
