"""The MILP's compression is lossless: the compressed problem simulates every plan exactly as
the original does, and lowering a plan into it never costs more time or bytes."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings

import remat
from remat.problem import Problem, Role
from remat.solver import Proof, make_plan
from remat.solver.compress import compress
from tests.solver.test_schedule_properties import problems
from tests.zoo import ZOO


def _outcome(problem: Problem, saved: frozenset[str]) -> tuple[int, float, float]:
    sim = make_plan(problem, saved, solver="t", reason="", proof=Proof.HEURISTIC).simulation
    return sim.peak_bytes, round(sim.recompute_time_s, 12), round(sim.step_time_s, 12)


def _check(problem: Problem, rng: random.Random, trials: int) -> None:
    comp = compress(problem)
    small = comp.problem
    fwd = [v.name for v in problem.values if v.role is Role.FORWARD]
    rand = {n for n in fwd if problem.by_name[n].random}
    for _ in range(trials):
        q = rng.random()
        drawn = frozenset({n for n in fwd if rng.random() < q} | rand)
        plan = make_plan(problem, drawn, solver="t", reason="", proof=Proof.HEURISTIC)
        saved = plan.saved  # what the backward reads
        lowered = comp.lower(saved)
        # The lowered plan runs the same on both problems...
        assert _outcome(small, lowered) == _outcome(problem, lowered)
        # ...and is never worse than the plan it came from.
        peak, cost, _ = _outcome(problem, saved)
        new_peak, new_cost, _ = _outcome(problem, lowered)
        assert new_peak <= peak and new_cost <= cost + 1e-9


@settings(max_examples=200, deadline=None)
@given(problems())
def test_random_dags(case: tuple[Problem, frozenset[str]]) -> None:
    _check(case[0], random.Random(0), 10)


@pytest.mark.parametrize(
    "case", [c for c in ZOO if c.name in ("hf_gpt2", "hf_llama", "cnn_bn")], ids=lambda c: c.name
)
def test_zoo(case: object) -> None:
    torch.manual_seed(0)
    problem = remat.analyze(case.build(), case.inputs(), case.kwargs).problem  # type: ignore[attr-defined]
    comp = compress(problem)
    # Something was compressed: views merged and chains folded.
    assert comp.rep and len(comp.problem.values) < len(problem.values)
    _check(problem, random.Random(0), 30)
