"""``remat plan``: one plan for a model, under FakeTensors, for a device you may not have.

``remat plan MODEL --budget-gb N`` plans a preset (``remat plan --list``), any transformers
architecture (``hf:llama --set hidden_size=4096``) or a factory, and prints the memory
breakdown and the plan by module; ``--save`` writes the plan file. ``--executor sac`` plans
for :func:`remat.apply` (selective checkpointing on the blocks, what FSDP2, DDP and compile
run): its plan file is what ``remat.apply(model, inputs, plan="plan.json")`` takes on every
rank. ``--pp-size`` plans every stage of a pipeline at once.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from remat.budget import optimizer_name
from remat.cli.common import (
    executor_of,
    floor_option,
    make_console,
    model_options,
    no_factory_loss,
    parallelize,
    pp_options,
    request_of,
    tp_options,
    tp_text,
)
from remat.cli.stages import pipeline_options, pipeline_stages
from remat.executors import Executor
from remat.executors.sac.apply import save_plan
from remat.executors.sac.events import TraceError
from remat.executors.sac.state import applied
from remat.parallel.pipeline_plan import plan_pipeline
from remat.presets import PRESETS, Built, build, parse_settings


def plan_command(args: argparse.Namespace) -> int:
    """``remat plan MODEL --budget-gb N ...``: plan a model under FakeTensorMode and report
    (``--json``: print the plan document, the report going to stderr)."""
    console = Console(stderr=True, width=120) if args.json else make_console(120)
    if args.list:
        table = Table(
            title="presets (Hugging Face configs, random init, planned with fake tensors)"
        )
        table.add_column("name")
        table.add_column("model")
        for name, preset in PRESETS.items():
            table.add_row(name, preset.description)
        console.print(table)
        console.print(
            "also: hf:MODEL_TYPE (any transformers architecture, --set KEY=VALUE "
            "overrides its config) and pkg.module:factory"
        )
        return 0
    if args.model is None:
        console.print("[red]remat plan: name a model (remat plan --list shows the presets)")
        return 2
    if args.json and args.pp_size > 1:
        console.print("[red]remat plan: --json prints one plan; not with --pp-size")
        return 2
    if args.sequence_parallel and args.tp_size < 2:
        console.print("[red]remat plan: --sequence-parallel needs --tp-size 2 or more")
        return 2
    t0 = time.perf_counter()
    try:
        built = build(args.model, seq=args.seq, batch=args.batch, settings=parse_settings(args.set))
        executor = executor_of(args, built)
        if args.pp_size > 1:
            no_factory_loss(built)
    except ValueError as e:
        console.print(f"[red]remat plan: {e}")
        return 2
    n = sum(p.numel() for p in built.model.parameters())
    if args.pp_size > 1:
        return _plan_pipeline(args, built, executor, console)
    tp = ""
    if args.tp_size > 1:
        try:
            parallelize(built.model, args, executor)
        except ValueError as e:
            console.print(f"[red]remat plan: {e}")
            return 2
        tp = tp_text(args)
        if args.zero_stage == 3 and args.world_size > 1:
            tp += f": {args.world_size * args.tp_size} ranks on a 2-D mesh"
    console.print(
        f"[bold]{built.description}[/]: {n / 1e9:.2f}B parameters; {args.precision}, "
        f"{optimizer_name(args.optimizer)}, ZeRO-{args.zero_stage} x {args.world_size}{tp}, "
        f"profile {args.device}, budget {args.budget_gb} GB per device"
    )
    console.print(f"executor: {executor}")
    progress = console.status("planning...")
    with progress:
        try:
            req = request_of(args, lambda msg: progress.update(f"planning: {msg}"))
            planned = executor.plan(
                built.model, built.args, example_kwargs=built.kwargs, request=req, **built.loss()
            )
        except (ValueError, TraceError) as e:
            console.print(f"[red]remat plan: {e}")
            return 1
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps(planned.document(), indent=1))
    else:
        console.print(planned.explain(width=console.width), end="")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in planned.timings.items())
    console.print(f"wall time {wall:.1f} s ({stages}), max RSS {rss:.2f} GiB")
    if args.save:
        console.print(f"plan written to {planned.save(args.save)}")
    return 0


def _plan_pipeline(
    args: argparse.Namespace, built: Built, executor: Executor, console: Console
) -> int:
    """``--pp-size``: the model cut into stages (:mod:`remat.parallel.split`), every stage
    planned at once (:func:`remat.plan_pipeline`), one device budget per rank; with
    ``--stages-per-rank V`` (Interleaved1F1B, LoopedBFS) ``pp_size x V`` stages."""
    t0 = time.perf_counter()
    per_rank = args.stages_per_rank
    try:
        stages, inputs, micro, microbatches = pipeline_stages(args, built, executor)
    except ValueError as e:
        console.print(f"[red]remat plan: {e}")
        return 2
    console.print(
        f"[bold]{built.description}[/]: {len(stages)} stages on {args.pp_size} ranks "
        "(layers per stage: "
        f"{', '.join(str(len(s.layers)) for s in stages)}), {args.pp_schedule}, "
        f"{microbatches} microbatches of {micro.shape[0]}"
        f"{f', tensor parallel x {args.tp_size}' if args.tp_size > 1 else ''}"
        f"{f', ZeRO-3 x {args.world_size}' if args.zero_stage == 3 else ''}; "
        f"{args.precision}, {optimizer_name(args.optimizer)}, "
        f"profile {args.device}, budget {args.budget_gb} GB per rank's device"
    )
    console.print(f"executor: {executor}")
    progress = console.status("planning...")
    with progress:
        try:
            req = request_of(args, lambda msg: progress.update(f"planning: {msg}"))
            planned = plan_pipeline(
                stages, inputs, **pipeline_options(args, req, micro, microbatches)
            )
        except (ValueError, TraceError) as e:
            console.print(f"[red]remat plan: {e}")
            return 1
    console.print(planned.summary(), end="")
    what = "stage" if per_rank == 1 else "rank"
    for r, module in enumerate(planned.modules):
        plan = applied(module).plan
        console.print(f"{what} {r}: {plan.solver}, {plan.reason}")
    console.print(f"wall time {time.perf_counter() - t0:.1f} s")
    if args.save:
        root = Path(args.save)
        for r, module in enumerate(planned.modules):
            path = root.with_name(f"{root.stem}.{what}{r}{root.suffix}")
            console.print(f"{what} {r}'s plan written to {save_plan(module, path)}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``remat plan`` to the command line."""
    p = sub.add_parser(
        "plan",
        help="plan a preset, hf:MODEL_TYPE or pkg.module:factory under a device budget",
        description="Plan under FakeTensorMode (no memory needed for 70B shapes) and print "
        "the memory breakdown and the plan by module.",
    )
    p.add_argument("model", nargs="?", help="preset name, hf:MODEL_TYPE or pkg.module:factory")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.add_argument("--budget-gb", type=float, default=80.0, help="device memory (1 GB = 1e9 B)")
    model_options(p)
    floor_option(p)
    p.add_argument("--solver", default=None, help="default: auto")
    p.add_argument("--save", default=None, metavar="PLAN.json", help="write the plan file")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the plan file's JSON document instead of the report (the report's "
        "lines go to stderr)",
    )
    p.add_argument(
        "--host-budget-gb",
        type=float,
        default=None,
        help="host memory per rank for offloaded saved values (default: none)",
    )
    tp_options(p)
    pp_options(p)
    p.set_defaults(func=plan_command)
