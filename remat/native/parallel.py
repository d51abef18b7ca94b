"""Tensor-parallel plans for planning without processes.

Inside a job, ``remat.apply`` takes the model the job parallelized (``parallelize_module``
first, then ``remat.apply``, then ``fully_shard``) and needs nothing from here. To plan a
tensor-parallel run ahead of time (``remat plan --executor sac --tp-size 8``), the model is
built on FakeTensors and parallelized here over a fake process group, with the layout
torchtitan gives Llama: attention q/k/v and the MLP's gate/up projections column-wise, the
attention output and down projections row-wise, everything else replicated. The planned
step is the first rank's of its tensor-parallel group; every rank of the group runs the same
shapes. With FSDP2 (``dp_size``) or pipeline stages (``pp_size``) as well, the ranks form
one fake mesh, ``("pp", "dp", "tp")`` less the dimensions of size 1, as in torchtitan.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from remat import _torch_compat as tc

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def llama_tp_plan(model: nn.Module, tp_size: int) -> dict[str, Any]:
    """``parallelize_module``'s plan for a Llama-family model (Llama, Mistral, Qwen2: the
    Hugging Face projection names); a clear error for other layouts and for head counts
    ``tp_size`` does not divide."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for path, m in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if not isinstance(m, nn.Linear):
            continue
        if leaf in COLWISE:
            if m.out_features % tp_size:
                raise ValueError(f"--tp-size {tp_size} does not divide {path}'s outputs")
            plan[path] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[path] = RowwiseParallel()
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no Llama-style projections ({', '.join(COLWISE)}; "
            f"{', '.join(ROWWISE)}): plan tensor parallelism inside the job instead "
            "(parallelize_module, then remat.apply on the parallel model)"
        )
    return plan


def tensor_parallel(
    model: nn.Module, tp_size: int, dp_size: int = 1, pp_size: int = 1, pp_rank: int = 0
) -> nn.Module:
    """``model`` (FakeTensors) parallelized in place over ``tp_size`` fake ranks with
    :func:`llama_tp_plan`; returns it. ``dp_size > 1``: for TP x FSDP2, the ranks laid out
    on a ``(dp_size, tp_size)`` mesh as torchtitan lays them (tensor parallel within a row,
    FSDP2 down a column); plan it with ``remat.apply(..., zero_stage=3, world_size=dp_size)``
    and the trace shards it with FSDP2 over the mesh's ``"dp"`` dimension. ``pp_size > 1``:
    ``model`` is pipeline rank ``pp_rank``'s stage (or its stages, as one module list) on a
    ``(pp_size, tp_size)`` mesh; plan it with ``remat.apply(..., pipeline=Pipeline(...,
    stage=pp_rank, ...))``, whose schedule then runs over the mesh's ``"pp"`` dimension."""
    if tp_size < 2:
        raise ValueError(f"tp_size must be at least 2, got {tp_size}")
    if dp_size < 1 or pp_size < 1:
        raise ValueError(f"dp_size and pp_size must be at least 1, got {dp_size}, {pp_size}")
    tc.tensor_parallel_fake(
        model, tp_size, lambda m: llama_tp_plan(m, tp_size), dp_size, pp_size, pp_rank
    )
    return model
