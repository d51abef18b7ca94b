"""Blocks found by structure, per-block menus, the chain DP: plans that fit, run bitwise, and
are never worse than checkpointing every block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat.models import TinyGPT
from remat.problem import Problem
from remat.solver.chain import chain_solver
from remat.solver.chain_dp import ChainCosts, chain_dp, chain_peak
from remat.solver.chain_search import _menu_window
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import must_save
from remat.solver.fronts import kept_problem
from remat.solver.menus import cached_menu
from remat.solver.plan import Proof, make_plan
from remat.solver.registry import least_peak, solve
from remat.solver.structure import block_problem, find_structure
from tests.checks import assert_trains_like_eager

CONFIG = SolverConfig(time_limit_s=3)


def _gpt(layers: int = 3, skip: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = SkipGPT(layers) if skip else TinyGPT(vocab=64, dim=32, heads=2, layers=layers, seq=32)
    return model, torch.randint(0, 64, (2, 32))


class SkipGPT(TinyGPT):
    """A branch around the blocks: the head also reads the embeddings."""

    def __init__(self, layers: int) -> None:
        super().__init__(vocab=64, dim=32, heads=2, layers=layers, seq=32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x0 = self.drop(self.tok(idx) + self.pos(pos))
        x = x0
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x + x0))


class Mixed(nn.Module):
    """A ModuleList whose last child differs in width: not identical blocks. (An input layer
    first: otherwise the first block differs too, computing no gradient for its input.)"""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_identical_blocks_form_one_class_and_correspond_by_position() -> None:
    model, x = _gpt(3)
    problem = remat.analyze(model, (x,)).problem
    s = find_structure(problem)
    assert [b.path for b in s.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert s.classes == ((0, 1, 2),) and s.repeated
    mapping = s.correspondence(0, 2)
    values = problem.by_name
    for a, b in mapping.items():
        assert values[a].op == values[b].op and values[a].shape == values[b].shape
    # A block cut out is a problem of its own: its keep-all plan runs and recomputes nothing.
    sub = block_problem(problem, s.blocks[1])
    plan = solve(sub, solver="keep_all", budget_bytes=None)
    assert plan.recompute_time_s == 0 and plan.predicted_peak_bytes > 0


def test_blocks_that_differ_land_in_different_classes() -> None:
    problem = remat.analyze(Mixed(), (torch.randn(4, 8),)).problem
    s = find_structure(problem)
    assert len(s.blocks) == 3 and s.classes == ((0, 1), (2,))


def test_no_repeated_blocks_is_a_clear_error_and_auto_falls_back() -> None:
    from tests.zoo import ConvBN

    torch.manual_seed(0)
    problem = remat.analyze(ConvBN(), (torch.randn(2, 3, 8, 8),)).problem
    with pytest.raises(ValueError, match="repeated blocks"):
        chain_solver(problem, budget_bytes=1 << 40, config=CONFIG)
    budget = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes - 1
    assert solve(problem, solver="auto", budget_bytes=budget, config=CONFIG).solver != "chain"


@pytest.mark.parametrize("skip", [False, True], ids=["chain", "branch_around_blocks"])
def test_chain_plans_fit_train_bitwise_and_beat_block_checkpointing(skip: bool) -> None:
    model, x = _gpt(3, skip)
    problem = remat.analyze(model, (x,)).problem
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    block = solve(problem, solver="block", budget_bytes=None)
    lo = least_peak(problem, "chain", CONFIG)
    assert lo < keep_all
    costs, plans = [], []
    for budget in (lo, (lo + keep_all) // 2, keep_all):
        plan = chain_solver(problem, budget_bytes=budget, config=CONFIG)
        plans.append(plan)
        assert plan.predicted_peak_bytes <= budget
        costs.append(plan.recompute_time_s)
        if budget >= block.predicted_peak_bytes:
            # Every block fully checkpointed is one of the chain's options.
            assert plan.recompute_time_s <= block.recompute_time_s + 1e-12
    assert costs[-1] == 0.0
    # At the least peak the plan carries a proven floor (remat.solver.bound) below its cost.
    floor = plans[0].lower_bound_s
    assert floor is not None and 0 < floor <= costs[0]
    assert_trains_like_eager(model, (x,), {}, steps=2, plan=plans[-1])
    assert_trains_like_eager(model, (x,), {}, steps=2, plan=plans[0])
    with pytest.raises(BudgetError):
        chain_solver(problem, budget_bytes=lo // 2, config=CONFIG)


def test_hf_llama_chain_plans_train_bitwise() -> None:
    """GQA, RMSNorm (whose backward ops lose their module path), SDPA, rotary embeddings."""
    from tests.zoo import ZOO

    case = next(c for c in ZOO if c.name == "hf_llama")
    torch.manual_seed(0)
    model = case.build()
    problem = remat.analyze(model, case.inputs(), case.kwargs).problem
    assert find_structure(problem).classes == ((0, 1),)
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    lo = least_peak(problem, "chain", CONFIG)
    for budget in (lo, (lo + keep_all) // 2):
        plan = chain_solver(problem, budget_bytes=budget, config=CONFIG)
        assert plan.predicted_peak_bytes <= budget and plan.recomputed
        assert_trains_like_eager(model, case.inputs(), case.kwargs, steps=2, plan=plan)


def test_the_all_blocks_window_frees_what_neighbouring_menu_options_disagree_on() -> None:
    """The refinement window that lets blocks trade memory: in every block, the values on
    which the block's nearest menu option and its neighbours disagree, plus where the block
    departs from that option; nothing else of any block."""
    model, x = _gpt(3)
    problem = remat.analyze(model, (x,)).problem
    s = find_structure(problem)
    (cls,) = s.classes
    menu = sorted(cached_menu(problem, s, cls, CONFIG), key=lambda o: o.time_s)
    assert len(menu) >= 5
    i = len(menu) // 2
    saved = {s.correspondence(cls[0], k)[n] for k in cls for n in menu[i].saved}
    near = [set(o.saved) for o in menu[i - 1 : i + 2]]
    in_play = set().union(*near) - near[0].intersection(*near)
    assert in_play
    expected = {s.correspondence(cls[0], k)[n] for k in cls for n in in_play}
    assert _menu_window(s, {cls: menu}, saved, 1) == expected
    # A block that departs from its option: the departure is in play too (in that block only).
    extra = next(n for n in s.blocks[1].forward if n not in saved and n not in expected)
    assert _menu_window(s, {cls: menu}, saved | {extra}, 1) == expected | {extra}
    assert _menu_window(s, {cls: menu}, saved, 0) == set()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_chain_peak_is_the_dp_model_of_one_choice(seed: int) -> None:
    """chain_peak evaluates the model chain_dp plans with: every choice the DP returns is
    within the budget there, and the DP finds one whenever a uniform choice is (its
    quantised bytes round up, so a choice exactly at the budget may be refused)."""
    import random

    rng = random.Random(seed)
    n, n_opts = rng.randint(1, 6), rng.randint(1, 4)
    costs = [
        ChainCosts(
            keep=[rng.randint(0, 1000) for _ in range(n)],
            fw_base=[rng.randint(0, 2000) for _ in range(n)],
            bw_base=[rng.randint(0, 2000) for _ in range(n)],
            tail_base=rng.randint(0, 2000),
            head=rng.randint(0, 500),
            time_s=[rng.random() for _ in range(n)],
        )
        for _ in range(n_opts)
    ]
    budget = rng.randint(500, 8000)
    choice = chain_dp(costs, budget, n)
    if choice is not None:
        assert chain_peak(costs, choice) <= budget
    uniform = [chain_peak(costs, [o] * n) for o in range(n_opts)]
    if min(uniform) <= budget - 10 * n:
        assert choice is not None


def test_a_second_capture_of_the_model_reuses_its_block_menu(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Menus are cached by the block's whole content and the solver's settings: a second
    capture of the same model (another ``optimize`` call) solves no menu again; another
    model, or another time limit, does. (The solves are counted, not run.)"""
    from remat.solver import menus

    solved: list[tuple[Problem, SolverConfig]] = []

    def menu(
        sub: Problem, keep_all: object, heavy: Problem, config: SolverConfig, kept: object
    ) -> list[object]:
        solved.append((sub, config))
        return []

    monkeypatch.setattr(menus, "block_menu", menu)
    monkeypatch.setattr(menus, "_MENUS", type(menus._MENUS)())

    def cached(model: nn.Module, x: torch.Tensor, config: SolverConfig = CONFIG) -> object:
        problem = remat.analyze(model, (x,)).problem
        s = find_structure(problem)
        return cached_menu(problem, s, s.classes[0], config)

    model, x = _gpt(3)
    first = cached(model, x)
    assert cached(model, x) is first and len(solved) == 1
    other, y = _gpt(2, skip=True)
    assert cached(other, y) is not first and len(solved) == 2
    assert cached(model, x, SolverConfig(time_limit_s=4)) is not first and len(solved) == 3
    assert cached(model, x, SolverConfig(time_limit_s=3, progress=print)) is first
    assert len(solved) == 3  # the progress callback is not a setting


