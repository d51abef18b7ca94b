"""A step's memory as exact polynomials in batch ``b`` and sequence length ``s``.

Every storage of a transformer's step has ``itemsize * numel`` bytes, and its dimensions are
products of ``b``, ``s`` and constants (``s - 1`` for shifted labels, ``b * heads`` for
attention heads, ``s * s`` for scores): its bytes are a polynomial in ``{1, s, s^2}`` times
``{1, b}``. So are FLOPs. :func:`interpolate` finds a polynomial from sizes measured at a few shapes,
exactly (rational arithmetic, no least squares), and checks it at shapes it was not fitted
on.

A plan's schedule does not depend on sizes, and the simulator adds bytes: the live total at
each moment of a step is a sum of storage polynomials, which :func:`step_polynomials` gets by
simulating once per monomial (storage bytes set to that monomial's coefficients). The peak is
the maximum of those polynomials, and :func:`peak_candidates` keeps only the moments no other
moment provably dominates over the shapes' range (coefficients of the difference, in
``b - b_min`` and ``s - s_min``, all non-negative). Evaluated at any ``(b, s)`` of the range,
the maximum equals the concrete simulator's peak to the byte.

Pure numbers: no torch here (see :mod:`remat.fit.graph_shapes` for the captures).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from math import comb, lcm
from typing import Any

from remat.problem import Problem
from remat.solver.schedule import Schedule
from remat.solver.simulate import simulate

__all__ = [
    "BASIS",
    "FitError",
    "Poly",
    "interpolate",
    "fit_points",
    "StepPolynomials",
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

    @cached_property
    def _integers(self) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """``(d, ((i, j, n), ...))`` with ``self == sum(n * b**i * s**j) / d``: evaluating in
        integers is ~10x faster than in Fractions, and fit searches evaluate millions."""
        d = lcm(*(c.denominator for _, c in self.terms)) if self.terms else 1
        return d, tuple((i, j, int(c * d)) for (i, j), c in self.terms)

    def at(self, b: int, s: int) -> int:
        """The value at an integer shape, which must be an integer (bytes, FLOPs)."""
        d, terms = self._integers
        v = sum(n * b**i * s**j for i, j, n in terms)
        if v % d:
            raise ValueError(f"{self} is not an integer at b={b}, s={s}")
        return v // d

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

    def max_over_s(self, b: int, lo: int, hi: int) -> tuple[int, int]:
        """``(value, s)``: the largest value over the integer lengths ``lo <= s <= hi`` at
        batch ``b``, exactly. A polynomial of degree <= 2 in ``s`` peaks at an end of the
        interval or at its vertex, so those three lengths are all there is to evaluate."""
        if lo > hi:
            raise ValueError(f"empty range of lengths: {lo} > {hi}")
        by_power: dict[int, Fraction] = {}
        for (i, j), c in self.terms:
            if j > 2:
                raise ValueError(f"{self} has degree {j} in s; max_over_s takes 2 at most")
            by_power[j] = by_power.get(j, Fraction(0)) + c * b**i
        lengths = {lo, hi}
        a2, a1 = by_power.get(2, Fraction(0)), by_power.get(1, Fraction(0))
        if a2 < 0:
            vertex = -a1 / (2 * a2)
            for s in (
                vertex.numerator // vertex.denominator,
                -(-vertex.numerator // vertex.denominator),
            ):
                if lo <= s <= hi:
                    lengths.add(s)
        return max((self.at(b, s), s) for s in sorted(lengths))


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


def interpolate(points: Sequence[tuple[int, int]], samples: Sequence[int]) -> Poly:
    """The polynomial of :data:`BASIS` (or its ``b``-free part, for one batch) through
    ``samples`` at ``points`` (as many as monomials)."""
    return Fitter.over(points)(samples)


@dataclass(frozen=True)
class StepPolynomials:
    """The allocator's bytes at every moment of a step, as integer coefficient rows over
    ``monomials`` (divided by ``scale``), and the bytes the forward saves."""

    monomials: tuple[Monomial, ...]
    scale: int
    names: tuple[str, ...]
    """``phase:name`` of each moment."""
    rows: tuple[tuple[int, ...], ...]
    saved: Poly

    def poly(self, k: int) -> Poly:
        return Poly.of(
            {m: Fraction(c, self.scale) for m, c in zip(self.monomials, self.rows[k], strict=True)}
        )

    def polys(self) -> list[tuple[str, Poly]]:
        return [(n, self.poly(k)) for k, n in enumerate(self.names)]


def step_polynomials(
    problem: Problem,
    schedule: Schedule,
    storage: Mapping[str, Poly],
    scratch: Mapping[str, Poly] | None = None,
) -> StepPolynomials:
    """Every moment's bytes as a polynomial: one simulation records when each storage is
    counted (:attr:`Simulation.intervals`), and each moment sums the polynomials of the
    storages counted there, plus its op's scratch."""
    scratch = scratch or {}
    polys = (*storage.values(), *scratch.values())
    monomials = _closed({m for p in polys for m, _ in p.terms})
    scale = lcm(1, *(c.denominator for p in polys for _, c in p.terms))

    def row(p: Poly) -> list[int]:
        return [int(p.coefficient(m) * scale) for m in monomials]

    sim = simulate(problem, schedule, intervals=True)
    assert sim.intervals is not None and sim.held_at_end is not None
    n = len(sim.timeline)
    width = len(monomials)
    delta = [[0] * width for _ in range(n + 1)]
    spans = [(s, a, b) for s, iv in sim.intervals.items() for a, b in iv]
    spans += [(s, a, n - 1) for s, a in sim.held_at_end.items()]
    rows_of: dict[str, list[int]] = {}
    for s, a, b in spans:
        r = rows_of.get(s)
        if r is None:
            r = rows_of[s] = row(storage[s]) if s in storage else [0] * width
        start, stop = delta[a], delta[b + 1]
        for i, c in enumerate(r):
            start[i] += c
            stop[i] -= c
    rows: list[tuple[int, ...]] = []
    running = [0] * width
    for k, step in enumerate(sim.timeline):
        running = [x + d for x, d in zip(running, delta[k], strict=True)]
        if step.phase != "runtime" and step.name in scratch:
            rows.append(tuple(x + c for x, c in zip(running, row(scratch[step.name]), strict=True)))
        else:
            rows.append(tuple(running))
    saved_storages = {s for v in schedule.saved for s in problem.by_name[v].storages}
    saved = sum((storage[s] for s in saved_storages if s in storage), Poly())
    names = tuple(f"{t.phase}:{t.name}" for t in sim.timeline)
    return StepPolynomials(monomials, scale, names, tuple(rows), saved)


