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
NORMS = ("input_layernorm", "post_attention_layernorm", "norm")
"""Sequence parallelism's norms: each layer's two and the final one (Hugging Face names)."""


def llama_tp_plan(
    model: nn.Module, tp_size: int, sequence_parallel: bool = False
) -> dict[str, Any]:
    """``parallelize_module``'s plan for a Llama-family model (Llama, Mistral, Qwen2: the
    Hugging Face projection names); a clear error for other layouts and for head counts
    ``tp_size`` does not divide.

    ``sequence_parallel``: torchtitan's Llama plan with sequence parallelism. The residual
    stream is sharded on the sequence: the embedding's output reduce-scattered, the norms
    run on a sequence shard each (``SequenceParallel``), attention and the MLP all-gather
    their input, and their row-wise projections reduce-scatter their output. The stream
    stays a DTensor (Hugging Face's model reads the sequence length off it), and the head
    returns replicated logits. A norm then saves a shard of its input, and the all-gathered
    inputs are collectives' outputs (always saved, never recomputed)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for path, m in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if sequence_parallel and leaf in NORMS:
            plan[path] = SequenceParallel()
        elif sequence_parallel and leaf == "self_attn":
            plan[path] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        elif sequence_parallel and leaf == "mlp":
            plan[path] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        elif sequence_parallel and leaf == "embed_tokens":
            plan[path] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            )
        elif not isinstance(m, nn.Linear):
            continue
        elif leaf in COLWISE:
            if m.out_features % tp_size:
                raise ValueError(f"--tp-size {tp_size} does not divide {path}'s outputs")
            plan[path] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[path] = (
                RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
                if sequence_parallel
                else RowwiseParallel()
            )
        elif sequence_parallel and leaf == "lm_head":
            if m.out_features % tp_size:
                raise ValueError(f"--tp-size {tp_size} does not divide {path}'s outputs")
            plan[path] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if not any(p.rsplit(".", 1)[-1] in COLWISE for p in plan):
        raise ValueError(
            f"{type(model).__name__} has no Llama-style projections ({', '.join(COLWISE)}; "
            f"{', '.join(ROWWISE)}): plan tensor parallelism inside the job instead "
            "(parallelize_module, then remat.apply on the parallel model)"
        )
    modules = dict(model.named_modules())
    weights = [
        modules[p].weight for p in plan if p.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head")
    ]
    if sequence_parallel and len(weights) == 2 and weights[0] is weights[1]:
        raise ValueError(
            f"{type(model).__name__} ties its embedding and head weights, which sequence "
            "parallelism shards two ways (rows, columns): plan it without sequence "
            "parallelism, or untie them (tie_word_embeddings=False)"
        )
    if sequence_parallel and not any(p.rsplit(".", 1)[-1] == "embed_tokens" for p in plan):
        raise ValueError(
            f"sequence parallelism shards the sequence at the embedding, which "
            f"{type(model).__name__} does not hold (a later pipeline stage, say): plan it "
            "without sequence parallelism"
        )
    return plan


def tensor_parallel(
    model: nn.Module,
    tp_size: int,
    dp_size: int = 1,
    pp_size: int = 1,
    pp_rank: int = 0,
    *,
    sequence_parallel: bool = False,
) -> nn.Module:
    """``model`` (FakeTensors) parallelized in place over ``tp_size`` fake ranks with
    :func:`llama_tp_plan`; returns it. ``dp_size > 1``: for TP x FSDP2, the ranks laid out
    on a ``(dp_size, tp_size)`` mesh as torchtitan lays them (tensor parallel within a row,
    FSDP2 down a column); plan it with ``remat.apply(..., zero_stage=3, world_size=dp_size)``
    and the trace shards it with FSDP2 over the mesh's ``"dp"`` dimension. ``pp_size > 1``:
    ``model`` is pipeline rank ``pp_rank``'s stage (or its stages, as one module list) on a
    ``(pp_size, tp_size)`` mesh; plan it with ``remat.apply(..., pipeline=Pipeline(...,
    stage=pp_rank, ...))``, whose schedule then runs over the mesh's ``"pp"`` dimension.
    ``sequence_parallel``: with torchtitan's sequence parallelism (:func:`llama_tp_plan`),
    for a whole model (a pipeline's later stages receive the sequence whole)."""
    if tp_size < 2:
        raise ValueError(f"tp_size must be at least 2, got {tp_size}")
    if dp_size < 1 or pp_size < 1:
        raise ValueError(f"dp_size and pp_size must be at least 1, got {dp_size}, {pp_size}")
    if sequence_parallel and pp_size > 1:
        raise ValueError(
            "sequence parallelism with pipeline stages is not planned yet: a later stage "
            "receives the whole sequence; plan the stages without it"
        )
    tc.tensor_parallel_fake(
        model,
        tp_size,
        lambda m: llama_tp_plan(m, tp_size, sequence_parallel),
        dp_size,
        pp_size,
        pp_rank,
    )
    return model
