"""The executors as one type: one registry by name, the same name the solver core models,
and each executor planning, explaining and saving a plan that its entry point loads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import remat
from remat.executors import EXECUTORS, GRAPH, SAC, Executor, Planned, executor_named
from remat.models import TinyGPT
from remat.solver.executor import EXECUTORS as MODELS
from remat.verify import verify


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=16)
    return model, torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def test_one_registry_whose_names_the_solver_core_models() -> None:
    assert set(EXECUTORS) == set(MODELS) == {"graph", "sac"}
    for name, executor in EXECUTORS.items():
        assert isinstance(executor, Executor) and executor.name == name
        assert executor_named(name) is executor is executor_named(executor)
        assert executor.entry in str(executor)
    assert (GRAPH.distributed, SAC.distributed) == (False, True)
    with pytest.raises(ValueError, match="unknown executor 'native'; valid: graph, sac"):
        executor_named("native")


@pytest.mark.parametrize("executor", [GRAPH, SAC], ids=lambda e: e.name)
def test_each_plans_explains_and_saves_a_plan_its_entry_point_loads(
    executor: Executor, tmp_path: Path
) -> None:
    model, tokens = _model()
    work = copy.deepcopy(model)
    # Every block recomputed: remat.optimize's solver, remat.apply's fixed plan.
    how = {"solver": "block"} if executor is GRAPH else {"plan": "block"}
    planned = executor.plan(work, (tokens,), **how)
    assert isinstance(planned, Planned)
    assert planned.plan.recomputed and planned.timings
    assert (planned.module is work) == (executor is SAC)  # remat.apply wraps in place
    assert "recompute" in planned.explain(width=100)
    path = planned.save(tmp_path / "plan.json")
    again = executor.plan(copy.deepcopy(model), (tokens,), plan=path)
    assert again.plan.saved == planned.plan.saved
    assert again.plan.predicted_peak_bytes == planned.plan.predicted_peak_bytes


def test_verify_takes_an_executor_and_the_old_native_flag_warns() -> None:
    model, tokens = _model()
    new = verify(model, (tokens,), steps=1, executor="sac", plan="block")
    with pytest.warns(DeprecationWarning, match='executor="sac"'):
        old = verify(model, (tokens,), steps=1, native=True, plan="block")
    assert new.equal and old.equal
    assert new.plan.saved == old.plan.saved
    assert remat.plan_of(new.module).saved == new.plan.saved


def test_fit_and_the_formula_ask_the_executor_which_refuses_the_other_ones_deep_inputs() -> None:
    """``remat.fit`` and ``remat.memory_formula`` dispatch on the executor; each executor
    names the argument that belongs to the other one rather than ignore it."""
    model, tokens = _model()
    with pytest.raises(
        ValueError, match="copies= is not for executor .graph.: it fits a deep stack on one shallow"
    ):
        remat.fit.fit(model, (tokens,), budget_gb=1, executor="graph", copies=lambda n: model)
    with pytest.raises(
        ValueError,
        match="shallow= is not for executor .sac.: it fits a deep stack on copies of two",
    ):
        remat.fit.fit(model, (tokens,), budget_gb=1, executor=SAC, shallow=(model, 2, 2))
    with pytest.raises(ValueError, match="executor='sac' takes one of remat.apply's fixed"):
        remat.memory_formula(model, (tokens,), executor="sac", plan="megatron")
    with pytest.raises(ValueError, match="unknown executor 'native'"):
        remat.memory_formula(model, (tokens,), executor="native")
