"""The pipeline a command plans: a Llama-family model cut into stages as torchtitan cuts
it, each parallelized as its rank, with the schedule's options."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from remat.cli.common import (
    next_token_loss,
)
from remat.executors import SAC, Executor
from remat.executors.sac.trace import FSDP_PARAM_DTYPES
from remat.parallel.split import CausalLMStage, causal_lm_stages, stage_example
from remat.parallel.tensor import tensor_parallel
from remat.presets import Built
from remat.request import Request


def pipeline_stages(
    args: argparse.Namespace, built: Built, executor: Executor
) -> tuple[list[CausalLMStage], list[torch.Tensor], torch.Tensor, int]:
    """``--pp-size``: the model's stages (tensor-parallel with ``--tp-size``), one
    microbatch's input of each, that microbatch's tokens and the number of microbatches."""
    if not executor.distributed:
        raise ValueError(f"--pp-size plans {SAC.entry}'s executor: use --executor {SAC.name}")
    microbatches = args.microbatches or args.pp_size
    tokens = built.args[0] if built.args else None
    if not isinstance(tokens, torch.Tensor) or tokens.shape[0] % microbatches:
        raise ValueError(f"--batch {args.batch} does not split into {microbatches} microbatches")
    per_rank = args.stages_per_rank
    stages = causal_lm_stages(built.model, args.pp_size * per_rank)
    micro = tokens[: tokens.shape[0] // microbatches]
    # Under FSDP2's mixed precision the stages compute, and so send, in its dtype.
    dtype = FSDP_PARAM_DTYPES.get(args.precision) or next(built.model.parameters()).dtype
    inputs = [stage_example(s, micro, dtype) for s in stages]
    if args.tp_size > 1:
        tensor_parallel_stages(stages, args, per_rank)
    return stages, inputs, micro, microbatches


def pipeline_options(
    args: argparse.Namespace, req: Request, micro: torch.Tensor, microbatches: int
) -> dict[str, Any]:
    """What ``remat plan`` and ``remat fit`` with ``--pp-size`` tell the pipeline planner
    (:func:`remat.plan_pipeline`, :func:`remat.fit_pipeline`) besides the stages: the
    schedule, the next-token loss on ``micro``, and the request with the stages' layers as
    the blocks (one layer a stage too; a rank of several stages plans them as one list)."""
    return {
        "schedule": args.pp_schedule,
        "microbatches": microbatches,
        "loss_fn": next_token_loss,
        "target": micro,
        "stages_per_rank": args.stages_per_rank,
        "request": dataclasses.replace(req, block_types=("layers.*", "*.layers.*")),
    }


def tensor_parallel_stages(
    stages: list[CausalLMStage], args: argparse.Namespace, per_rank: int
) -> None:
    """``--pp-size`` with ``--tp-size``: each pipeline rank's stages parallelized together
    on a fake ``(pp, tp)`` mesh as that rank (:func:`remat.parallel.tensor.tensor_parallel`),
    the first of its tensor-parallel group; with ``--zero-stage 3 --world-size D`` a
    ``(pp, dp, tp)`` mesh, FSDP2 over its ``D`` data-parallel ranks."""
    dp = args.world_size if args.zero_stage == 3 else 1
    for r in range(args.pp_size):
        held = stages[r :: args.pp_size]
        module = held[0] if per_rank == 1 else torch.nn.ModuleList(held)
        tensor_parallel(
            module,
            args.tp_size,
            dp_size=dp,
            pp_size=args.pp_size,
            pp_rank=r,
            sequence_parallel=args.sequence_parallel,
        )
