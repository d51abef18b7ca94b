"""One rank of the tensor-parallel check (spawned by ``test_tensor_parallel.py``).

The zoo's Llama (grouped-query attention, attention dropout) is parallelized over the ranks
as torchtitan does for Llama: q, k, v, gate and up projections column-wise, o and down
row-wise. Once trained as is, once after ``remat.apply`` (after ``parallelize_module``, as
torchtitan orders checkpointing after TP), from the same weights, batch and random streams.
Every rank saves its full parameters after each step, the last step's peaks (live-storage
meter and allocator, one run) and the collectives one step ran.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.measure.meter import measure_step, training_step
from remat.parallel.tensor import llama_tp_plan, tensor_parallel
from tests.executors.sac import gloo_settle
from tests.executors.sac.dist_worker import _train  # the same 3 AdamW steps, measured
from tests.zoo import llama


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = llama(3, 128).train()
    return model, torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(7))


def parallelize(model: nn.Module, mesh: Any = None, sequence_parallel: bool = False) -> nn.Module:
    """torchtitan's Llama layout over ``mesh`` (default: every rank, one dimension); with
    ``sequence_parallel``, remat's copy of torchtitan's sequence-parallel plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if sequence_parallel:
        return parallelize_module(model, mesh, llama_tp_plan(model, mesh.size(), True))
    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):  # type: ignore[union-attr, arg-type]
        at = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[at + name] = ColwiseParallel()
        plan[at + "mlp.gate_proj"] = ColwiseParallel()
        plan[at + "mlp.up_proj"] = ColwiseParallel()
        plan[at + "self_attn.o_proj"] = RowwiseParallel()
        plan[at + "mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


class _Collectives(TorchDispatchMode):
    """Counts the functional collectives a step runs (a recomputed one would run twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "_c10d_functional":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _collectives(model: nn.Module, tokens: torch.Tensor) -> int:
    counter = _Collectives()
    with counter:
        training_step(model, (tokens,), {})
    for p in model.parameters():
        p.grad = None
    return counter.count


def _wrong_order(tokens: torch.Tensor) -> str:
    """remat.apply before parallelize_module: the first step refuses, naming the order."""
    model, _ = build()
    remat.apply(model, tokens, plan="block")
    parallelize(model)
    try:
        training_step(model, (tokens,), {})
    except remat.BlockError as e:
        return str(e)
    return "ran"


def _planned_ahead(tokens: torch.Tensor, sequence_parallel: bool) -> dict[str, int]:
    """Per fixed plan, the live-tensor peak planned with no process group: the model built on
    FakeTensors and parallelized over a fake one (``remat plan --tp-size``'s path)."""
    out = {}
    for name in ("keep_all", "block"):
        with remat.fake_mode():
            model, _ = build()
        tensor_parallel(model, dist.get_world_size(), sequence_parallel=sequence_parallel)
        remat.apply(model, tokens, plan=name)
        out[name] = remat.plan_of(model).predicted_tensor_peak_bytes
    return out


def _measured(model: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """Per fixed plan, the live-tensor peak of a real step of the parallel model."""
    out = {}
    for name in ("keep_all", "block"):
        work = copy.deepcopy(model)
        remat.apply(work, tokens, plan=name)
        out[name] = measure_step(work, (tokens,), seed=0).peak_bytes
    return out


def on_time(plan: remat.Plan) -> tuple[int, int]:
    """The step's peaks (allocator, live storages) where the process group lets go of each
    collective's output as Python does: the prediction less, at each moment, the one it
    counts late (:attr:`remat.executors.sac.events.OpEvent.late_bytes`). The timeline must
    hold the predicted peaks (it does not for a pipeline stage, planned over its schedule)."""
    steps = plan.simulation.timeline
    assert max(s.allocated_bytes for s in steps) == plan.predicted_peak_bytes
    assert max(s.live_bytes for s in steps) == plan.predicted_tensor_peak_bytes
    return (
        max(s.allocated_bytes - s.late_bytes for s in steps),
        max(s.live_bytes - s.late_bytes for s in steps),
    )


def main(rank: int, world: int, out: str, sequence_parallel: bool = False) -> None:
    gloo_settle.settle_functional_waits()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model, tokens = build()
        parallelize(model, sequence_parallel=sequence_parallel)
        work = copy.deepcopy(model)
        fixed = _measured(model, tokens)
        collectives = _collectives(model, tokens)
        plain = _train(model, tokens, rank)
        try:
            remat.apply(copy.deepcopy(work), tokens, activation_budget_bytes=1, solver="exact")
        except remat.BudgetError as e:
            least = e.least_peak_bytes
        budget = (least + plain["peak"]) // 2  # half-way between least and eager, this rank
        remat.apply(work, tokens, activation_budget_bytes=budget, solver="exact")
        plan = remat.plan_of(work)
        torch.save(
            {
                "plain": plain,
                "remat": _train(work, tokens, rank),
                "collectives": (collectives, _collectives(work, tokens)),
                "wrong_order": _wrong_order(tokens),
                "fixed": (fixed, _planned_ahead(tokens, sequence_parallel)),
                "budget": budget,
                "least": least,
                "predicted": plan.predicted_peak_bytes,
                "predicted_tensors": plan.predicted_tensor_peak_bytes,
                "on_time": on_time(plan),
                "solver": plan.solver,
            },
            Path(out) / f"tp_{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
