"""The same request gives the same plan beside busy processes: the solvers count their work
(:mod:`remat.solver.clock`) instead of reading the clock, so a loaded machine takes longer
and plans the same. Each request here is one whose work limit binds (its MILP stops short of
a proof), where a wall-clock deadline would stop at another incumbent under load."""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import remat
from remat.models import TinyGPT
from remat.solver.plan import Plan, Proof

LIMIT_S = 2.0
"""Reference seconds of work: less than either MILP below needs for its proof."""


def _spin(stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        sum(range(10_000))


@contextmanager
def _busy(n: int = 2) -> Iterator[None]:
    """``n`` processes spinning on the CPU (this machine's cores) while the block runs."""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    procs = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join()


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    return model, torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))


def _same(idle: Plan, loaded: Plan) -> None:
    for plan in (idle, loaded):
        assert "safety net" not in plan.reason, plan.reason  # no wall clock decided
    assert idle.proof is not Proof.OPTIMAL, "the work limit must bind for this to test it"
    assert loaded.saved == idle.saved
    assert loaded.predicted_peak_bytes == idle.predicted_peak_bytes
    assert loaded.recompute_time_s == idle.recompute_time_s


def test_optimize_plans_the_same_under_load() -> None:
    model, x = _model()
    most = remat.optimize(model, x, plan="keep_all").plan.predicted_peak_bytes
    budget = int(most * 0.85)

    def plan() -> Plan:
        return remat.optimize(model, x, activation_budget_bytes=budget, time_limit_s=LIMIT_S).plan

    idle = plan()
    with _busy():
        loaded = plan()
    _same(idle, loaded)


def test_apply_plans_the_same_under_load() -> None:
    model, x = _model()
    least, most = (
        remat.plan_of(remat.apply(copy.deepcopy(model), x, plan=p)).predicted_peak_bytes
        for p in ("block", "keep_all")
    )
    budget = (least + most) // 2

    def plan() -> Plan:
        work = copy.deepcopy(model)
        remat.apply(work, x, activation_budget_bytes=budget, solver="exact", time_limit_s=LIMIT_S)
        return remat.plan_of(work)

    idle = plan()
    with _busy():
        loaded = plan()
    _same(idle, loaded)
