"""One rank of the PP x FSDP2 check (spawned by ``test_pipeline.py``).

Four ranks on a 2x2 mesh, ``("pp", "dp")``, as torchtitan lays out pipeline and data
parallelism: stage ``pp`` of a GPT decoder (:class:`tests.zoo.GPTStage`, 2 blocks, dropout
on) on each rank of a row, each block and the stage ``fully_shard``-ed over ``"dp"``, each
data-parallel column its own batch, stepped by 1F1B over ``"pp"``. Once trained as is, once
after ``remat.apply(..., pipeline=..., zero_stage=3, world_size=2)`` (before
``fully_shard``), every block recomputed, from the same weights, batch and random streams.
The first step's peaks are measured (live-storage meter and allocator, one run). The plan is
also re-applied ahead of the job, to the stage built on FakeTensors, whose predicted peak is
saved beside the job's.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.executors.sac.state import applied
from tests.executors.sac import gloo_settle
from tests.parallel.pp_worker import train_1f1b
from tests.zoo import GPTStage, pipeline_loss, stage_inputs

MICROBATCHES = 4
MICROBATCH = 2
STAGES = 2
OPTIONS: dict[str, Any] = {"zero_stage": 3, "world_size": 2}  # FSDP2 over the "dp" dimension


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _inputs(stage: int, dp: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of the stage's input and the targets; each data-parallel column its
    own (rolled by its coordinate)."""
    x, target = stage_inputs(stage, n)
    return x.roll(dp, dims=0), target.roll(dp, dims=0)


def _planned_ahead(stage: int, kw: dict[str, Any], plan_file: Path) -> int:
    """The job's plan re-applied to the stage built on FakeTensors (``remat plan --pp-size
    2 --zero-stage 3 --world-size 2``'s path: the trace lays its own fake ``(pp, dp)``
    mesh); its predicted live-tensor peak."""
    with remat.fake_mode():
        model = GPTStage(stage, STAGES)
    remat.apply(model, stage_inputs(stage, MICROBATCH)[0], plan=plan_file, **kw)
    return remat.plan_of(model).predicted_tensor_peak_bytes


def _train(module: nn.Module, stage: int, dp: int, group: Any, rank: int) -> dict[str, Any]:
    """3 AdamW steps through 1F1B; the parameters after each (whole) and each step's
    peaks."""
    batch = (
        _inputs(stage, dp, MICROBATCH)[0],
        _inputs(0, dp, MICROBATCH * MICROBATCHES)[0],
        _inputs(STAGES - 1, dp, MICROBATCH * MICROBATCHES)[1],
    )
    return train_1f1b(module, stage, STAGES, batch, MICROBATCHES, group, rank, _whole)


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor()  # type: ignore[attr-defined,no-any-return]  # DTensor under FSDP2


def main(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    gloo_settle.settle_work_waits()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "dp"))
        stage, dp = mesh.get_coordinate()  # type: ignore[misc]
        model = GPTStage(stage, STAGES)
        work = copy.deepcopy(model)
        group = mesh["pp"].get_group()
        plain = _train(_shard(model, mesh["dp"]), stage, dp, group, rank)
        pipe = remat.Pipeline("1F1B", stage, STAGES, MICROBATCHES, loss_fn=pipeline_loss)
        x, target = _inputs(stage, dp, MICROBATCH)
        kw: dict[str, Any] = {"pipeline": pipe, "target": target if pipe.last else None, **OPTIONS}
        remat.apply(work, x, plan="block", **kw)  # a fixed plan: one trace, no search
        state = applied(work)
        assert state.schedule is not None and state.eager_schedule is not None
        plan_file = remat.save_plan(work, Path(out) / f"plan_{rank}.json")
        torch.save(
            {
                "plain": plain,
                "remat": _train(_shard(work, mesh["dp"]), stage, dp, group, rank),
                "eager": state.eager_peak_bytes,
                "eager_tensors": state.eager_schedule.tensor_peak_bytes,
                "predicted": state.plan.predicted_peak_bytes,
                "predicted_tensors": state.plan.predicted_tensor_peak_bytes,
                "in_flight": state.schedule.max_in_flight,
                "ahead": _planned_ahead(stage, kw, plan_file),
            },
            Path(out) / f"pp_fsdp_{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