def test_the_menu_holds_points_of_the_block_s_front_none_of_its_options_beats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """menus.front_plans (the best plans of recompute plus a price per byte kept) are
    points of the block's front, and of its front as the backward's first moments see it
    (its kept problem): no option of the block's menu keeps as little and recomputes less;
    and the menu asks for both."""
    from remat.solver import menus

    # The prices whose solves finish in well under a second here, given a limit that never
    # binds, so each front plan is optimal however slow the machine (an incumbent cut short
    # by a time limit need not be on the front).
    monkeypatch.setattr(menus, "FRONT_WEIGHTS", (0.3, 0.7))
    unbounded = SolverConfig(time_limit_s=3600)
    model, x = _gpt(3)
    problem = remat.analyze(model, (x,)).problem
    s = find_structure(problem)
    block = s.blocks[s.classes[0][0]]
    sub, keep_all, heavy = menus.block_problems(problem, block)
    kp = kept_problem(problem, block)
    assert kp is not None
    least = make_plan(sub, must_save(sub), solver="", reason="", proof=Proof.HEURISTIC)
    slope = least.recompute_time_s / keep_all.simulation.saved_bytes
    fwd = set(sub.forward_names)

    def on_sub(saved: frozenset[str]) -> tuple[int, float]:
        plan = make_plan(sub, saved, solver="", reason="", proof=Proof.HEURISTIC)
        return plan.simulation.saved_bytes, plan.recompute_time_s

    def on_kept(saved: frozenset[str]) -> tuple[int, float]:
        mine = (saved & set(kp.problem.by_name)) | set(must_save(kp.problem))
        p = make_plan(kp.problem, mine, solver="", reason="", proof=Proof.HEURISTIC)
        return kp.kept(p), p.recompute_time_s

    quick = SolverConfig(time_limit_s=2)  # a shorter menu: its options are what is compared
    menu = menus.block_menu(sub, keep_all, heavy, quick, kp)
    inf = float("inf")
    for measure, fronts in (
        (on_sub, menus.front_plans(sub, sub, slope, unbounded, inf)),
        (on_kept, menus.front_plans(sub, kp.problem, kp.slope(), unbounded, inf, kp.stage)),
    ):
        assert fronts and {p.solver for p in fronts} == {"front"}
        for p in fronts:
            mine, time_s = measure(frozenset(n for n in p.schedule.saved if n in fwd))
            for o in menu:
                theirs, their_time_s = measure(o.saved)
                assert not (theirs <= mine and their_time_s < time_s * (1 - 1e-9)), o
    # The menu asks front_plans for its options, on the block and on its kept problem (its
    # budgeted solves, checked above, are skipped here).
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(menus, "front_plans", lambda *args: calls.append(args) or [])

    def no_solve(*args: object, **kwargs: object) -> None:
        raise RuntimeError("skipped")

    monkeypatch.setattr(menus, "exact", no_solve)
    monkeypatch.setattr(menus, "min_peak", no_solve)
    menus.block_menu(sub, keep_all, heavy, quick, kp)
    assert [c[:2] for c in calls] == [(sub, sub), (sub, kp.problem)]
    assert calls[1][2] == kp.slope() and calls[1][5] == kp.stage
