"""``remat fit``: the longest sequence and the largest batch each plan fits in a budget,
from an exact formula of the step's peak in batch and sequence length (per rank of a
pipeline with ``--pp-size``)."""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from remat.budget import (
    GB,
    StaticMemoryError,
    optimizer_name,
)
from remat.cli.common import (
    executor_of,
    gb_text,
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
from remat.executors import GRAPH, SAC, Executor
from remat.executors.sac.events import TraceError
from remat.fit.pipeline import PipelineFitReport, fit_pipeline
from remat.fit.search import FitReport
from remat.fit.table import fit
from remat.plan.plots import fit_plot
from remat.presets import PRESETS, Built, build, parse_settings


def fit_command(args: argparse.Namespace) -> int:
    """``remat fit MODEL --budget-gb N``: the longest sequence and largest batch per plan."""
    console = make_console(140)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        built = build(args.model, seq=args.seq, batch=args.batch, settings=parse_settings(args.set))
        executor = executor_of(args, built)
        if args.pp_size > 1:
            no_factory_loss(built)
            return _fit_pipeline(args, built, executor, console, err)
        if args.menus:
            raise ValueError(
                "--menus is for --pp-size (one device's fit with --executor sac always "
                "traces the chain DP's menus)"
            )
        # A deep stack is fitted on fewer layers: one shallow copy for the graph executor,
        # copies of two depths for SAC's (remat.fit's ``shallow`` and ``copies``).
        shallow = _shallow(args.model, args, built.model) if executor is GRAPH else None
        copies = _copies(args.model, args, built.model) if executor is SAC else None
        if args.sequence_parallel and args.tp_size < 2:
            raise ValueError("--sequence-parallel needs --tp-size 2 or more")
        if args.tp_size > 1:
            parallelize(built.model, args, executor)
            if copies is not None:
                copies = _parallel_copies(copies, args, executor)
    except ValueError as e:
        err.print(f"[red]remat fit: {e}")
        return 2
    err.print(f"executor: {executor}")
    status = err.status("capturing...")
    with status:
        try:
            report = fit(
                built.model,
                built.args,
                example_kwargs=built.kwargs,
                request=request_of(args, lambda msg: status.update(msg)),
                shallow=shallow,
                executor=executor,
                copies=copies,
                **built.loss(),
            )
        except (StaticMemoryError, ValueError, TraceError) as e:
            err.print(f"[red]remat fit: {escape(str(e))}")
            return 1
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    _print_report(report, args, built, executor, console, wall)
    return 0


def _print_report(
    report: FitReport,
    args: argparse.Namespace,
    built: Built,
    executor: Executor,
    console: Console,
    wall: float,
) -> None:
    """The fit's table, hints, formula and ``--plot``, with the wall time and peak RSS."""
    d = report.budget
    console.print(
        f"[bold]{built.description}[/]; {args.precision}, {optimizer_name(args.optimizer)}, "
        f"ZeRO-{args.zero_stage} x {args.world_size}{tp_text(args)}, profile {args.device}, "
        f"executor {executor.name}. "
        f"Budget {gb_text(d.budget_bytes)}: static "
        f"{gb_text(d.static.total)}, reserve {gb_text(d.reserve_bytes)}, step "
        f"{gb_text(d.step_budget_bytes)}"
    )
    table = Table(title=f"what fits in {args.budget_gb:g} GB per device", box=box.SIMPLE_HEAD)
    for col in ("plan", f"max seq (batch {report.batch})", "device GB", "recompute %",
                f"max batch (seq {report.seq})", "device GB ", "recompute % "):  # fmt: skip
        table.add_column(col, justify="left" if col == "plan" else "right")
    for name, row in report.plans.items():
        cells = [name]
        for n, ch, limit in ((row.max_seq, row.at_max_seq, report.seq_limit),
                             (row.max_batch, row.at_max_batch, report.batch_limit)):  # fmt: skip
            if n is None or ch is None:
                cells += ["[red]none fits", "", ""]
                continue
            cells += [
                f"{n}" + (" (limit)" if n == limit else ""),
                f"{(d.static.total + ch.step_peak_bytes) / GB:.2f}",
                f"{ch.recompute_pct:.1f}",
            ]
        table.add_row(*cells)
    console.print(table)
    for hint in report.hints():
        console.print(f"[yellow]none fits: {escape(hint)}")
    console.print(
        "device GB: static + the step's peak (the reserve comes on top); recompute %: of the "
        "step's estimated time. Formula (no checkpointing, bytes):"
    )
    console.print(str(report.formula), markup=False, highlight=False)
    if args.plot:
        curves = _fit_curves(report)
        path = fit_plot(curves, d.budget_bytes - d.reserve_bytes, args.plot,
                        f"{built.description}: batch {report.batch}")  # fmt: skip
        console.print(f"wrote {path} (device memory against sequence length, per plan)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    console.print(f"wall time {wall:.1f} s, max RSS {rss:.2f} GiB")


def _fit_pipeline(
    args: argparse.Namespace, built: Built, executor: Executor, console: Console, err: Console
) -> int:
    """``remat fit --pp-size``: every rank of the pipeline within its budget
    (:func:`remat.fit_pipeline`), the microbatch size searched at ``--microbatches``."""
    if args.plot:
        raise ValueError("--plot draws one device's memory: not with --pp-size")
    if args.sequence_parallel:
        raise ValueError("--sequence-parallel with --pp-size is not supported yet")
    t0 = time.perf_counter()
    stages, inputs, micro, microbatches = pipeline_stages(args, built, executor)
    err.print(f"executor: {executor}")
    status = err.status("tracing the stages...")
    with status:
        req = request_of(args, lambda msg: status.update(msg))
        try:
            report = fit_pipeline(
                stages,
                inputs,
                menus=args.menus,
                **pipeline_options(args, req, micro, microbatches),
            )
        except (StaticMemoryError, ValueError, TraceError) as e:
            err.print(f"[red]remat fit: {escape(str(e))}")
            return 1
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    digits = max(2, 2 - math.floor(math.log10(args.budget_gb)))
    static = " / ".join(f"{b.static.total / GB:.{digits}f}" for b in report.budgets)
    console.print(
        f"[bold]{built.description}[/]: {len(stages)} stages on {len(report.budgets)} ranks "
        f"(layers per stage: {', '.join(str(len(s.layers)) for s in stages)}), "
        f"{report.schedule}, {microbatches} microbatches{tp_text(args)}; {args.precision}, "
        f"{optimizer_name(args.optimizer)}, ZeRO-{args.zero_stage} x {args.world_size}, profile "
        f"{args.device}. Budget {args.budget_gb:g} GB per rank's device; static per rank "
        f"{static} GB"
    )
    console.print(_pipeline_fit_table(report, args.budget_gb, digits))
    console.print(
        "per rank (0 / 1 / ...): device GB = static + the peak of a whole schedule step "
        "(every microbatch in flight, the receive buffers; the reserve comes on top); "
        "recompute %: of the rank's estimated step time. Bound by: the rank that does not fit "
        "one more. A step's batch is the microbatch times the microbatches."
    )
    console.print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


def _pipeline_fit_table(report: PipelineFitReport, budget_gb: float, digits: int) -> Table:
    table = Table(title=f"what fits in {budget_gb:g} GB on every rank", box=box.SIMPLE_HEAD)
    for col in ("plan", f"max seq (microbatch {report.microbatch})", "bound by",
                "device GB per rank", "recompute % per rank",
                f"max microbatch (seq {report.seq})", "step batch", "bound by "):  # fmt: skip
        table.add_column(col, justify="left" if col == "plan" else "right")

    def ranks(choices: tuple[Any, ...], what: str) -> str:
        if what == "gb":
            return " / ".join(
                f"{(b.static.total + ch.step_peak_bytes) / GB:.{digits}f}"
                for b, ch in zip(report.budgets, choices, strict=True)
            )
        return " / ".join(f"{ch.recompute_pct:.1f}" for ch in choices)

    for name, row in report.plans.items():
        cells = [name]
        if row.max_seq is None:
            cells += ["[red]none fits", "", "", ""]
        else:
            limit = " (limit)" if row.max_seq == report.seq_limit else ""
            cells += [
                f"{row.max_seq}{limit}",
                "-" if row.seq_bound_by is None else f"rank {row.seq_bound_by}",
                ranks(row.at_max_seq, "gb"),
                ranks(row.at_max_seq, "pct"),
            ]
        if row.max_microbatch is None:
            cells += ["[red]none fits", "", ""]
        else:
            cells += [
                str(row.max_microbatch),
                str(row.max_microbatch * report.microbatches),
                "-" if row.microbatch_bound_by is None else f"rank {row.microbatch_bound_by}",
            ]
        table.add_row(*cells)
    return table


def _fit_curves(report: FitReport) -> dict[str, list[tuple[int, int]]]:
    limit = report.seq_limit or 8 * (report.seq or 1)
    lengths = sorted({max(3, limit * k // 32) for k in range(1, 33)})
    out: dict[str, list[tuple[int, int]]] = {}
    for name in report.plans:
        pts = []
        for s in lengths:
            ch = report.choose(name, report.batch, s)
            if ch is not None:
                pts.append((s, report.budget.static.total + ch.step_peak_bytes))
        out[name] = pts
    return out


def _shallow(
    spec: str, args: argparse.Namespace, model: torch.nn.Module
) -> tuple[torch.nn.Module, int, int] | None:
    """A 3-layer copy of a deep Hugging Face stack to fit on (``remat.fit(shallow=)``)."""
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if (
        not isinstance(layers, int)
        or layers <= 3
        or not (spec in PRESETS or spec.startswith("hf:"))
    ):
        return None
    settings = {**parse_settings(args.set), "num_hidden_layers": 3}
    copy = build(spec, seq=args.seq, batch=args.batch, settings=settings).model
    if getattr(copy.config, "num_hidden_layers", None) != 3:
        return None
    return copy, 3, layers


def _copies(
    spec: str, args: argparse.Namespace, model: torch.nn.Module
) -> Callable[[int], torch.nn.Module] | None:
    """Copies of a Hugging Face stack with fewer layers (``remat.fit(copies=)``)."""
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(layers, int) or not (spec in PRESETS or spec.startswith("hf:")):
        return None

    def build_with(n: int) -> torch.nn.Module:
        settings = {**parse_settings(args.set), "num_hidden_layers": n}
        return build(spec, seq=args.seq, batch=args.batch, settings=settings).model

    return build_with


def _parallel_copies(
    copies: Callable[[int], torch.nn.Module], args: argparse.Namespace, executor: Executor
) -> Callable[[int], torch.nn.Module]:
    """``--tp-size``: each shallow copy parallelized as the model is (its own fake world)."""

    def parallel(n: int) -> torch.nn.Module:
        model = copies(n)
        parallelize(model, args, executor)
        return model

    return parallel


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``remat fit`` to the command line."""
    f = sub.add_parser(
        "fit",
        help="the longest sequence and the largest batch each plan fits in a budget",
        description="For no checkpointing, Megatron selective, every block, the least-peak "
        "plan and remat at recompute caps: the longest sequence at --batch and the largest "
        "batch at --seq that fit --budget-gb, from an exact formula of the peak in (b, s).",
    )
    f.add_argument("model", help="preset name, hf:MODEL_TYPE or pkg.module:factory")
    f.add_argument("--budget-gb", type=float, required=True, help="device memory (1 GB = 1e9 B)")
    model_options(f)
    f.add_argument("--max-seq", type=int, default=None,
                   help="longest length searched (default: the model's positions)")  # fmt: skip
    f.add_argument("--workers", type=int, default=None,
                   help="processes tracing the sac executor's steps at once (default: one per "
                   "core, up to 8, where the traces add up to 10 s or more; 1: this process)")  # fmt: skip
    tp_options(f)
    pp_options(f)
    f.add_argument(
        "--menus",
        action="store_true",
        help="with --pp-size: also each uniform option of the chain DP's per-block menu "
        "(finer remat <= N%% rows; each traced through the schedule at 7-11 shapes per rank)",
    )
    f.add_argument("--json", action="store_true", help="print the answers as JSON only")
    f.add_argument("--plot", default=None, metavar="OUT.png",
                   help="device memory against sequence length per plan, with the budget")  # fmt: skip
    f.set_defaults(func=fit_command, time_limit=10.0)
