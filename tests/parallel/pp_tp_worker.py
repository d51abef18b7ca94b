"""One rank of the PP x TP check (spawned by ``test_pipeline.py``).

Four ranks on a 2x2 mesh, ``("pp", "tp")``: the zoo's Llama cut into 2 pipeline stages
(:func:`remat.parallel.split.causal_lm_stages`), each stage parallelized over its row's
``"tp"`` ranks with torchtitan's Llama layout, and stepped by 1F1B over the ``"pp"``
dimension's group. Once trained as is, once after ``remat.apply(..., pipeline=...)`` on the
parallel stage (after ``parallelize_module``), from the same weights, batch and random
streams. The first step's peaks are measured (live-storage meter and allocator, one run).
The plan is also re-applied ahead of the job, to the stage built on FakeTensors and
parallelized on a fake ``(pp, tp)`` mesh as this rank (``remat plan --pp-size 2 --tp-size
2``'s path), whose predicted peak is saved beside the job's.
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
from remat.parallel.split import causal_lm_stages
from remat.parallel.tensor import llama_tp_plan, tensor_parallel
from tests.executors.sac import gloo_settle
from tests.parallel.pp_worker import train_1f1b
from tests.zoo import PIPELINE_SEQ, llama, pipeline_loss, stage_inputs

MICROBATCHES = 2
MICROBATCH = 2
STAGES = 2


def build(stage: int) -> nn.Module:
    """Stage ``stage`` of the zoo's Llama (4 layers, attention dropout), the same weights on
    every rank."""
    torch.manual_seed(0)
    return causal_lm_stages(llama(4, PIPELINE_SEQ).train(), STAGES)[stage]


def _planned_ahead(stage: int, pipe: remat.Pipeline, target: Any, plan_file: Path) -> int:
    """The job's plan re-applied to the stage on FakeTensors, on a fake 2-D mesh; its
    predicted live-tensor peak."""
    with remat.fake_mode():
        model = build(stage)
    tensor_parallel(model, 2, pp_size=STAGES, pp_rank=stage)
    x, _ = stage_inputs(stage, MICROBATCH)
    remat.apply(model, x, pipeline=pipe, target=target, plan=plan_file)
    return remat.plan_of(model).predicted_tensor_peak_bytes


def _train(module: nn.Module, stage: int, group: Any, rank: int) -> dict[str, Any]:
    """3 AdamW steps through 1F1B; the parameters after each (their tensor-parallel shards)
    and each step's peaks."""
    batch = (
        stage_inputs(stage, MICROBATCH)[0],
        stage_inputs(0, MICROBATCH * MICROBATCHES)[0],
        stage_inputs(STAGES - 1, MICROBATCH * MICROBATCHES)[1],
    )
    return train_1f1b(module, stage, STAGES, batch, MICROBATCHES, group, rank, _local)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p.detach()  # DTensor under TP


def main(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    gloo_settle.settle_functional_waits()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "tp"))
        stage = mesh.get_coordinate()[0]  # type: ignore[index]
        model = build(stage)
        parallelize_module(model, mesh["tp"], llama_tp_plan(model, mesh["tp"].size()))
        work = copy.deepcopy(model)
        group = mesh["pp"].get_group()
        plain = _train(model, stage, group, rank)
        pipe = remat.Pipeline("1F1B", stage, STAGES, MICROBATCHES, loss_fn=pipeline_loss)
        x, target = stage_inputs(stage, MICROBATCH)
        kw: dict[str, Any] = {"pipeline": pipe, "target": target if pipe.last else None}
        probe = remat.apply(copy.deepcopy(work), x, plan="keep_all", **kw)
        eager = remat.plan_of(probe).predicted_peak_bytes
        budget = int(0.9 * eager)
        remat.apply(work, x, activation_budget_bytes=budget, solver="exact", **kw)
        state = applied(work)
        assert state.schedule is not None
        plan_file = remat.save_plan(work, Path(out) / f"plan_{rank}.json")
        torch.save(
            {
                "plain": plain,
                "remat": _train(work, stage, group, rank),
                "eager": eager,
                "budget": budget,
                "predicted": state.plan.predicted_peak_bytes,
                "predicted_tensors": state.plan.predicted_tensor_peak_bytes,
                "in_flight": state.schedule.max_in_flight,
                "solver": state.plan.solver,
                "reason": state.plan.reason,
                "ahead": _planned_ahead(stage, pipe, kw["target"], plan_file),
            },
            Path(out) / f"pp_tp_{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
