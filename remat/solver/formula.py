"""A step's memory as exact polynomials in batch ``b`` and sequence length ``s``.

Every storage of a transformer's step has ``itemsize * numel`` bytes, and its dimensions are
products of ``b``, ``s`` and constants (``s - 1`` for shifted labels, ``b * heads`` for
attention heads, ``s * s`` for scores): its bytes are a polynomial in ``{1, s, s^2}`` times
``{1, b}``. So are FLOPs. :func:`fit` finds a polynomial from sizes measured at a few shapes,
exactly (rational arithmetic, no least squares), and checks it at shapes it was not fitted
on.

A plan's schedule does not depend on sizes, and the simulator adds bytes: the live total at
each moment of a step is a sum of storage polynomials, which :func:`step_polynomials` gets by
simulating once per monomial (storage bytes set to that monomial's coefficients). The peak is
the maximum of those polynomials, and :func:`peak_candidates` keeps only the moments no other
moment provably dominates over the shapes' range (coefficients of the difference, in
``b - b_min`` and ``s - s_min``, all non-negative). Evaluated at any ``(b, s)`` of the range,
the maximum equals the concrete simulator's peak to the byte.

Pure numbers: no torch here (see :mod:`remat.graph.dynamic` for the captures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import comb, lcm
from typing import Any

from remat.problem import Problem
from remat.solver.schedule import Schedule
from remat.solver.simulate import simulate

__all__ = [
    "BASIS",
    "FitError",
    "Poly",
    "fit",
    "fit_points",
    "peak_candidates",
    "step_polynomials",
]

Monomial = tuple[int, int]
"""Powers of ``(b, s)``."""

BASIS: tuple[Monomial, ...] = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))
"""``{1, s, s^2} x {1, b}``: every size of the models checked (GPT-2, Llama, BERT, TinyGPT)."""


class FitError(ValueError):
    """A size is not a polynomial of the basis at the shapes tried."""


@dataclass(frozen=True)
class Poly:
    """``sum(c * b**i * s**j)`` with exact rational coefficients, keyed by ``(i, j)``."""

    terms: tuple[tuple[Monomial, Fraction], ...] = ()

    @staticmethod
    def of(coefficients: Mapping[Monomial, Fraction | int]) -> Poly:
        return Poly(tuple(sorted((m, Fraction(c)) for m, c in coefficients.items() if c != 0)))

    @staticmethod
    def constant(c: int) -> Poly:
        return Poly.of({(0, 0): c})

    def __call__(self, b: int, s: int) -> Fraction:
        return sum((c * b**i * s**j for (i, j), c in self.terms), Fraction(0))

    def at(self, b: int, s: int) -> int:
        """The value at an integer shape, which must be an integer (bytes, FLOPs)."""
        v = self(b, s)
        if v.denominator != 1:
            raise ValueError(f"{self} is not an integer at b={b}, s={s}")
        return int(v)

    def coefficient(self, m: Monomial) -> Fraction:
        return dict(self.terms).get(m, Fraction(0))

    def __add__(self, other: Poly) -> Poly:
        out: dict[Monomial, Fraction] = dict(self.terms)
        for m, c in other.terms:
            out[m] = out.get(m, Fraction(0)) + c
        return Poly.of(out)

    def __sub__(self, other: Poly) -> Poly:
        return self + Poly(tuple((m, -c) for m, c in other.terms))

    def shifted(self, b0: int, s0: int) -> Poly:
        """The same polynomial in ``(b - b0, s - s0)``: non-negative coefficients there mean
        non-negative for every ``b >= b0, s >= s0``."""
        out: dict[Monomial, Fraction] = {}
        for (i, j), c in self.terms:
            for a in range(i + 1):
                for e in range(j + 1):
                    m = (a, e)
                    out[m] = out.get(m, Fraction(0)) + c * comb(i, a) * comb(j, e) * (
                        Fraction(b0) ** (i - a) * Fraction(s0) ** (j - e)
                    )
        return Poly.of(out)

    def to_sympy(self) -> Any:
        import sympy

        b, s = sympy.symbols("b s", integer=True, positive=True)
        return sympy.expand(sum((sympy.Rational(c) * b**i * s**j for (i, j), c in self.terms), 0))

    def __str__(self) -> str:
        return str(self.to_sympy())


def fit_points(b_values: Sequence[int], s_values: Sequence[int]) -> list[tuple[int, int]]:
    """The shapes a fit over :data:`BASIS` needs: two batches times three lengths (one batch:
    the polynomial in ``s`` alone)."""
    if len(set(s_values)) < 3 or len(set(b_values)) not in (1, 2):
        raise ValueError("a fit needs 3 distinct lengths and 1 or 2 distinct batches")
    return [(b, s) for b in b_values for s in s_values]


def _basis_of(points: Sequence[tuple[int, int]]) -> tuple[Monomial, ...]:
    """The monomials of the variables that vary over ``points`` (a fixed batch or a model
    without a sequence has none of that variable's powers)."""
    b_varies = len({b for b, _ in points}) > 1
    s_varies = len({s for _, s in points}) > 1
    return tuple(m for m in BASIS if (b_varies or m[0] == 0) and (s_varies or m[1] == 0))


def _inverse(matrix: list[list[Fraction]]) -> list[list[Fraction]]:
    """Gauss-Jordan over the rationals (the fit's matrix is 3x3 or 6x6)."""
    n = len(matrix)
    a = [[*row, *(Fraction(int(i == j)) for j in range(n))] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col] != 0), None)
        if pivot is None:
            raise ValueError("the fit's shapes do not determine the polynomial")
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [x / p for x in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0:
                f = a[r][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]


@dataclass(frozen=True)
class Fitter:
    """Fits many sizes measured at the same shapes with one matrix inverse."""

    points: tuple[tuple[int, int], ...]
    basis: tuple[Monomial, ...]
    inverse: tuple[tuple[Fraction, ...], ...]

    @staticmethod
    def over(points: Sequence[tuple[int, int]]) -> Fitter:
        basis = _basis_of(points)
        if len(points) != len(basis):
            raise ValueError(f"{len(basis)} monomials need {len(basis)} shapes, got {len(points)}")
        matrix = [[Fraction(b**i * s**j) for i, j in basis] for b, s in points]
        inv = _inverse(matrix)
        return Fitter(tuple(points), basis, tuple(tuple(r) for r in inv))

    def __call__(self, samples: Sequence[int]) -> Poly:
        coefficients = {
            m: sum((row[k] * samples[k] for k in range(len(samples))), Fraction(0))
            for m, row in zip(self.basis, self.inverse, strict=True)
        }
        return Poly.of(coefficients)


def fit(points: Sequence[tuple[int, int]], samples: Sequence[int]) -> Poly:
    """The polynomial of :data:`BASIS` (or its ``b``-free part, for one batch) through
    ``samples`` at ``points`` (as many as monomials)."""
    return Fitter.over(points)(samples)


def step_polynomials(
    problem: Problem,
    schedule: Schedule,
    storage: Mapping[str, Poly],
    scratch: Mapping[str, Poly] | None = None,
) -> tuple[list[tuple[str, Poly]], Poly]:
    """``(moments, saved)``: the allocator's bytes at every moment of the step as
    ``(phase:name, polynomial)``, and the bytes the forward saves for the backward.

    The simulator runs once per monomial with every storage (and scratch) set to that
    monomial's coefficient, scaled to integers; by linearity the sums are the polynomials.
    """
    scratch = scratch or {}
    monomials = sorted({m for p in (*storage.values(), *scratch.values()) for m, _ in p.terms})
    scale = lcm(
        1, *(c.denominator for p in (*storage.values(), *scratch.values()) for _, c in p.terms)
    )
    steps: list[tuple[str, dict[Monomial, Fraction]]] = []
    saved: dict[Monomial, Fraction] = {}
    for m in monomials:
        scaled = dataclasses.replace(
            problem,
            storage_bytes={k: int(p.coefficient(m) * scale) for k, p in storage.items()},
            values=tuple(
                dataclasses.replace(v, scratch_bytes=int(scratch[v.name].coefficient(m) * scale))
                if v.name in scratch
                else dataclasses.replace(v, scratch_bytes=0)
                for v in problem.values
            ),
        )
        sim = simulate(scaled, schedule)
        if not steps:
            steps = [(f"{t.phase}:{t.name}", {}) for t in sim.timeline]
        for (_, coefficients), t in zip(steps, sim.timeline, strict=True):
            coefficients[m] = Fraction(t.allocated_bytes, scale)
        saved[m] = Fraction(sim.saved_bytes, scale)
    if not monomials:  # nothing allocates: every moment holds 0 bytes
        sim = simulate(problem, schedule)
        steps = [(f"{t.phase}:{t.name}", {}) for t in sim.timeline]
    return [(name, Poly.of(c)) for name, c in steps], Poly.of(saved)


def peak_candidates(
    moments: Iterable[tuple[str, Poly]], b_min: int, s_min: int
) -> list[tuple[str, Poly]]:
    """The moments whose bytes can be the step's maximum somewhere in ``b >= b_min,
    s >= s_min``: every other moment is dominated by one of these there (proved on the
    shifted coefficients), so the peak is the maximum over these alone."""
    unique: dict[Poly, str] = {}
    for name, p in moments:
        unique.setdefault(p, name)
    polys = list(unique)
    shifted = {p: p.shifted(b_min, s_min) for p in polys}
    kept: list[Poly] = []
    # Larger polynomials first (at the range's corner), so dominators are met before the
    # polynomials they dominate.
    for p in sorted(
        polys, key=lambda q: (q(b_min, s_min), q(b_min + 64, s_min + 4096)), reverse=True
    ):
        if any(_dominates(shifted[q], shifted[p]) for q in kept):
            continue
        kept = [q for q in kept if not _dominates(shifted[p], shifted[q])]
        kept.append(p)
    return [(unique[p], p) for p in kept]


def _dominates(q: Poly, p: Poly) -> bool:
    """``q >= p`` wherever the (shifted) variables are non-negative."""
    return all(c >= 0 for _, c in (q - p).terms)
