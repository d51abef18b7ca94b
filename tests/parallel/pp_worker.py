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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

import remat
from remat.executors.sac.state import applied
from remat.measure.meter import peaks_of
from tests.zoo import GPTStage, pipeline_loss, stage_inputs

STEPS = 3
MICROBATCHES = 4
MICROBATCH = 2
SCHEDULES = ("1F1B", "Interleaved1F1B")
PER_RANK = {"1F1B": 1, "Interleaved1F1B": 2}
"""Stages per rank: Interleaved1F1B runs stages r and r + world on rank r."""


def _stage(
    module: nn.Module, index: int, n_stages: int, x: torch.Tensor, group: Any = None
) -> PipelineStage:
    """Told every shape (as torchtitan's stages are), so no metadata is exchanged; its p2p
    over ``group`` (None: the default group)."""
    with torch.no_grad():
        y = module(x)
    last = index == n_stages - 1
    return PipelineStage(
        module,
        index,
        n_stages,
        torch.device("cpu"),
        input_args=(x,),
        output_args=(y,),
        output_grads=(None if last else y,),
        input_grads=(None if index == 0 else x,),
        group=group,
    )


def train_1f1b(
    module: nn.Module,
    stage: int,
    n_stages: int,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    microbatches: int,
    group: Any,
    rank: int,
    whole: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    """Stage ``stage`` (one per rank) trained for 3 AdamW steps through 1F1B over ``group``:
    the parameters after each (as ``whole`` gives them: a shard, a gathered tensor) and each
    step's peaks. ``batch``: one microbatch's input of the stage, the step's tokens and its
    targets."""
    from torch.distributed.pipelining import Schedule1F1B

    x, tokens, targets = batch
    pipe_stage = _stage(module, stage, n_stages, x, group)
    schedule = Schedule1F1B(pipe_stage, n_microbatches=microbatches, loss_fn=pipeline_loss)
    ends = (stage == 0, stage == n_stages - 1)
    params, peaks = _steps(module, schedule, rank, ends, (tokens, targets), whole)
    return {"params": params, "peaks": peaks}


def _steps(
    module: nn.Module,
    schedule: Any,
    rank: int,
    ends: tuple[bool, bool],
    data: tuple[torch.Tensor, torch.Tensor],
    whole: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[list[dict[str, torch.Tensor]], list[Any]]:
    """3 AdamW steps of ``module`` through ``schedule``: the parameters after each (as
    ``whole`` gives them) and each step's peaks. ``ends``: whether the rank holds the first
    stage (it feeds the step's tokens) and the last (it takes the targets), ``data``."""
    (first, last), (tokens, targets) = ends, data
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    params, peaks = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 * (rank + 1) + step)
        if first:
            peaks.append(peaks_of(lambda: schedule.step(tokens)))
        elif last:
            peaks.append(peaks_of(lambda: schedule.step(target=targets, losses=[])))
        else:
            peaks.append(peaks_of(schedule.step))
        opt.step()
        params.append({n: whole(p).clone() for n, p in module.named_parameters()})
    return params, peaks


def _indices(name: str, rank: int, world: int) -> list[int]:
    return [rank + world * v for v in range(PER_RANK[name])]


def _model(name: str, rank: int, world: int) -> nn.Module:
    """The rank's stage, or its stages as one ``nn.ModuleList`` (2 blocks per rank)."""
    if PER_RANK[name] == 1:
        return GPTStage(rank, world)
    n = world * PER_RANK[name]
    return nn.ModuleList(GPTStage(i, n, layers=1) for i in _indices(name, rank, world))


def _train(module: nn.Module, schedule_name: str, rank: int, world: int) -> dict[str, Any]:
    """3 AdamW steps through the schedule; the parameters after each, each step's peaks and
    the order the rank's actions ran in (as :attr:`ScheduleTrace.order` writes it)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    several = PER_RANK[schedule_name] > 1
    n = world * PER_RANK[schedule_name]
    chunks = list(module) if several else [module]
    stages = [
        _stage(m, i, n, stage_inputs(i, MICROBATCH)[0])
        for m, i in zip(chunks, _indices(schedule_name, rank, world), strict=True)
    ]
    order: list[str] = []
    for stage in stages:
        for kind, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            run = getattr(stage, attr)

            def logged(
                mb: int, *a: Any, _run: Any = run, _k: str = kind, _s: Any = stage, **k: Any
            ) -> Any:
                order.append(f"{_s.stage_index if several else ''}{_k}{mb}")
                return _run(mb, *a, **k)

            setattr(stage, attr, logged)
    schedule = get_schedule_class(schedule_name)(
        stages if several else stages[0], n_microbatches=MICROBATCHES, loss_fn=pipeline_loss
    )
    tokens, _ = stage_inputs(0, MICROBATCH * MICROBATCHES)
    _, targets = stage_inputs(n - 1, MICROBATCH * MICROBATCHES)
    ends = (rank == 0, rank == world - 1)
    params, peaks = _steps(module, schedule, rank, ends, (tokens, targets), torch.Tensor.detach)
    first_step = order[: len(order) // STEPS]
    return {"params": params, "peaks": peaks, "order": " ".join(first_step)}


def main(rank: int, world: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results = {}
        for name in SCHEDULES:
            model = _model(name, rank, world)
            work = copy.deepcopy(model)
            plain = _train(model, name, rank, world)
            per_rank = PER_RANK[name]
            pipe = remat.Pipeline(
                name,
                rank,
                world * per_rank,
                MICROBATCHES,
                loss_fn=pipeline_loss,
                stages_per_rank=per_rank,
            )
            xs = tuple(stage_inputs(i, MICROBATCH)[0] for i in pipe.indices)
            x = xs if per_rank > 1 else xs[0]
            target = stage_inputs(pipe.n_stages - 1, MICROBATCH)[1] if pipe.last else None
            blocks = ("*.blocks.*",) if per_rank > 1 else ()
            if name == "Interleaved1F1B":  # auto, under a budget below the eager peak
                probe = remat.apply(
                    copy.deepcopy(work), x, pipeline=pipe, target=target, plan="keep_all",
                    block_types=blocks,
                )  # fmt: skip
                eager = remat.plan_of(probe).predicted_peak_bytes
                budget = int(0.85 * eager)
                remat.apply(
                    work, x, pipeline=pipe, target=target, activation_budget_bytes=budget,
                    block_types=blocks,
                )  # fmt: skip
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