def peak_candidates(
    moments: StepPolynomials | Iterable[tuple[str, Poly]], b_min: int, s_min: int
) -> list[tuple[str, Poly]]:
    """The moments whose bytes can be the step's maximum somewhere in ``b >= b_min,
    s >= s_min``: every other moment is dominated by one of these there (proved on the
    coefficients in ``b - b_min`` and ``s - s_min``), so the peak is the maximum over these
    alone."""
    if not isinstance(moments, StepPolynomials):
        moments = _as_rows(list(moments))
    shift = _shift_matrix(moments.monomials, b_min, s_min)
    first: dict[tuple[int, ...], int] = {}
    for k, r in enumerate(moments.rows):
        first.setdefault(r, k)
    shifted = {
        r: tuple(sum(c * shift[i][j] for i, c in enumerate(r)) for j in range(len(r)))
        for r in first
    }
    # Larger at a far corner first, so dominators come before what they dominate.
    far = [(b_min + 64) ** i * (s_min + 4096) ** j for i, j in moments.monomials]
    near = [b_min**i * s_min**j for i, j in moments.monomials]
    order = sorted(first, key=lambda r: (_dot(r, far), _dot(r, near)), reverse=True)
    kept: list[tuple[int, ...]] = []
    for r in order:
        sr = shifted[r]
        if any(all(x >= y for x, y in zip(shifted[q], sr, strict=True)) for q in kept):
            continue
        kept = [q for q in kept if not all(x >= y for x, y in zip(sr, shifted[q], strict=True))]
        kept.append(r)
    return [(moments.names[first[r]], moments.poly(first[r])) for r in kept]


def _dot(r: Sequence[int], w: Sequence[int]) -> int:
    return sum(a * b for a, b in zip(r, w, strict=True))


def _shift_matrix(monomials: Sequence[Monomial], b0: int, s0: int) -> list[list[int]]:
    """``M[i][j]``: the coefficient of monomial ``j`` in monomial ``i`` written in
    ``(b - b0, s - s0)`` (binomial expansion; closed over lower powers, which the basis has)."""
    index = {m: j for j, m in enumerate(monomials)}
    out = [[0] * len(monomials) for _ in monomials]
    for i, (p, q) in enumerate(monomials):
        for a in range(p + 1):
            for e in range(q + 1):
                j = index.get((a, e))
                c = comb(p, a) * comb(q, e) * b0 ** (p - a) * s0 ** (q - e)
                if j is None:
                    if c:
                        raise ValueError(f"the basis lacks ({a}, {e}), needed to shift ({p}, {q})")
                    continue
                out[i][j] += c
    return out


def _as_rows(moments: list[tuple[str, Poly]]) -> StepPolynomials:
    """Polynomials as integer rows over the lower-closed basis of all their monomials."""
    monomials = _closed({m for _, p in moments for m, _ in p.terms})
    scale = lcm(1, *(c.denominator for _, p in moments for _, c in p.terms))
    rows = tuple(tuple(int(p.coefficient(m) * scale) for m in monomials) for _, p in moments)
    return StepPolynomials(monomials, scale, tuple(n for n, _ in moments), rows, Poly())


def _closed(used: Iterable[Monomial]) -> tuple[Monomial, ...]:
    """``used`` with every lower power (shifting ``b * s`` makes ``b``, ``s`` and ``1``)."""
    return tuple(sorted({(a, e) for i, j in used for a in range(i + 1) for e in range(j + 1)}))
