"""One rank of the TP x FSDP2 check (spawned by ``test_tensor_parallel.py``).

Four ranks on a 2x2 mesh, ``("dp", "tp")``, as torchtitan lays out FSDP x TP: the zoo's
Llama parallelized over ``"tp"`` (:func:`tests.parallel.tp_worker.parallelize`), then each
layer and the root ``fully_shard``-ed over ``"dp"``; each data-parallel row its own batch.
Once trained as is, once after ``remat.apply(..., zero_stage=3, world_size=2)`` (after
``parallelize_module``, before ``fully_shard``), from the same weights and random streams.
The plan is also re-applied ahead of the job, to a FakeTensor copy parallelized on a fake
2-D mesh (``remat plan --tp-size 2 --zero-stage 3 --world-size 2``'s path), whose predicted
peak is saved beside the measured one.
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
from remat.parallel.tensor import tensor_parallel
from tests.executors.sac import gloo_settle
from tests.executors.sac.dist_worker import _train  # the same 3 AdamW steps, measured
from tests.parallel.tp_worker import build, on_time, parallelize

OPTIONS: dict[str, Any] = {"zero_stage": 3, "world_size": 2}  # FSDP2 over the "dp" dimension


def _shard(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _planned_ahead(tokens: torch.Tensor, plan_file: Path) -> tuple[int, int]:
    """The job's plan re-applied to the model built on FakeTensors on a fake 2-D mesh."""
    with remat.fake_mode():
        model, _ = build()
    tensor_parallel(model, 2, dp_size=2)
    remat.apply(model, tokens, plan=plan_file, **OPTIONS)
    plan = remat.plan_of(model)
    return plan.predicted_tensor_peak_bytes, plan.predicted_peak_bytes


def main(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    gloo_settle.settle_functional_waits()
    gloo_settle.settle_work_waits()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, tokens = build()
        tokens = tokens.roll(mesh.get_coordinate()[0], dims=0)  # type: ignore[index]
        parallelize(model, mesh["tp"])
        work = copy.deepcopy(model)
        plain = _train(_shard(model, mesh["dp"]), tokens, rank)
        try:
            remat.apply(
                copy.deepcopy(work), tokens, activation_budget_bytes=1, solver="exact", **OPTIONS
            )
        except remat.BudgetError as e:
            least = e.least_peak_bytes
        budget = (least + plain["peak"]) // 2
        remat.apply(work, tokens, activation_budget_bytes=budget, solver="exact", **OPTIONS)
        plan = remat.plan_of(work)
        plan_file = remat.save_plan(work, Path(out) / f"plan_{rank}.json")
        torch.save(
            {
                "plain": plain,
                "remat": _train(_shard(work, mesh["dp"]), tokens, rank),
                "ahead": _planned_ahead(tokens, plan_file),
                "budget": budget,
                "least": least,
                "predicted": plan.predicted_peak_bytes,
                "predicted_tensors": plan.predicted_tensor_peak_bytes,
                "on_time": on_time(plan),
                "solver": plan.solver,
            },
            Path(out) / f"tp_fsdp_{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
