"""The search in :mod:`remat.native.planner`: a stitched plan's traced recompute is the chain
DP's sum of per-block recompute (what lets the search skip tracing a choice that recomputes
more than a plan already traced that fits), and skipping them leaves the answer; the MILP
first in a second pass, and ``remat.apply``'s time limit shared by its two passes."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import remat
from remat.graph.profiles import get_profile
from remat.models import TinyGPT
from remat.native import api as native_api
from remat.native import planner
from remat.native.api import analyze
from remat.native.regions import find_blocks
from remat.native.trace import StepTrace
from remat.request import Request
from remat.solver.chain import chain_time
from remat.solver.config import SolverConfig
from tests.zoo import llama

LAYERS = 5
NO_LIMIT = 1e6
"""A time limit no run here comes near: what a test sees is decided by the passes' order and
the timings it forces, not by the clock."""


@pytest.fixture(scope="module")
def analyzed() -> tuple[Any, ...]:
    """A 5-block TinyGPT, ZeRO-3 over 4 fake ranks (the blocks at the ends differ from the
    middle ones), its analysis, and a tracer that traces each plan once (the tests share
    them)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=LAYERS, seq=32).train()
    args = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)
    req = Request.of(zero_stage=3, world_size=4, device_profile="h100")
    blocks = find_blocks(model)
    traced, problem = analyze(
        model, blocks, args, {}, req, get_profile(req.device_profile), fsdp_units=blocks
    )
    seen: dict[tuple[Any, ...], StepTrace] = {}

    def tracer(policies: Sequence[Any], schedule: bool = True) -> StepTrace:
        key = tuple(policies)
        if key not in seen:
            seen[key] = traced.trace(args, {}, policies)
        return seen[key]

    return problem, tracer, seen


def test_a_stitched_plans_recompute_is_the_sum_of_its_blocks(analyzed: tuple[Any, ...]) -> None:
    """Per-block recompute from the uniform plans' traces, summed over a mixed choice, is the
    mixed plan's traced recompute (estimated, not timed): a block recomputes its own ops
    whatever its neighbours run."""
    problem, tracer, _ = analyzed
    options_of, _, n_opts = planner.menus_of(problem)
    table = [
        planner.costs(tracer(planner._policies(options_of, [o] * LAYERS))) for o in range(n_opts)
    ]
    rng = random.Random(0)
    for _ in range(6):
        choice = [rng.randrange(n_opts) for _ in range(LAYERS)]
        trace = tracer(planner._policies(options_of, choice))
        # Roofline estimates from the ops' FLOPs and bytes, not timings.
        assert trace.recompute_time_s > 0 or not any(choice)
        assert trace.recompute_time_s == pytest.approx(chain_time(table, choice), rel=1e-12)


