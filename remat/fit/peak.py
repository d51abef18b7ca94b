"""A step's peak memory as a formula in batch and sequence length: the objects both
executors' formulas are (:mod:`remat.fit.graph_formula` for remat's executor,
:mod:`remat.fit.sac_shapes` for PyTorch's selective checkpointing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.budget import StaticMemory
from remat.fit.graph_shapes import range_text, within
from remat.solver.formula import Poly

__all__ = ["MemoryFormula", "RangeFormula"]


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
        ``Max`` over the candidate moments, plus the static bytes. The ``Max`` is left
        unevaluated: no candidate is below another over its range (the fit dropped those),
        and sympy's pairwise comparisons of 14 quadratics took seconds to find that."""
        import sympy

        b, s = sympy.symbols("b s", integer=True, positive=True)
        pieces = []
        for r in self.ranges:
            moments = [p.to_sympy() for _, p in r.candidates]
            peak = sympy.Max(*moments, evaluate=False) if len(moments) > 1 else moments[0]
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
