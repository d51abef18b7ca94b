"""``remat.apply`` on one stage of a ``torch.distributed.pipelining`` pipeline.

Planned per stage, the peak of a whole ``schedule.step()`` (every microbatch in flight):
traced through PyTorch's own schedule on a fake process group, in one process. Checked
against 2 gloo processes, one stage each, under 1F1B (``auto`` under a budget) and GPipe
(every block recomputed): parameters after 3 AdamW steps (dropout on) bitwise those of the
same pipeline without remat; the first step's live-storage peak equal to the prediction,
and the allocator's within max(1%, 64 KiB) and below the budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import remat
from remat.native.state import Applied, applied
from tests.checks import assert_peak_close
from tests.native import pp_worker
from tests.native.test_distributed import _free_port, assert_trained_alike
from tests.zoo import GPTStage, pipeline_loss, stage_inputs

WORLD = 2


@pytest.mark.slow
def test_each_stage_bitwise_and_predicted(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    mp.spawn(pp_worker.main, args=(WORLD, str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"pp_{rank}.pt")
        for name, got in results.items():
            what = f"{name} stage {rank}"
            assert_trained_alike(got, rank)
            (tensors, allocator), *later = got["remat"]["peaks"]
            assert tensors == got["predicted_tensors"], (what, tensors, got["predicted_tensors"])
            assert_peak_close(got["predicted"], allocator, f"{what}, allocator")
            assert allocator <= got["budget"] <= got["eager"], (what, allocator, got["budget"])
            assert all(t <= tensors for t, _ in later), (what, later)
            plain_tensors = got["plain"]["peaks"][0][0]
            assert tensors < plain_tensors, (what, tensors, plain_tensors)
            expected = pp_worker.MICROBATCHES if name == "GPipe" else WORLD - rank
            assert got["in_flight"] == expected, (what, got["order"])


def _plan_stage(stage: int, n_stages: int, schedule: str, budget: int | None) -> Applied:
    x, target = stage_inputs(stage)
    pipe = remat.Pipeline(schedule, stage, n_stages, 4, loss_fn=pipeline_loss)
    model = GPTStage(stage, n_stages, layers=1)
    remat.apply(
        model,
        x,
        pipeline=pipe,
        target=target if pipe.last else None,
        activation_budget_bytes=budget,
        time_limit_s=10,
        block_types=("blocks.*",),
    )
    return applied(model)


def test_stages_of_1f1b_hold_p_minus_i_microbatches_and_the_first_recomputes_most() -> None:
    """4 stages, 4 microbatches, in one process: stage i holds P - i microbatches at once
    (as measured on 4 gloo ranks, DESIGN.md), and under one budget the stages that hold more
    recompute more."""
    eager = [_plan_stage(i, 4, "1F1B", None) for i in range(4)]
    assert [s.schedule.max_in_flight for s in eager] == [4, 3, 2, 1]  # type: ignore[union-attr]
    assert eager[1].plan.predicted_peak_bytes > eager[2].plan.predicted_peak_bytes
    budget = eager[2].plan.predicted_peak_bytes
    planned = [_plan_stage(i, 4, "1F1B", budget) for i in range(1, 4)]
    recompute = [s.plan.simulation.recompute_time_s for s in planned]
    assert all(s.plan.predicted_peak_bytes <= budget for s in planned)
    assert recompute[0] > 0 and recompute[-1] == 0, recompute
    assert recompute == sorted(recompute, reverse=True), recompute


def test_gpipe_holds_every_microbatch_on_every_stage() -> None:
    for stage in (0, 3):
        state = _plan_stage(stage, 4, "GPipe", None)
        assert state.schedule is not None and state.schedule.max_in_flight == 4
        assert state.schedule.order.split()[:5] == [f"F{m}" for m in range(4)] + ["B0"]


def test_split_backward_schedules_are_refused_naming_those_that_run() -> None:
    with pytest.raises(remat.PipelineError, match=r"backwarded once.*GPipe, 1F1B"):
        remat.Pipeline("ZBVZeroBubble", 0, 2, 4)
    with pytest.raises(remat.PipelineError, match="several stages per rank"):
        remat.Pipeline("Interleaved1F1B", 0, 2, 4)
    with pytest.raises(remat.PipelineError, match="unknown pipeline schedule 'zigzag'"):
        remat.Pipeline("zigzag", 0, 2, 4)
    with pytest.raises(remat.PipelineError, match="stage 2 is not one of the 2 stages"):
        remat.Pipeline("1F1B", 2, 2, 4)
    with pytest.raises(remat.PipelineError, match="give the schedule's loss_fn"):
        remat.Pipeline("1F1B", 1, 2, 4)
    assert remat.Pipeline("gpipe", 0, 2, 4).schedule == "GPipe"


def test_a_budget_below_the_stage_least_peak_names_the_stage() -> None:
    x, target = stage_inputs(1)
    pipe = remat.Pipeline("1F1B", 1, 2, 2, loss_fn=pipeline_loss)
    model = GPTStage(1, 2, layers=1)
    with pytest.raises(ValueError, match="pass one microbatch's target"):
        remat.apply(model, x, pipeline=pipe)
    with pytest.raises(remat.BudgetError, match=r"stage 1 of 2, 1F1B, 2 microbatches"):
        remat.apply(
            model,
            x,
            pipeline=pipe,
            target=target,
            activation_budget_bytes=1000,
            block_types=("blocks.*",),
        )
    assert not list(remat.native.regions.iter_regions(model))  # left as it was


def test_a_fake_world_leaves_the_process_excepthook_alone() -> None:
    """``init_process_group`` wraps ``sys.excepthook`` to prefix ``[rank<r>]:``; each stage
    planned would otherwise stack one more prefix on the user's tracebacks."""
    import sys

    from remat import _torch_compat as tc

    hook = sys.excepthook
    tc.FakeWorld(4, rank=3)
    assert sys.excepthook is hook
