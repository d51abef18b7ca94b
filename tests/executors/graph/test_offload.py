"""Offload on the whole-graph executor (CPU: the host store outside PyTorch's allocator): a
plan given a host budget copies saved values out and back at the points it fixes, trains
bitwise, and measures the device peak and the host store's peak it predicts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import remat
from remat.executors.graph.loss import PREFIX
from remat.measure.profiles import CPU
from remat.solver.offload import OffloadError
from remat.solver.registry import solve
from tests.checks import assert_trains_like_eager
from tests.zoo import ZOO, Case

DECODERS = [c for c in ZOO if c.name in ("tiny_gpt", "hf_gpt2", "hf_llama")]
HOST = 1 << 30


def _between(case: Case) -> tuple[torch.nn.Module, int]:
    """The case's model and a budget halfway from the lower of the every-block and the
    keep-matmuls plans' peaks to eager's (tiny models peak higher with every block
    checkpointed than without)."""
    torch.manual_seed(0)
    model = case.build()
    problem = remat.analyze(model, case.inputs(), case.kwargs).problem
    peak = {
        name: solve(problem, solver=name, budget_bytes=None).predicted_peak_bytes
        for name in ("keep_all", "keep_matmuls", "block")
    }
    low = min(peak["block"], peak["keep_matmuls"])
    assert low < peak["keep_all"], peak
    return model, (peak["keep_all"] + low) // 2


@pytest.mark.parametrize("case", DECODERS, ids=lambda c: c.name)
def test_a_host_budget_offloads_trains_bitwise_and_measures_as_predicted(case: Case) -> None:
    model, budget = _between(case)
    fast = remat.optimize(
        model,
        case.inputs(),
        example_kwargs=case.kwargs,
        activation_budget_bytes=budget,
        host_budget_bytes=HOST,
        solver="lp_round",  # one LP per budget of the search, each with 1 s of work
        time_limit_s=5,
    )
    plan = fast.plan
    assert plan.offloaded and plan.offloaded_bytes > 0, plan.reason
    assert plan.predicted_peak_bytes <= budget
    assert 0 < plan.predicted_host_peak_bytes <= HOST
    assert "saves no real memory" in plan.reason  # a CPU device
    assert f"{len(plan.offloaded)} saved values offloaded to host memory" in fast.explain_text()
    # Bitwise over 3 AdamW steps with dropout; device peak == predicted at the allocator.
    assert_trains_like_eager(model, case.inputs(), case.kwargs, plan=plan)
    # The host store holds what the plan predicts, and nothing once the backward is done.
    out = fast(*case.inputs(), **case.kwargs)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    logits.float().sum().backward()
    store = fast.host_store
    assert store is not None
    assert store.peak_bytes == plan.predicted_host_peak_bytes and store.live_bytes == 0


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_with_the_loss_in_the_step_copies_stay_in_the_module_s_graphs() -> None:
    """The loss the loop computes is part of the planned step, not of the module's graphs:
    each copy waits and starts at a module op, and the step (loss included) trains bitwise
    at the peak it predicts."""
    case = DECODERS[0]
    torch.manual_seed(0)
    model = case.build()
    (tokens,) = case.inputs()
    loss = {"loss_fn": _cross_entropy, "target": tokens}
    peak = {
        name: remat.optimize(model, (tokens,), plan=name, **loss).plan.predicted_peak_bytes
        for name in ("keep_all", "keep_matmuls")
    }
    budget = (peak["keep_all"] + peak["keep_matmuls"]) // 2
    fast = remat.optimize(
        model, (tokens,), activation_budget_bytes=budget, host_budget_bytes=HOST,
        solver="lp_round", time_limit_s=5, **loss,
    )  # fmt: skip
    plan = fast.plan
    assert plan.offloaded and plan.predicted_peak_bytes <= budget, plan.reason
    module_ops = {
        n for n in plan.schedule.forward + plan.schedule.backward if not n.startswith(PREFIX)
    }
    for o in plan.schedule.offloaded:
        assert {o.value, o.wait, o.prefetch} <= module_ops, o
    result = assert_trains_like_eager(model, (tokens,), {}, plan=plan, **loss)
    assert result.steps[-1].measured_peak_bytes <= budget


def test_no_host_budget_changes_no_plan() -> None:
    case = DECODERS[0]
    model, budget = _between(case)
    plans = [
        remat.optimize(
            model, case.inputs(), activation_budget_bytes=budget, solver="chen_greedy", **extra
        ).plan
        for extra in ({}, {"host_budget_bytes": 0}, {"host_budget_gb": 0})
    ]
    for plan in plans:
        assert plan.offloaded == () and plan.offloaded_bytes == 0
        assert plan.predicted_host_peak_bytes == 0
    assert len({(p.saved, p.predicted_peak_bytes, p.step_time_s) for p in plans}) == 1


def test_an_offloading_plan_file_loads_with_its_copies(tmp_path: Path) -> None:
    case = DECODERS[0]
    model, budget = _between(case)
    fast = remat.optimize(
        model, case.inputs(), activation_budget_bytes=budget, host_budget_bytes=HOST,
        solver="lp_round", time_limit_s=5,
    )  # fmt: skip
    path = fast.save_plan(tmp_path / "plan.json")
    again = remat.optimize(model, case.inputs(), plan=path).plan
    assert again.schedule.offloaded == fast.plan.schedule.offloaded
    assert again.predicted_peak_bytes == fast.plan.predicted_peak_bytes
    with pytest.raises(ValueError, match="host store"):
        fast.export(tmp_path / "graphs")


def test_host_budget_bad_input() -> None:
    case = DECODERS[0]
    model, budget = _between(case)
    x = case.inputs()
    with pytest.raises(ValueError, match="device budget"):
        remat.optimize(model, x, host_budget_bytes=HOST)
    no_link = dataclasses.replace(CPU, link=None)
    with pytest.raises(OffloadError, match="no copy link|needs a copy link"):
        remat.optimize(
            model, x, activation_budget_bytes=budget, host_budget_bytes=HOST,
            device_profile=no_link,
        )  # fmt: skip
    with pytest.raises(ValueError, match="host_budget_bytes must be 0 or more"):
        remat.optimize(model, x, activation_budget_bytes=budget, host_budget_bytes=-1)
    with pytest.raises(ValueError, match="not both"):
        remat.optimize(
            model, x, activation_budget_bytes=budget, host_budget_bytes=1, host_budget_gb=1
        )
