"""The search in :mod:`remat.executors.sac.planner`: a stitched plan's traced recompute is the chain
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
from remat.executors.sac import apply as native_api
from remat.executors.sac import passes, planner, traced_chain
from remat.executors.sac.events import StepTrace
from remat.executors.sac.passes import analyze
from remat.executors.sac.policies import menus_of
from remat.executors.sac.regions import find_blocks
from remat.measure.profiles import get_profile
from remat.models import TinyGPT
from remat.request import Request
from remat.solver import clock
from remat.solver.chain_dp import chain_time
from remat.solver.config import SolverConfig
from remat.solver.plan import Proof
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
    """Per-block added time (recompute and SAC's dispatch) from the uniform plans' traces,
    summed over a mixed choice, is the mixed plan's traced added time (estimated, not timed):
    a block recomputes its own ops and calls its own policy whatever its neighbours run."""
    problem, tracer, _ = analyzed
    options_of, _, n_opts = menus_of(problem)
    table = [
        planner.costs(tracer(traced_chain._policies(options_of, [o] * LAYERS)))
        for o in range(n_opts)
    ]
    rng = random.Random(0)
    for _ in range(6):
        choice = [rng.randrange(n_opts) for _ in range(LAYERS)]
        trace = tracer(traced_chain._policies(options_of, choice))
        # Roofline estimates from the ops' FLOPs and bytes, not timings.
        assert trace.added_time_s > 0 or not any(choice)
        assert trace.added_time_s == pytest.approx(chain_time(table, choice), rel=1e-12)


def test_skipping_choices_costlier_than_a_fitting_plan_leaves_the_answer(
    analyzed: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At budgets across the least and the eager peak: the chain DP's plan with the search
    skipping the choices that recompute more than a traced plan that fits is the plan of the
    search tracing them all, and it traced fewer plans in all."""
    problem, tracer, _ = analyzed
    config = SolverConfig()
    fit = traced_chain._fit
    least = tracer(planner.fixed_policies(problem, "block")).peak_bytes
    most = problem.baseline.peak_bytes
    skipped = 0
    for i in range(1, 5):
        budget = least + (most - least) * i // 5
        with monkeypatch.context() as m:  # the search without the skip
            m.setattr(traced_chain, "_fit", lambda *a: fit(*a[:4], lambda: math.inf))
            whole, traced_all = traced_chain.chain_solution(problem, tracer, budget, config)
        screened, traced = traced_chain.chain_solution(problem, tracer, budget, config)
        assert isinstance(whole, planner.Solution) and isinstance(screened, planner.Solution)
        assert screened.options == whole.options
        assert screened.trace.peak_bytes == whole.trace.peak_bytes <= budget
        assert traced <= traced_all
        skipped += traced_all - traced
    assert skipped > 0


def test_the_milp_first_checked_against_the_per_block_family_below_the_copies(
    analyzed: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``milp_first`` (``remat.apply``'s passes) on a stack too shallow for shallow copies:
    the MILP's plan, with the per-block family bisected as its second opinion (the progress
    says so) and the chain DP not run; without second opinions (the finer pass), the MILP's
    plan alone; where the MILP found none, the chain DP's either way."""
    problem, tracer, _ = analyzed
    least = tracer(planner.fixed_policies(problem, "block")).peak_bytes
    budget = (least + problem.baseline.peak_bytes) // 2
    seen: list[str] = []
    config = SolverConfig(time_limit_s=NO_LIMIT, progress=seen.append)
    first = planner.solve(problem, tracer, budget_bytes=budget, config=config, milp_first=True)
    assert "per-block family" in first.reason and "chain DP" not in first.reason
    assert any("per-block family by bisection as a second opinion" in line for line in seen)
    milp = planner._milp(problem, tracer, budget, config)
    assert milp is not None and first.trace.peak_bytes <= budget
    assert first.trace.added_time_s <= milp.trace.added_time_s
    lone = planner.solve(
        problem, tracer, budget_bytes=budget, config=config, milp_first=True, second_opinions=False
    )
    assert lone.policies == milp.policies
    assert "no second opinion" in lone.reason and "per-block family" not in lone.reason
    monkeypatch.setattr(planner, "_milp", lambda *args: None)
    chain, _ = traced_chain.chain_solution(problem, tracer, budget, config)
    assert isinstance(chain, planner.Solution)
    for second in (True, False):
        fallback = planner.solve(
            problem,
            tracer,
            budget_bytes=budget,
            config=config,
            milp_first=True,
            second_opinions=second,
        )
        assert fallback.policies == chain.policies and fallback.reason.startswith("chain DP")


def test_the_chain_dp_s_work_limit_cuts_its_budgets_and_says_so(
    analyzed: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where its counted work passes the limit, the DP keeps what it traced and its reason
    says so; a plan of the per-block family that fits is among them (traced after the DP's
    budgets)."""
    problem, tracer, _ = analyzed
    least = tracer(planner.fixed_policies(problem, "block")).peak_bytes
    budget = (least + problem.baseline.peak_bytes) // 2
    monkeypatch.setattr(clock, "TRACED_EVENT_S", 1.0)  # each trace: seconds of work
    config = SolverConfig(time_limit_s=1.5)
    with clock.planning(config):
        chain, _ = traced_chain.chain_solution(problem, tracer, budget, config)
    assert isinstance(chain, planner.Solution) and chain.trace.peak_bytes <= budget
    assert "the time limit (counted work) cut the DP after 1 of" in chain.reason


class _Ticking:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_apply_s_passes_do_not_depend_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """``remat.apply``'s passes (the blocks', then their sub-modules') each solve with the
    request's time limit, however long the other took: a clock that jumps one second at each
    look plans what an idle machine does. The finer pass is skipped only by its count of
    events (:data:`passes.FINER_PASS_EVENTS`), and the progress says so."""
    calls: list[float] = []
    second: list[bool] = []
    solve = planner.solve

    def spy(*args: Any, **kwargs: Any) -> planner.Solution:
        assert kwargs["milp_first"]
        calls.append(kwargs["config"].time_limit_s)
        second.append(kwargs["second_opinions"])
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

    def planned() -> remat.Plan:
        calls.clear()
        second.clear()
        work = copy.deepcopy(model)
        remat.apply(work, args, activation_budget_bytes=budget, time_limit_s=600)
        assert calls == [600, 600]
        assert second == [True, False]  # the blocks' plan had them
        return remat.plan_of(work)

    idle = planned()
    monkeypatch.setattr(native_api, "time", _Ticking())
    monkeypatch.setattr(planner, "time", _Ticking())
    monkeypatch.setattr(traced_chain, "time", _Ticking())
    ticking = planned()
    assert ticking.saved == idle.saved
    assert ticking.predicted_peak_bytes == idle.predicted_peak_bytes
    monkeypatch.setattr(passes, "FINER_PASS_EVENTS", 0)
    calls.clear()
    seen: list[str] = []
    remat.apply(model, args, activation_budget_bytes=budget, time_limit_s=600, progress=seen.append)
    assert len(calls) == 1
    assert any("the blocks' sub-modules are not planned" in line for line in seen)


@pytest.mark.parametrize("milp_first", [False, True], ids=["chain_dp", "milp_and_bisection"])
def test_auto_is_never_worse_than_megatron_s_per_block_family(
    analyzed: tuple[Any, ...], milp_first: bool
) -> None:
    """At every budget between every block recomputed and none, ``auto`` recomputes no more
    than the cheapest plan of the per-block family that fits (the first N blocks recomputed
    whole, the rest eager), whether the chain DP runs first or the MILP does, checked
    against the family bisected (as ``remat.apply`` runs it below shallow copies)."""
    problem, tracer, _ = analyzed
    every = planner.fixed_policies(problem, "block")
    n = len(problem.blocks)
    family = [tracer(tuple(every[:k]) + (None,) * (n - k)) for k in range(n + 1)]
    config = SolverConfig(time_limit_s=NO_LIMIT)
    least, most = family[-1].peak_bytes, problem.baseline.peak_bytes
    for budget in (least + (most - least) * i // 5 for i in range(1, 5)):
        megatron = min(t.added_time_s for t in family if t.peak_bytes <= budget)
        bisected, _ = traced_chain.per_block(problem, tracer, budget)
        assert bisected is not None and bisected.trace.added_time_s == megatron
        auto = planner.solve(
            problem, tracer, budget_bytes=budget, config=config, milp_first=milp_first
        )
        assert auto.trace.peak_bytes <= budget
        assert auto.trace.added_time_s <= megatron * (1 + 1e-9), budget


def test_the_per_block_family_is_bisected_below_a_plan_to_beat(
    analyzed: tuple[Any, ...],
) -> None:
    """With a traced plan to beat (the MILP's), the family's cheapest member that fits is
    returned where it adds less time, None where it does not; a plan to beat that
    adds nothing leaves none to bisect."""
    problem, tracer, _ = analyzed
    every = planner.fixed_policies(problem, "block")
    n = len(problem.blocks)
    least = tracer(every).peak_bytes
    budget = (least + problem.baseline.peak_bytes) // 2
    plain, _ = traced_chain.per_block(problem, tracer, budget)
    assert plain is not None and plain.trace.added_time_s > 0
    cost = plain.trace.added_time_s

    def beat(recompute_s: float) -> planner.Solution:
        # Only the plan's recompute time is read.
        trace: Any = _Recompute(recompute_s)
        return planner.Solution((None,) * n, trace, "exact", "", Proof.HEURISTIC)

    above, _ = traced_chain.per_block(problem, tracer, budget, beat(cost * 1.01))
    assert above is not None and above.policies == plain.policies
    level, _ = traced_chain.per_block(problem, tracer, budget, beat(cost))
    assert level is None
    nothing, _ = traced_chain.per_block(problem, tracer, budget, beat(0.0))
    assert nothing is None


@dataclasses.dataclass(frozen=True)
class _Recompute:
    """A traced plan's stand-in: its added time alone."""

    added_time_s: float
