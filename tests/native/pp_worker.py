"""One rank of the pipeline check (spawned by ``test_pipeline.py``): one stage per rank.

Per schedule, the rank's stage is trained for 3 AdamW steps through
``torch.distributed.pipelining`` as is, then, from the same weights, batch and random
streams, after ``remat.apply`` with this stage's place in the pipeline. The first step's
peaks are measured (live-storage meter and allocator, one run): it is the step that also
allocates the stage's receive buffers, which every later step reuses.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

import remat
from remat.meter import peaks_of
from remat.native.state import applied
from tests.zoo import GPTStage, pipeline_loss, stage_inputs

STEPS = 3
MICROBATCHES = 4
MICROBATCH = 2
SCHEDULES = ("1F1B", "GPipe")


def _stage(module: nn.Module, rank: int, world: int, x: torch.Tensor) -> PipelineStage:
    """Told every shape (as torchtitan's stages are), so no metadata is exchanged."""
    with torch.no_grad():
        y = module(x)
    last = rank == world - 1
    return PipelineStage(
        module,
        rank,
        world,
        torch.device("cpu"),
        input_args=(x,),
        output_args=(y,),
        output_grads=(None if last else y,),
        input_grads=(None if rank == 0 else x,),
    )


def _train(module: nn.Module, schedule_name: str, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining.schedules import get_schedule_class

    x, target = stage_inputs(rank, MICROBATCH)
    stage = _stage(module, rank, world, x)
    schedule = get_schedule_class(schedule_name)(
        stage, n_microbatches=MICROBATCHES, loss_fn=pipeline_loss
    )
    tokens, _ = stage_inputs(0, MICROBATCH * MICROBATCHES)
    _, targets = stage_inputs(world - 1, MICROBATCH * MICROBATCHES)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    params, peaks = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 * (rank + 1) + step)
        if rank == 0:
            peaks.append(peaks_of(lambda: schedule.step(tokens)))
        elif rank == world - 1:
            peaks.append(peaks_of(lambda: schedule.step(target=targets, losses=[])))
        else:
            peaks.append(peaks_of(schedule.step))
        opt.step()
        params.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return {"params": params, "peaks": peaks}


def main(rank: int, world: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results = {}
        for name in SCHEDULES:
            model = GPTStage(rank, world)
            work = copy.deepcopy(model)
            plain = _train(model, name, rank, world)
            pipe = remat.Pipeline(name, rank, world, MICROBATCHES, loss_fn=pipeline_loss)
            x, target = stage_inputs(rank, MICROBATCH)
            target = target if pipe.last else None
            if name == "1F1B":  # auto, under a budget below the eager peak
                probe = remat.apply(
                    copy.deepcopy(work), x, pipeline=pipe, target=target, plan="keep_all"
                )
                eager = remat.plan_of(probe).predicted_peak_bytes
                budget = int(0.85 * eager)
                remat.apply(work, x, pipeline=pipe, target=target, activation_budget_bytes=budget)
            else:  # a fixed plan (every block recomputed): one trace, no search
                remat.apply(work, x, pipeline=pipe, target=target, plan="block")
                eager = budget = applied(work).eager_peak_bytes
            state = applied(work)
            assert state.schedule is not None
            ours = _train(work, name, rank, world)
            results[name] = {
                "plain": plain,
                "remat": ours,
                "eager": eager,
                "budget": budget,
                "predicted": state.plan.predicted_peak_bytes,
                "predicted_tensors": state.plan.predicted_tensor_peak_bytes,
                "in_flight": state.schedule.max_in_flight,
                "order": state.schedule.order,
                "recompute_s": state.plan.simulation.recompute_time_s,
            }
        torch.save(results, Path(out) / f"pp_{rank}.pt")
    finally:
        dist.destroy_process_group()
