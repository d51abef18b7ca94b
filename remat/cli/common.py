"""What the subcommands share: their options, the request and executor they name, the
model's parallel layout, consoles and number formats."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

import torch
from rich.console import Console

from remat.budget import (
    DEFAULT_RESERVE,
    GB,
    OPTIMIZER_STATES,
    PRECISIONS,
    Optimizer,
)
from remat.executors import EXECUTORS, SAC, Executor
from remat.measure.profiles import PROFILE_NAMES
from remat.parallel.tensor import tensor_parallel
from remat.presets import Built
from remat.request import Request


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def make_console(piped_width: int) -> Console:
    """The terminal's width; piped output (CI logs, files) gets ``piped_width`` so tables are
    never squeezed, unless ``COLUMNS`` says otherwise."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=piped_width)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss in ``remat plan --pp-size``: cross-entropy against the tokens."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def parallelize(model: torch.nn.Module, args: argparse.Namespace, executor: Executor) -> None:
    """``--tp-size``: the model parallelized on a fake process group as torchtitan does Llama
    (:mod:`remat.parallel.tensor`); only ``remat.apply``'s executor runs tensor-parallel.
    With ``--zero-stage 3 --world-size N`` (TP x FSDP2): ``N x tp`` ranks on one 2-D mesh,
    FSDP2 over its ``N`` data-parallel ranks."""
    if not executor.distributed:
        raise ValueError(f"--tp-size plans {SAC.entry}'s executor: use --executor {SAC.name}")
    fsdp = args.zero_stage == 3 and args.world_size > 1
    tensor_parallel(
        model,
        args.tp_size,
        dp_size=args.world_size if fsdp else 1,
        sequence_parallel=args.sequence_parallel,
    )


def no_factory_loss(built: Built) -> None:
    if built.loss_fn is not None:
        raise ValueError(
            "a pipeline's loss is its last stage's (remat.Pipeline(loss_fn=...)): the "
            "factory's loss_fn is not planned with --pp-size"
        )


def executor_of(args: argparse.Namespace, built: Built | None = None) -> Executor:
    """``--executor``'s executor; ``auto``: ``sac`` where the run is sharded or replicated
    (ZeRO-3 over several ranks is FSDP2, data parallel is DDP: engines only the ``sac``
    executor runs under) or where a factory gives a loss outside the model (as torchtitan's
    trainer runs it: on the user's own blocks), ``graph`` on one device."""
    loss = built is not None and built.loss_fn is not None
    if args.executor != "auto":
        return EXECUTORS[args.executor]
    parallel = getattr(args, "tp_size", 1) > 1 or getattr(args, "pp_size", 1) > 1
    return EXECUTORS["sac" if args.world_size > 1 or parallel or loss else "graph"]


def request_of(args: argparse.Namespace, progress: Callable[[str], None]) -> Request:
    return Request.of(
        budget_gb=args.budget_gb,
        optimizer=args.optimizer,
        precision=args.precision,
        zero_stage=args.zero_stage,
        world_size=args.world_size,
        reserve_fraction=args.reserve,
        solver=getattr(args, "solver", None),
        device_profile=args.device,
        time_limit_s=args.time_limit,
        floor_time_s=getattr(args, "floor_time", 0.0),
        max_seq=getattr(args, "max_seq", None),
        progress=progress,
        workers=getattr(args, "workers", None),
        host_budget_gb=getattr(args, "host_budget_gb", None),
    )


def gb_text(n: float) -> str:
    return f"{n / GB:.2f} GB"


def executor_label(name: str) -> str:
    if name not in ("auto", *EXECUTORS):
        raise argparse.ArgumentTypeError(
            f"unknown executor {name!r}; valid: auto, {', '.join(EXECUTORS)}"
        )
    return name


def tp_text(args: argparse.Namespace) -> str:
    if args.tp_size < 2:
        return ""
    sp = " with sequence parallelism" if args.sequence_parallel else ""
    return f", tensor parallel x {args.tp_size}{sp} (rank 0's shard)"


def tp_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (Llama-family models; --executor sac): plans rank 0 of "
        "the layout torchtitan uses (q/k/v/gate/up column-wise, o/down row-wise); with "
        "--zero-stage 3, FSDP2 shards over --world-size data-parallel ranks of a "
        "(world-size x tp-size) mesh",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp-size: torchtitan's sequence parallelism too (norms on sequence "
        "shards, all-gathers before attention and the MLP, reduce-scatters after them)",
    )


def pp_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pp-size",
        type=int,
        default=1,
        help="pipeline stages (Llama-family models; --executor sac): the layers split evenly, "
        "each stage on a rank of its own, within its budget over a whole schedule step",
    )
    p.add_argument(
        "--pp-schedule",
        default="1F1B",
        help="pipeline schedule: 1F1B, GPipe; with --stages-per-rank, Interleaved1F1B or LoopedBFS",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=1,
        help="stages on each pipeline rank (multi-stage schedules): --pp-size x this stages",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per step with --pp-size (default: --pp-size); --batch is the step's",
    )


def optimizer_arg(text: str) -> Optimizer:
    """``--optimizer``: a name, or ``module:attr`` naming an optimizer class or factory."""
    if text in OPTIMIZER_STATES:
        return text
    module_name, sep, attr = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {text!r}: one of {', '.join(OPTIMIZER_STATES)}, or module:attr "
            "(torch.optim:Adafactor)"
        )
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"cannot load optimizer {text!r}: {e}") from None
    if not callable(found):
        raise argparse.ArgumentTypeError(f"{text} is not an optimizer class or factory")
    return found  # type: ignore[no-any-return]


def model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="bf16-fsdp: FSDP2's MixedPrecisionPolicy (--executor sac, ZeRO-3)")  # fmt: skip
    p.add_argument(
        "--optimizer", default="adamw", type=optimizer_arg,
        help="adamw, adam, sgd, none, or module:attr naming a torch.optim.Optimizer class or "
        "a factory of one from the parameters (torch.optim:Adafactor): its state is measured",
    )  # fmt: skip
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--reserve", type=float, default=DEFAULT_RESERVE, help="reserve fraction")
    p.add_argument("--device", default="h100", help=f"profile: {', '.join(PROFILE_NAMES)}")
    p.add_argument(
        "--time-limit", type=float, default=60.0,
        help="each solver's work, in counted seconds (the same plan under any load)",
    )  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable)")  # fmt: skip
    p.add_argument(
        "--executor",
        type=executor_label,
        default="auto",
        help="graph (remat.optimize), sac (remat.apply: FSDP2, DDP, compile) or auto (the "
        "default: sac with --world-size, --tp-size or --pp-size above 1 or a factory's own "
        "loss, graph on one device)",
    )


def floor_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--floor-time",
        type=float,
        default=0.0,
        help="seconds more for a tighter proven floor under a whole-graph chain plan (the "
        "blocks' fronts, plan.lower_bound_s)",
    )
