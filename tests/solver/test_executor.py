"""The ``sac`` executor's description on hand-built problems (no torch): its schedule, the
fixed lifetimes the spans MILP reads, and that MILP against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.problem import DispatchCosts, Problem, Role, Value
from remat.solver import executor, registry, spans
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.executor import NO_CHECKPOINT, SAC, Lifetimes, schedule_of
from remat.solver.plan import Proof, make_plan
from remat.solver.simulate import simulate
from remat.solver.spans import _Held, _solve

KiB = 1024


def sac_chain(seed: int, regions: int = 2, ops: int = 4) -> Problem:
    """``x -> region 0 -> region 1 -> ... -> loss``: each region a chain of ops of random
    sizes (some not savable), its backward reading random values of it, in reverse."""
    rng = random.Random(seed)
    values: list[Value] = []
    sizes: dict[str, int] = {}

    def add(name: str, role: Role, inputs: tuple[str, ...], region: str = "", **kw) -> str:
        storage = f"{name}.s"
        sizes[storage] = rng.choice((1, 2, 4, 8)) * KiB
        values.append(
            Value(
                name,
                role,
                kw.pop("op", "aten.op.default"),
                inputs,
                storages=(storage,),
                allocates=(storage,),
                time_s=rng.choice((1, 2, 5)) * 1e-6,
                region=region,
                **kw,
            )
        )
        return name

    prev = add("x", Role.FORWARD, ())
    chains = []
    for r in range(regions):
        path = f"blocks.{r}"
        values.append(Value(f"{path}:eager", Role.FORWARD, NO_CHECKPOINT, region=path))
        chain = []
        for k in range(ops):
            savable = rng.random() > 0.2
            prev = add(f"{path}:op#{k}", Role.FORWARD, (prev,), path, savable=savable, policy=True)
            chain.append(prev)
        chains.append(chain)
    loss = add("loss", Role.FORWARD, (prev,))
    grad = add("g.loss", Role.BACKWARD, (loss,))
    for r in reversed(range(regions)):
        path = f"blocks.{r}"
        for k in reversed(range(ops)):
            reads = tuple(n for n in chains[r][: k + 1] if rng.random() < 0.5)
            grad = add(f"g.{path}.{k}", Role.BACKWARD, (grad, *reads), path)
    return Problem(
        values=tuple(values),
        storage_bytes=sizes,
        user_outputs=("loss",),
        grad_outputs=(grad,),
        executor="sac",
    )


def _model_peak(lt: Lifetimes, kept: set[str]) -> int:
    return max(
        base
        + sum(n for c in lt.candidates if c.name in kept for n, a, b in c.pieces if a <= m <= b)
        for m, base in enumerate(lt.base)
    )


def test_regions_replay_at_their_first_backward_op_and_hold_their_inputs() -> None:
    problem = sac_chain(0)
    schedule = schedule_of(problem, ())
    backward = list(schedule.backward)
    for r in ("blocks.1", "blocks.0"):
        first = next(k for k, n in enumerate(backward) if problem.by_name[n].region == r)
        replayed = [n for n in schedule.recomputed if problem.by_name[n].region == r]
        assert backward[first : first + len(replayed)] == replayed
        assert all(n not in schedule.saved for n in replayed)
    # Region 1's input is region 0's last op: held by region 1's frame to its end.
    last_of_1 = [n for n in backward if n.startswith("g.blocks.1")][-1]
    assert schedule.held_until["blocks.0:op#3"] == last_of_1
    assert "x" in schedule.saved  # region 0's input


def test_a_region_without_checkpoint_replays_nothing() -> None:
    problem = sac_chain(1)
    plan = make_plan(problem, {"blocks.1:eager"}, solver="t", reason="", proof=Proof.HEURISTIC)
    assert not any(problem.by_name[n].region == "blocks.1" for n in plan.recomputed)
    assert "blocks.1:eager" in plan.saved
    assert (
        plan.recompute_time_s
        < make_plan(problem, (), solver="t", reason="", proof=Proof.HEURISTIC).recompute_time_s
    )


def test_kept_values_are_not_replayed_and_savable_only() -> None:
    problem = sac_chain(2)
    candidates = SAC.candidates(problem)
    everything = {v.name for v in problem.values if v.region and v.role is Role.FORWARD}
    plan = make_plan(
        problem,
        everything - {f"blocks.{r}:eager" for r in (0, 1)},
        solver="t",
        reason="",
        proof=Proof.HEURISTIC,
    )
    assert plan.saved <= candidates
    assert not set(plan.recomputed) & plan.saved


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_lifetimes_bound_each_single_choice_and_are_exact_for_regions(seed: int) -> None:
    """Keeping one candidate: the linear model's peak is never below the simulated one (the
    model only drops the replay step the kept value no longer needs); leaving one region
    without checkpoint: equal, since its pieces are the simulated difference."""
    problem = sac_chain(seed, regions=3, ops=3)
    lt = SAC.lifetimes(problem)  # type: ignore[misc]
    for c in lt.candidates:
        simulated = make_plan(
            problem, {c.name}, solver="t", reason="", proof=Proof.HEURISTIC
        ).predicted_peak_bytes
        if c.whole_group:
            assert _model_peak(lt, {c.name}) == simulated, c.name
        else:
            assert _model_peak(lt, {c.name}) >= simulated, c.name


CPU_LIKE = DispatchCosts(19e-6, 13e-6, 20e-6, 18e-6, 190e-6)
"""SAC dispatch costs of the order the ``cpu`` profile pins (each op's own time here: 1-5 us)."""


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_lifetimes_price_sac_dispatch_as_the_schedule_counts_it(seed: int) -> None:
    """With SAC's dispatch priced, what it adds to a plan's step (simulated on its schedule,
    against the same problem unpriced) is keeping nothing's dispatch less what the kept
    candidates' lifetime times gained by pricing it: the MILP's linear terms are the
    schedule's dispatch, regions left eager included (they save their whole dispatch), and
    keeping an op cheaper than its dispatch costs time."""
    plain = sac_chain(seed, regions=3, ops=3)
    priced = dataclasses.replace(plain, dispatch=CPU_LIKE)
    gained = {
        a.name: a.time_s - b.time_s
        for a, b in zip(
            SAC.lifetimes(priced).candidates,  # type: ignore[misc]
            SAC.lifetimes(plain).candidates,  # type: ignore[misc]
            strict=True,
        )
    }

    def dispatch(saved: frozenset[str]) -> float:
        return schedule_of(priced, saved).dispatch_s

    def kept(saved: frozenset[str]) -> frozenset[str]:
        return SAC.kept(priced, saved, schedule_of(priced, saved))

    assert schedule_of(plain, frozenset(gained)).dispatch_s == 0
    # Keeping nothing may keep a replayed op whose storage is held anyway (see
    # executor._sac_plan): the lifetimes are over that plan, what it keeps counted in.
    base = dispatch(frozenset()) + sum(gained.get(n, 0.0) for n in kept(frozenset()))
    rng = random.Random(seed)
    for _ in range(10):
        chosen = frozenset(n for n in gained if rng.random() < 0.4)
        expected = base - sum(t for n, t in gained.items() if n in kept(chosen))
        assert dispatch(chosen) == pytest.approx(expected, rel=1e-9), sorted(kept(chosen))
    assert any(t < 0 for n, t in gained.items() if not n.endswith(":eager"))


@pytest.mark.parametrize(("seed", "regions", "ops"), [(s, 2, 3) for s in range(6)] + [(6, 4, 2)])
def test_spans_milp_is_the_brute_force_optimum_of_its_model(
    seed: int, regions: int, ops: int
) -> None:
    """The running sums' rows (each the row before, plus and less the lifetimes that start
    and end between) give brute force's optimum."""
    problem = sac_chain(seed, regions=regions, ops=ops)
    lt = SAC.lifetimes(problem)  # type: ignore[misc]
    names = [c.name for c in lt.candidates]
    groups = {c.name: c.group for c in lt.candidates}
    markers = {c.group: c.name for c in lt.candidates if c.whole_group}
    budget = (max(lt.base) + _model_peak(lt, set(names) - set(markers.values()))) // 2
    best = None
    for r in range(len(names) + 1):
        for kept in itertools.combinations(names, r):
            k = set(kept)
            if any(m in k and any(groups[n] == g for n in k if n != m) for g, m in markers.items()):
                continue  # a region without checkpoint keeps nothing else
            if _model_peak(lt, k) <= budget:
                cost = sum(c.time_s for c in lt.candidates if c.name not in k)
                best = cost if best is None else min(best, cost)
    solved = _solve(lt, _Held(lt), budget, False, SolverConfig(), time.perf_counter() + 60)
    assert best is not None and solved is not None
    found, closed = solved
    assert closed  # a model this small is solved to its gap
    kept = {n for n, x in zip(names, found, strict=True) if x > 0.5}
    assert _model_peak(lt, kept) <= budget
    assert sum(c.time_s for c in lt.candidates if c.name not in kept) == pytest.approx(best)


def test_solvers_plan_for_the_sac_executor_within_the_budget() -> None:
    problem = sac_chain(3, regions=3, ops=4)
    least = make_plan(
        problem, (), solver="t", reason="", proof=Proof.HEURISTIC
    ).predicted_peak_bytes
    most = registry.solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    budget = (least + most) // 2
    costs = {}
    for name in ("exact", "lp_round", "auto"):
        plan = registry.solve(problem, solver=name, budget_bytes=budget, config=SolverConfig())
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes == simulate(problem, plan.schedule).peak_bytes
        costs[name] = plan.recompute_time_s
    assert costs["auto"] <= costs["exact"] + 1e-15
    with pytest.raises(BudgetError):
        registry.solve(problem, solver="exact", budget_bytes=least - 1)
    with pytest.raises(ValueError, match="for the sac executor"):
        registry.solve(problem, solver="chain", budget_bytes=budget)


@pytest.mark.parametrize("seed", range(3))
def test_spans_rounds_scout_to_a_loose_gap_then_polish_the_round_that_fits(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rounds solve to ``SCOUT_GAP`` until one's plan fits; that round's model is solved
    again to ``GAP``, warm-started from the scout's solution, and the cheaper fitting plan
    of the two is returned: as cheap as solving every round to ``GAP``."""
    calls: list[tuple[int, float, list[float] | None, list[float] | None]] = []
    solve = spans._solve

    def spy(*args: Any) -> tuple[list[float], bool] | None:
        found = solve(*args)
        budget, gap, start = args[2], args[6], args[7] if len(args) > 7 else None
        calls.append((budget, gap, start, found[0] if found else None))
        return found

    monkeypatch.setattr(spans, "_solve", spy)
    problem = sac_chain(seed, regions=3, ops=4)
    least = make_plan(problem, (), solver="t", reason="", proof=Proof.HEURISTIC)
    most = registry.solve(problem, solver="keep_all", budget_bytes=None)
    budget = (least.predicted_peak_bytes + most.predicted_peak_bytes) // 2
    plan = spans.solve_spans(problem, budget_bytes=budget, config=SolverConfig())
    assert plan.predicted_peak_bytes <= budget
    *scouts, polish = calls
    assert scouts and all(gap == spans.SCOUT_GAP and start is None for _, gap, start, _ in scouts)
    assert polish[:3] == (scouts[-1][0], spans.GAP, scouts[-1][3])
    monkeypatch.setattr(spans, "SCOUT_GAP", spans.GAP)
    tight = spans.solve_spans(problem, budget_bytes=budget, config=SolverConfig())
    # The problem's op times (its values' time_s), not a clock.
    assert plan.recompute_time_s <= tight.recompute_time_s * (1 + spans.GAP) + 1e-15


def _held_at(lt: Lifetimes, m: int) -> dict[int, int]:
    """Candidate -> bytes it holds at moment ``m`` if kept."""
    return {k: n for k, c in enumerate(lt.candidates) for n, a, b in c.pieces if a <= m <= b and n}


@pytest.mark.parametrize("seed", range(4))
def test_each_moment_s_row_is_implied_by_its_representative_s(seed: int) -> None:
    """The spans MILP writes one row per run of moments that hold the same candidates: the
    representative holds the same candidates, with as many base bytes or more."""
    lt = SAC.lifetimes(sac_chain(seed, regions=3, ops=4))  # type: ignore[misc]
    held = _Held(lt)
    assert len(set(held.rep.tolist())) < len(lt.base)  # some moments are represented
    for m in range(len(lt.base)):
        r = int(held.rep[m])
        assert _held_at(lt, m) == _held_at(lt, r)
        assert held.base[r] >= held.base[m]


@pytest.mark.parametrize("seed", range(4))
def test_a_region_s_difference_falls_back_to_the_whole_simulation(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a region's schedule differs beyond its own storages, its difference comes from
    simulating the whole step: the same lifetimes (the tests of the native dataflows compare
    the two region by region)."""
    problem = sac_chain(seed, regions=3, ops=4)
    counted = executor._sac_lifetimes(problem)
    monkeypatch.setattr(executor, "_eager_difference", lambda *args: None)
    assert executor._sac_lifetimes(problem) == counted
