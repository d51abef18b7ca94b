"""One rank of the distributed checks (spawned by ``test_distributed.py``).

Both runs start from the same weights and see the same per-rank batches and random streams:
once without remat, once with ``remat.apply`` before the engine wraps the model. Each rank
saves its parameters after every step and the last step's peaks: live-storage meter and
allocator (profiler), measured in the same run.
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
from remat.measure.meter import measure_step
from remat.models import TinyGPT
from tests.executors.sac import gloo_settle

STEPS = 3
HOST = 1 << 30
"""The host budget of ``fsdp2-offload`` (FSDP2 whose plan may offload block inputs)."""


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=3, seq=128)
    return model, torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(7))


def _wrap(model: nn.Module, engine: str) -> nn.Module:
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp: dict[str, Any] = {}
    if engine == "fsdp2-bf16":  # torchtitan's default policy
        mp["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model


def _train(model: nn.Module, tokens: torch.Tensor, rank: int) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params: list[dict[str, torch.Tensor]] = []
    peak = alloc = 0  # of the last step
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 * (rank + 1) + step)
        measured = measure_step(model, (tokens,), seed=step, allocator=True)
        peak, alloc = measured.peak_bytes, measured.allocator_peak_bytes
        opt.step()
        params.append({n: _full(p).clone() for n, p in model.named_parameters()})
    return {"params": params, "peak": peak, "allocator": alloc}


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # DTensor under FSDP2


def main(rank: int, world: int, engines: dict[str, int], out: str) -> None:
    """Each engine in turn (``engines``: engine -> activation budget), in one process group:
    a spawn and its imports cost more than one engine's run."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    gloo_settle.settle_work_waits()
    try:
        for engine, budget in engines.items():
            torch.save(_run(rank, world, engine, budget), Path(out) / f"{engine}_{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, engine: str, budget: int) -> dict[str, Any]:
    model, tokens = build()
    tokens = tokens.roll(rank, dims=0)  # each rank its own batch
    plain = _train(_wrap(copy.deepcopy(model), engine), tokens, rank)
    work = copy.deepcopy(model)
    fsdp: dict[str, Any] = {}
    if engine.startswith("fsdp2"):
        fsdp = {"zero_stage": 3, "world_size": world}
    if engine == "fsdp2-bf16":
        fsdp["precision"] = "bf16-fsdp"
    if engine == "fsdp2-offload":
        fsdp["host_budget_bytes"] = HOST
    remat.apply(work, tokens, activation_budget_bytes=budget, **fsdp)
    plan = remat.plan_of(work)
    ours = _train(_wrap(work, engine), tokens, rank)
    offloads = applied(work).offloads
    return {
        "offloaded_bytes": plan.offloaded_bytes,
        "host_predicted": plan.predicted_host_peak_bytes,
        "host_measured": offloads.store.peak_bytes if offloads is not None else 0,
        "plain": plain,
        "remat": ours,
        "predicted": plan.predicted_peak_bytes,
        "predicted_tensors": plan.predicted_tensor_peak_bytes,
        "solver": plan.solver,
        "saved": sorted(plan.saved),
        "reason": plan.reason,
    }
