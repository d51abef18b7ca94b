"""Solvers named on the ``sac`` executor say what they did: each returns its own plan or a
:class:`remat.BudgetError` whose least peak is a budget it then meets, fixed plans are the
plans their names say, and ``torchtitan_op`` is torchtitan's op-SAC policy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import remat
from remat.executors.sac.regions import FullReplay
from remat.executors.sac.state import applied
from tests.checks import assert_trains_like_eager
from tests.zoo import TitanLM


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TitanLM(vocab=128, dim=64, heads=4, layers=3), torch.randint(0, 128, (4, 64))


@pytest.mark.parametrize("solver", ["keep_all", "megatron"])
def test_a_solver_that_cannot_reach_the_budget_says_so_and_meets_its_least_peak(
    solver: str,
) -> None:
    model, tokens = _model()
    with pytest.raises(remat.BudgetError, match=f"solver {solver}|fixed plan {solver}") as info:
        remat.apply(copy.deepcopy(model), tokens, solver=solver, activation_budget_bytes=1)
    least = info.value.least_peak_bytes
    fitted = remat.apply(model, tokens, solver=solver, activation_budget_bytes=least)
    plan = remat.plan_of(fitted)
    assert plan.solver == f"native:{solver}" and plan.predicted_peak_bytes <= least
    if solver == "keep_all":  # keeps all, or fails: never a recomputing plan under its name
        assert plan.recompute_flops == 0
        assert all(p is None for p in applied(fitted).policies)


def test_block_is_every_block_recomputed() -> None:
    model, tokens = _model()
    remat.apply(model, tokens, solver="block", activation_budget_bytes=10**9)
    state = applied(model)
    assert remat.plan_of(model).solver == "native:block"
    assert all(p == frozenset() for p in state.policies)


def test_torchtitan_op_keeps_every_other_matmul_and_trains_bitwise(tmp_path: Path) -> None:
    """torchtitan 0.3.0's policy on a block of its layout: seven matmuls (q, k, v, o and the
    three of the SwiGLU), every second recomputed; CPU attention is not on its list. Its
    regions replay their whole forward, as torchtitan's wrapper runs them, and a plan file
    keeps that."""
    model, tokens = _model()
    result = assert_trains_like_eager(model, (tokens,), {}, executor="sac", plan="torchtitan_op")
    state = applied(result.module)
    assert state.blocks[:3] == ("layers.0", "layers.1", "layers.2")
    assert state.policies[0] == frozenset(("aten.mm.default", k) for k in (0, 2, 4, 6))
    assert all(isinstance(p, FullReplay) for p in state.policies)
    path = remat.save_plan(result.module, tmp_path / "plan.json")
    again, _ = _model()
    remat.apply(again, tokens, plan=str(path))
    assert applied(again).policies == state.policies
    assert all(isinstance(p, FullReplay) for p in applied(again).policies)
    assert remat.plan_of(again).predicted_peak_bytes == result.plan.predicted_peak_bytes
