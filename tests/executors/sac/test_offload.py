"""Offload on ``remat.apply``'s executor (CPU: the host store outside PyTorch's allocator): a
plan given a host budget copies checkpointed regions' inputs out and back at fixed points,
trains bitwise, and measures the device peak and the host store's peak it predicts."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from remat.executors.sac.offload import CopyMark, exposed_copy_s
from remat.executors.sac.offloading import OffloadChoice
from remat.executors.sac.state import applied
from remat.measure.profiles import CPU
from remat.parallel.pipelining import Pipeline
from remat.problem import Link
from tests.checks import assert_trains_like_eager
from tests.zoo import _gpt2, llama

HOST = 1 << 30

DEEPER = {"llama": lambda: llama(4, 64), "gpt2": lambda: _gpt2(4, 64)}
"""Four blocks: with two (the zoo's), offloading the one input that can go (the first
block's, which Hugging Face's model also holds in its own frame through the forward) is
never cheaper than recomputing."""


def _tokens() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1)),)


def _peak(model: torch.nn.Module, plan: str) -> int:
    remat.apply(model, _tokens(), plan=plan)
    peak = remat.plan_of(model).predicted_peak_bytes
    remat.unapply(model)
    return peak


def _between(name: str) -> tuple[torch.nn.Module, int]:
    """The model and a budget a tenth of the way from the every-block plan's peak to eager's."""
    torch.manual_seed(0)
    model = DEEPER[name]().train()
    block, eager = _peak(model, "block"), _peak(model, "keep_all")
    assert block < eager
    return model, block + (eager - block) // 10


@pytest.mark.parametrize("name", sorted(DEEPER))
def test_a_host_budget_offloads_trains_bitwise_and_measures_as_predicted(
    name: str, tmp_path: Path
) -> None:
    model, budget = _between(name)
    planned = copy.deepcopy(model)
    remat.apply(planned, _tokens(), activation_budget_bytes=budget, host_budget_bytes=HOST)
    plan = remat.plan_of(planned)
    assert plan.offloaded and plan.offloaded_bytes > 0, plan.reason
    assert all(v.endswith(":inputs") for v in plan.offloaded)
    assert "without offload" in plan.reason  # the plan without offload added more time
    assert plan.predicted_peak_bytes <= budget
    assert 0 < plan.predicted_host_peak_bytes <= HOST
    assert plan.simulation.copy_exposed_s > 0  # a CPU device's copies are synchronous
    assert "saves no real memory" in plan.reason
    text = " ".join(remat.explain(planned).split())  # rich wraps the lines
    assert f"{len(plan.offloaded)} regions' inputs wait in host memory" in text
    # Bitwise over 3 AdamW steps with dropout; device peak == predicted at the allocator
    # (the plan, from its file: applied, not solved again).
    path = remat.save_plan(planned, tmp_path / "plan.json")
    result = assert_trains_like_eager(model, _tokens(), {}, executor="sac", plan=path)
    assert result.plan.offloaded == plan.offloaded
    assert result.plan.predicted_host_peak_bytes == plan.predicted_host_peak_bytes
    assert all(s.measured_peak_bytes <= budget for s in result.steps)
    # The host store holds what the plan predicts, and nothing once the backward is done.
    planned(*_tokens()).logits.float().sum().backward()
    offloads = applied(planned).offloads
    assert offloads is not None
    assert offloads.store.peak_bytes == plan.predicted_host_peak_bytes
    assert offloads.store.live_bytes == 0


def test_the_earliest_inputs_go_first_within_the_host_budget() -> None:
    keep, recompute = None, frozenset[Any]()
    choice = OffloadChoice((10, 0, 10, 10, 10), host_budget_bytes=25)
    # Not an eager region, nor one without an activation input, nor the last region.
    assert choice([recompute] * 5) == (True, False, True, False, False)
    assert choice([keep, recompute, recompute, recompute, recompute]) == (
        False, False, True, True, False,
    )  # fmt: skip
    assert choice.headroom_bytes == 20
    assert OffloadChoice((10, 10), host_budget_bytes=5).headroom_bytes == 0


def test_copies_stall_the_step_by_what_their_window_does_not_hide() -> None:
    marks = [
        CopyMark("out", 1, "a", 100, 0),
        CopyMark("release", 1, "a", 100, 2),
        CopyMark("prefetch", 1, "a", 100, 3),
        CopyMark("use", 1, "a", 100, 4),
    ]
    times = [0.5, 0.25, 1.0, 3.0]  # seconds per op
    link = Link(d2h=100.0, h2d=50.0)  # 1 s out, 2 s back
    assert exposed_copy_s(marks, times, link) == pytest.approx(0.25)  # out: 1 s over 0.75
    assert exposed_copy_s(marks, times, Link(100.0, 50.0, synchronous=True)) == 3.0


def test_a_host_budget_without_a_link_or_on_a_pipeline_stage_is_refused() -> None:
    model = llama(2, 64)
    no_link = dataclasses.replace(CPU, link=None)
    with pytest.raises(ValueError, match="no copy link to host memory"):
        remat.apply(
            model, _tokens(), activation_budget_bytes=1 << 20, host_budget_bytes=HOST,
            device_profile=no_link,
        )  # fmt: skip
    with pytest.raises(ValueError, match="pipeline stage offloads nothing yet"):
        remat.apply(
            model, _tokens(), pipeline=Pipeline("1F1B", 0, 2, 2),
            host_budget_bytes=HOST, activation_budget_bytes=1 << 20,
        )  # fmt: skip
