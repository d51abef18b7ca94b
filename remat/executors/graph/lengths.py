"""One plan for a range of sequence lengths: ``remat.optimize(..., max_seq=N)``.

Graphs are specialised to their input shapes, so a data loader whose lengths vary would plan
again at every new length (a capture, then seconds to a minute of solving). The step's sizes
are exact polynomials in the length (:mod:`remat.fit.graph_shapes`), so a plan solved at the
longest length of a bucket has an exact formula for its peak at every shorter length
(:mod:`remat.fit.graph_formula`), and the formula's maximum over the bucket is checked against the
budget before the plan is used. A new length in a solved bucket is then captured (the graph
at that shape) and runs the bucket's plan: no solve.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remat import _torch_compat as tc
from remat.budget import StaticMemory
from remat.fit.graph_formula import MemoryFormula, formula_of
from remat.fit.graph_shapes import Dims, DynamicProblem, same_graph, shape_at
from remat.problem import Problem
from remat.solver.config import BudgetError
from remat.solver.plan import Plan, Proof, make_plan

__all__ = ["Bucket", "LengthPlans", "PlanningEvent", "bucket_tops"]


@dataclass(frozen=True)
class PlanningEvent:
    """A new length the module compiled for: captured, then its bucket's plan scheduled on
    that graph (no solve)."""

    length: int
    bucket: int
    """The bucket's longest length."""
    seconds: float
    """Capture, joint graph, annotation and rewrite."""


@dataclass
class Bucket:
    """Lengths ``lo..hi``, planned at ``hi``."""

    lo: int
    hi: int
    plan: Plan | None = None
    """Solved on the fitted problem at ``(batch, hi)``."""
    formula: MemoryFormula | None = None
    """``plan``'s device peak at every length of the bucket."""
    worst: tuple[int, int] | None = None
    """``(step peak bytes, length)``: the formula's largest step peak over the bucket."""
    solve_s: float = 0.0
    """Seconds the solve took."""


def bucket_tops(max_seq: int | None, buckets: Sequence[int]) -> list[int]:
    """The buckets' longest lengths, ascending, the last ``max_seq`` (default: the largest
    bucket)."""
    tops = sorted({int(t) for t in buckets} | ({max_seq} if max_seq is not None else set()))
    if not tops:
        raise ValueError("pass max_seq (and optionally seq_buckets) to plan for a range")
    if max_seq is not None and tops[-1] > max_seq:
        raise ValueError(f"seq_buckets {tops} reach past max_seq={max_seq}")
    if tops[0] < 3:
        raise ValueError(f"the shortest bucket must reach at least 3 tokens, got {tops[0]}")
    return tops


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _TensorMeta(tuple(x.shape), x.dtype, x.device, x.requires_grad)
    return x


