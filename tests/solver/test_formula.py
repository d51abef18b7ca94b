"""Exact polynomial fits and the symbolic peak, on numbers alone."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.solver.formula import (
    BASIS,
    Poly,
    fit_points,
    interpolate,
    peak_candidates,
    step_polynomials,
)
from remat.solver.registry import solve
from remat.solver.simulate import simulate
from tests.solver.builders import chain

coefficients = st.lists(st.integers(-50, 500), min_size=len(BASIS), max_size=len(BASIS))


def _poly(cs: list[int]) -> Poly:
    return Poly.of(dict(zip(BASIS, cs, strict=True)))


@given(coefficients, st.integers(1, 64), st.integers(1, 5000))
def test_a_fit_through_six_shapes_recovers_the_polynomial_everywhere(
    cs: list[int], b: int, s: int
) -> None:
    truth = _poly(cs)
    points = fit_points([2, 3], [20, 24, 28])
    got = interpolate(points, [truth.at(x, y) for x, y in points])
    assert got == truth
    assert got.at(b, s) == truth.at(b, s)


def test_one_batch_fits_a_polynomial_in_s_alone() -> None:
    truth = Poly.of({(0, 0): 7, (0, 1): -3, (0, 2): 5})
    points = fit_points([1], [10, 11, 12])
    assert interpolate(points, [truth.at(b, s) for b, s in points]) == truth
    with pytest.raises(ValueError, match="3 distinct lengths"):
        fit_points([2, 3], [10, 10, 11])


@given(coefficients, st.integers(1, 9), st.integers(1, 99))
def test_shifting_changes_the_variables_not_the_values(cs: list[int], b0: int, s0: int) -> None:
    p = _poly(cs)
    q = p.shifted(b0, s0)
    for b, s in [(b0, s0), (b0 + 3, s0 + 17), (b0 + 11, s0)]:
        assert q(b - b0, s - s0) == p(b, s)


@settings(max_examples=60)
@given(
    st.lists(coefficients, min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(2, 40), st.integers(16, 9000)), min_size=1, max_size=8),
)
def test_the_candidates_hold_the_maximum_of_every_moment(
    polys: list[list[int]], shapes: list[tuple[int, int]]
) -> None:
    moments = [(f"m{i}", _poly(cs)) for i, cs in enumerate(polys)]
    kept = peak_candidates(moments, 2, 16)
    assert {n for n, _ in kept} <= {n for n, _ in moments}
    for b, s in shapes:
        assert max(p.at(b, s) for _, p in kept) == max(p.at(b, s) for _, p in moments)


def test_a_dominated_moment_is_dropped() -> None:
    small = Poly.of({(1, 1): 4})
    big = Poly.of({(1, 1): 4, (0, 0): 1})
    assert [n for n, _ in peak_candidates([("a", small), ("b", big)], 1, 1)] == ["b"]
    # s - 10 >= 0 only from s = 10: below it the constant wins, so both stay.
    grows = Poly.of({(0, 1): 1})
    flat = Poly.of({(0, 0): 10})
    assert len(peak_candidates([("g", grows), ("f", flat)], 1, 1)) == 2
    assert [n for n, _ in peak_candidates([("g", grows), ("f", flat)], 1, 10)] == ["g"]


@given(st.dictionaries(st.sampled_from(BASIS), st.integers(0, 1000), min_size=1), st.data())
def test_step_polynomials_equal_the_simulator_at_every_moment(
    base: dict[tuple[int, int], int], data: st.DataObject
) -> None:
    problem = chain()
    polys = {
        k: Poly.of({m: c + data.draw(st.integers(0, 7)) for m, c in base.items()})
        for k in problem.storage_bytes
    }
    for name in ("keep_all", "keep_inputs", "chen_sqrt"):
        schedule = solve(problem, solver=name, budget_bytes=None).schedule
        steps = step_polynomials(problem, schedule, polys)
        moments, saved = steps.polys(), steps.saved
        b, s = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 3000))
        concrete = dataclasses.replace(
            problem, storage_bytes={k: p.at(b, s) for k, p in polys.items()}
        )
        sim = simulate(concrete, schedule)
        assert [p.at(b, s) for _, p in moments] == [t.allocated_bytes for t in sim.timeline]
        assert saved.at(b, s) == sim.saved_bytes
        assert max(p.at(b, s) for _, p in peak_candidates(steps, 1, 1)) == sim.peak_bytes
        assert max(p.at(b, s) for _, p in peak_candidates(moments, 1, 1)) == sim.peak_bytes


def test_rational_coefficients_stay_exact() -> None:
    half = Poly.of({(0, 2): Fraction(1, 2), (0, 1): Fraction(1, 2)})  # s (s + 1) / 2
    assert half.at(1, 9) == 45
    with pytest.raises(ValueError, match="not an integer"):
        Poly.of({(0, 1): Fraction(1, 2)}).at(1, 3)


@settings(max_examples=200, deadline=None)
@given(
    cs=st.lists(st.integers(-500, 500), min_size=len(BASIS), max_size=len(BASIS)),
    b=st.integers(1, 8),
    lo=st.integers(0, 60),
    width=st.integers(0, 60),
)
def test_the_largest_value_over_lengths_is_exact(
    cs: list[int], b: int, lo: int, width: int
) -> None:
    """Ends and vertex against every length (concave, convex and linear in s all occur)."""
    p = _poly(cs)
    value, at = p.max_over_s(b, lo, lo + width)
    assert value == max(p.at(b, s) for s in range(lo, lo + width + 1))
    assert lo <= at <= lo + width and p.at(b, at) == value