def test_skipping_choices_costlier_than_a_fitting_plan_leaves_the_answer(
    analyzed: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At budgets across the least and the eager peak: the chain DP's plan with the search
    skipping the choices that recompute more than a traced plan that fits is the plan of the
    search tracing them all, and it traced fewer plans in all."""
    problem, tracer, _ = analyzed
    config = SolverConfig()
    fit = planner._fit
    least = tracer(planner.fixed_policies(problem, "block")).peak_bytes
    most = problem.baseline.peak_bytes
    skipped = 0
    for i in range(1, 5):
        budget = least + (most - least) * i // 5
        with monkeypatch.context() as m:  # the search without the skip
            m.setattr(planner, "_fit", lambda *a: fit(*a[:4], lambda: math.inf))
            whole, traced_all = planner._chain(problem, tracer, budget, config, math.inf)
        screened, traced = planner._chain(problem, tracer, budget, config, math.inf)
        assert isinstance(whole, planner.Solution) and isinstance(screened, planner.Solution)
        assert screened.options == whole.options
        assert screened.trace.peak_bytes == whole.trace.peak_bytes <= budget
        assert traced <= traced_all
        skipped += traced_all - traced
    assert skipped > 0


def test_the_milp_first_gives_the_same_plan_and_the_chain_dp_runs_only_with_time(
    analyzed: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``milp_first`` (``remat.apply``'s passes): where the chain DP's traces are cheap, the
    plan is the one of the chain DP first; where they take longer than the MILP did, or do
    not fit in the time left, or the limit passes while it traces its costs, the MILP's plan
    stands; where the MILP found none, the chain DP's plan, however long it takes, unless an
    earlier pass's plan stands (then :class:`planner.OutOfTime` where its traces do not
    fit). The estimates are forced: the clock decides nothing here."""
    problem, tracer, _ = analyzed
    least = tracer(planner.fixed_policies(problem, "block")).peak_bytes
    budget = (least + problem.baseline.peak_bytes) // 2
    config = SolverConfig(time_limit_s=NO_LIMIT)
    first = planner.solve(problem, tracer, budget_bytes=budget, config=config)
    monkeypatch.setattr(planner._Timed, "estimate", lambda self, n: 0.0)
    milp_first = planner.solve(problem, tracer, budget_bytes=budget, config=config, milp_first=True)
    assert milp_first.policies == first.policies
    assert milp_first.trace.recompute_time_s == first.trace.recompute_time_s  # estimated
    seen: list[str] = []
    config = SolverConfig(time_limit_s=NO_LIMIT, progress=seen.append)
    monkeypatch.setattr(planner._Timed, "estimate", lambda self, n: NO_LIMIT / 2)
    alone = planner.solve(problem, tracer, budget_bytes=budget, config=config, milp_first=True)
    assert "the chain DP did not run" in alone.reason
    assert any("would take longer than the MILP whose plan stands" in line for line in seen)
    assert alone.trace.peak_bytes <= budget
    milp = planner._milp
    monkeypatch.setattr(planner, "_milp", lambda *args: None)
    fallback = planner.solve(problem, tracer, budget_bytes=budget, config=config, milp_first=True)
    chain, _ = planner._chain(problem, tracer, budget, config, math.inf)
    assert isinstance(chain, planner.Solution)
    assert fallback.policies == chain.policies and fallback.reason.startswith("chain DP")
    monkeypatch.setattr(planner, "_milp", milp)
    seen.clear()
    monkeypatch.setattr(planner._Timed, "estimate", lambda self, n: math.inf)
    alone = planner.solve(problem, tracer, budget_bytes=budget, config=config, milp_first=True)
    assert "the chain DP did not run" in alone.reason
    assert any("do not fit in the time left: not run" in line for line in seen)
    # Started (the estimate is a lower bound), the chain DP gives up once the limit passes.
    seen.clear()
    late = planner._chain(problem, tracer, budget, config, -math.inf, abandon=True)
    assert late == (None, 0)
    assert seen[-1] == "native: the time limit came before the chain DP's costs: not run"
    # Without a plan from the MILP: the chain DP's, however long it takes, unless an
    # earlier pass's plan stands.
    monkeypatch.setattr(planner, "_milp", lambda *args: None)
    needed = planner.solve(problem, tracer, budget_bytes=budget, config=config, milp_first=True)
    assert needed.policies == chain.policies
    with pytest.raises(planner.OutOfTime):
        planner.solve(
            problem, tracer, budget_bytes=budget, config=config, milp_first=True, standing=True
        )


class _Ticking:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_apply_s_finer_pass_has_the_time_the_blocks_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """``remat.apply``'s passes run the MILP first; its time limit covers both passes and
    their analyses: the sub-modules' pass is given what the blocks' left, their plan
    standing; it is skipped where that is less than the blocks' analysis and MILP took."""
    calls: list[tuple[float, bool]] = []
    solve = planner.solve

    def spy(*args: Any, **kwargs: Any) -> planner.Solution:
        assert kwargs["milp_first"]
        calls.append((kwargs["config"].time_limit_s, kwargs["standing"]))
        return solve(*args, **kwargs)

    monkeypatch.setattr(planner, "solve", spy)
    torch.manual_seed(0)
    model = llama(2).train()  # its blocks split into attention, MLP and norms
    args = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)
    least, most = (
        remat.plan_of(remat.apply(copy.deepcopy(model), args, plan=p)).predicted_peak_bytes
        for p in ("block", "keep_all")
    )
    budget = (least + most) // 2
    # remat.apply's clock reads one second later at each look: the limits the passes get
    # follow from the order of the call's steps, not from how fast this machine runs them.
    monkeypatch.setattr(native_api, "time", _Ticking())
    calls.clear()
    remat.apply(copy.deepcopy(model), args, activation_budget_bytes=budget, time_limit_s=NO_LIMIT)
    (blocks, first), (finer, second) = calls
    # The limit counts from the call, not from the end of each pass's analysis.
    assert blocks < NO_LIMIT and not first
    assert 0 < finer < blocks and second  # what the first pass left, its plan standing

    def slow(*args: Any, **kwargs: Any) -> planner.Solution:  # a MILP that took the limit
        return dataclasses.replace(spy(*args, **kwargs), milp_s=NO_LIMIT)

    monkeypatch.setattr(planner, "solve", slow)
    calls.clear()
    seen: list[str] = []
    remat.apply(
        model, args, activation_budget_bytes=budget, time_limit_s=NO_LIMIT, progress=seen.append
    )
    assert len(calls) == 1
    assert any("their sub-modules are not planned" in line for line in seen)