class LengthPlans:
    """The plans of one :class:`remat.RematModule` over a range of lengths, by bucket, and
    what each new length cost (:attr:`events`)."""

    def __init__(
        self,
        dynamic: DynamicProblem,
        tops: Sequence[int],
        static: StaticMemory,
        solve: Callable[[Problem], Plan],
        step_budget: int | None,
        example: tuple[tuple[Any, ...], Mapping[str, Any]],
        training: bool,
        fit_seconds: float,
    ) -> None:
        self.dynamic = dynamic
        self.dims: Dims = dynamic.dims
        self.batch = self.dims.batch
        self.range = dynamic.range_of(self.batch, self.dims.seq)
        lo = self.range.s_min or 3
        self.buckets = []
        for top in tops:
            self.buckets.append(Bucket(lo, top))
            lo = top + 1
        self.static = static
        self._solve = solve
        self.step_budget = step_budget
        leaves, spec = tc.tree_flatten((tuple(example[0]), dict(example[1])))
        # What the example was, not the tensors themselves (the module must not hold them).
        self._example = ([_meta(x) for x in leaves], spec)
        self.training = training
        self.fit_seconds = fit_seconds
        """Seconds the fit's captures took (paid once, in ``remat.optimize``)."""
        self.events: list[PlanningEvent] = []

    @property
    def max_seq(self) -> int:
        return self.buckets[-1].hi

    @property
    def solves(self) -> int:
        """Buckets solved: the plans a run of varying lengths costs, all made by
        ``remat.optimize``."""
        return sum(1 for b in self.buckets if b.plan is not None)

    def length_of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
        """The length of ``args``/``kwargs`` if they are the example's inputs at another length
        of the range (same structure, dtypes, devices, constants; the example's batch), else
        None."""
        leaves, spec = tc.tree_flatten((tuple(args), dict(kwargs)))
        ex_leaves, ex_spec = self._example
        if spec != ex_spec:
            return None
        first = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
        if first is None or first.dim() <= self.dims.seq_dim:
            return None
        s = int(first.shape[self.dims.seq_dim])
        if not self.buckets[0].lo <= s <= self.max_seq:
            return None
        for got, ex in zip(leaves, ex_leaves, strict=True):
            if isinstance(ex, _TensorMeta):
                if not isinstance(got, torch.Tensor) or _meta(got) != dataclasses.replace(
                    ex, shape=shape_at(self.dims, ex.shape, self.batch, s)
                ):
                    return None
            elif isinstance(got, torch.Tensor) or got != ex:
                return None
        return s

    def covers(self, training: bool, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        return training == self.training and self.length_of(args, kwargs) is not None

    def bucket_of(self, s: int) -> Bucket:
        for b in self.buckets:
            if b.lo <= s <= b.hi:
                return b
        raise ValueError(f"length {s} is outside {self.buckets[0].lo}..{self.max_seq}")

    def solved(self, bucket: Bucket) -> Plan:
        """The bucket's plan, solved at its longest length on the fitted problem the first
        time, and checked over the whole bucket with its formula."""
        if bucket.plan is not None:
            return bucket.plan
        t0 = time.perf_counter()
        try:
            plan = self._solve(self.range.problem_at(self.batch, bucket.hi))
        except BudgetError as e:
            e.args = (
                f"{e.args[0]}; planning for length {bucket.hi}, the longest of {bucket.lo}..{bucket.hi}",
            )
            raise
        formula = formula_of(self.dynamic, plan, self.static)
        worst = formula.max_step_peak_bytes(self.batch, bucket.lo, bucket.hi)
        if self.step_budget is not None and worst[0] > self.step_budget:
            raise BudgetError(
                self.step_budget,
                worst[0],
                f"the plan solved at length {bucket.hi} peaks higher at length {worst[1]}, "
                f"inside its bucket {bucket.lo}..{bucket.hi}; choose a bucket ending at "
                f"{worst[1]}",
            )
        bucket.plan, bucket.formula, bucket.worst = plan, formula, worst
        bucket.solve_s = time.perf_counter() - t0
        return plan

    def plan_at(self, problem: Problem, s: int) -> Plan | None:
        """The plan for the graph captured at length ``s``: its bucket's saved set, scheduled
        and simulated on that graph; None if that graph is not the fitted one (the model
        branches on the length or on the inputs' values)."""
        if not same_graph(problem, self.range.template):
            return None
        bucket = self.bucket_of(s)
        solved = self.solved(bucket)
        plan = make_plan(
            problem,
            solved.saved,
            solver=solved.solver,
            proof=solved.proof if s == bucket.hi else Proof.HEURISTIC,  # proven at bucket.hi only
            reason=f"{solved.reason}; solved at length {bucket.hi} for lengths "
            f"{bucket.lo}..{bucket.hi}",
        )
        if self.step_budget is not None and plan.predicted_peak_bytes > self.step_budget:
            # The formula said the bucket fits: a bug in remat, never run over budget silently.
            raise RuntimeError(
                f"remat: at length {s} the plan of bucket {bucket.lo}..{bucket.hi} peaks at "
                f"{plan.predicted_peak_bytes:,} B, over the step budget {self.step_budget:,} B "
                "its formula kept it under; please report this"
            )
        return plan

    def record(self, event: PlanningEvent) -> None:
        self.events.append(event)

    def summary(self) -> str:
        """A line per bucket (its plan's worst step peak and recompute) and the run's cost."""
        lines = [
            f"one plan per bucket of lengths at batch {self.batch} "
            f"(fit: {self.fit_seconds:.1f} s of captures)"
        ]
        for b in self.buckets:
            if b.plan is None or b.worst is None:
                lines.append(f"  {b.lo}..{b.hi}: not solved yet")
                continue
            lines.append(
                f"  {b.lo}..{b.hi}: {b.plan.solver}, step peak <= {b.worst[0]:,} B "
                f"(at length {b.worst[1]}), recompute {b.plan.recompute_time_s * 1e3:.2f} ms at "
                f"length {b.hi}"
            )
        solve_s = sum(b.solve_s for b in self.buckets)
        spent = sum(e.seconds for e in self.events)
        lines.append(
            f"  {self.solves} plans solved ({solve_s:.1f} s); {len(self.events)} lengths "
            f"captured, each run under its bucket's plan without a solve ({spent:.1f} s)"
        )
        return "\n".join(lines)
