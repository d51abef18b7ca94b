"""The ``remat`` command line: ``remat demo`` and ``remat plan``.

``remat plan MODEL --budget-gb N`` plans a preset (``remat plan --list``), any transformers
architecture (``hf:llama --set hidden_size=4096``) or a factory, under FakeTensorMode, and
prints the memory breakdown and the plan by module; ``--save`` writes the plan file.
``--executor sac`` plans :func:`remat.apply`'s executor (PyTorch's selective checkpointing on
the model's blocks, what FSDP2, DDP and compile run): its plan file is what
``remat.apply(model, inputs, plan="plan.json")`` takes on every rank, and ``--zero-stage 3
--world-size N`` then means FSDP2 over N ranks.

``remat demo`` plans the built-in GPT-style model with the fixed plans, the baselines and the
exact MILP (at the peak of every-block checkpointing), runs real CPU training steps for each
beside the unmodified model, and prints predicted vs measured peaks and whether outputs and
gradients are bitwise equal.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from remat.budget import (
    DEFAULT_RESERVE,
    GB,
    PRECISIONS,
    Options,
    StaticMemoryError,
    device_budget,
)
from remat.executors import EXECUTORS, GRAPH, SAC, Executor
from remat.fit import FitReport, fit
from remat.graph.profiles import PROFILE_NAMES
from remat.meter import Loss
from remat.models import TinyGPT
from remat.native.api import save_plan
from remat.native.parallel import tensor_parallel
from remat.native.pipeline_plan import plan_pipeline
from remat.native.split import CausalLMStage, causal_lm_stages, stage_example
from remat.native.state import applied
from remat.native.trace import FSDP_PARAM_DTYPES, TraceError
from remat.pipeline_fit import PipelineFitReport, fit_pipeline
from remat.plots import fit_plot, pareto_plot, timeline_plot
from remat.presets import PRESETS, Built, build, parse_settings
from remat.problem import Problem
from remat.request import Request, model_static_memory
from remat.rewrite.module import RematModule
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import FIXED_PLANS
from remat.solver.plan import Plan, Proof, floor_of, gap_text
from remat.solver.registry import HEURISTICS, SOLVERS, least_peak, solve
from remat.verify import verify


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _console(piped_width: int) -> Console:
    """The terminal's width; piped output (CI logs, files) gets ``piped_width`` so tables are
    never squeezed, unless ``COLUMNS`` says otherwise."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=piped_width)


def demo(args: argparse.Namespace) -> int:
    console = _console(120)
    torch.manual_seed(args.seed)
    model = TinyGPT(
        vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq
    )
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]remat demo[/]: TinyGPT, {args.layers} layers x {args.dim} wide, {args.heads} "
        f"heads, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, "
        f"{n_params / 1e6:.2f}M parameters, dropout 0.1, fp32 on CPU"
    )
    # One space between columns, no outer margin: 98 columns, whole in a 100-column terminal.
    table = Table(
        title="one training step per plan; memory in MiB",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        show_edge=False,
    )
    for col in (
        "plan",
        "predicted",
        "measured",
        "tensors",
        "eager",
        "saved",
        "recomputed",
        "GFLOP",
        "overhead",
        "vs eager",
        "time s",
    ):
        table.add_column(col, justify="left" if col == "plan" else "right", no_wrap=True)
    ok = True
    runs: list[tuple[str, dict[str, object]]] = [(n, {"plan": n}) for n in FIXED_PLANS]
    runs += [(n, {"solver": n}) for n in ("block", "megatron", "chen_greedy")]
    block_peak: int | None = None
    plans: dict[str, Plan] = {}
    problem: Problem | None = None
    for name, opts in runs + [("auto", {})]:
        if name == "auto":
            # The exact MILP at the every-block-checkpointed peak: same memory, less recompute.
            assert block_peak is not None
            opts = {"activation_budget_bytes": block_peak, "time_limit_s": args.time_limit}
            name = "auto @ block peak"
        with console.status(f"planning and running {name}..."):
            t0 = time.perf_counter()
            result = verify(model, (tokens,), steps=args.steps, **opts)  # type: ignore[arg-type]
            elapsed = time.perf_counter() - t0
        if name == "block":
            block_peak = result.plan.predicted_peak_bytes
        plan = result.plan
        plans[name] = plan
        assert isinstance(result.module, RematModule)
        problem = result.module._first.problem
        step = result.steps[-1]
        sim = plan.simulation
        exact = step.measured_peak_bytes == step.predicted_peak_bytes
        ok &= result.equal
        table.add_row(
            name,
            _mib(step.predicted_peak_bytes),
            ("[green]" if exact else "[yellow]") + _mib(step.measured_peak_bytes),
            _mib(step.measured_tensor_peak_bytes),
            _mib(step.eager_peak_bytes),
            _mib(plan.saved_bytes),
            str(len(plan.recomputed)),
            f"{plan.recompute_flops / 1e9:.3f}",
            f"{sim.recompute_time_s / sim.step_time_s:.1%}",
            "[green]equal" if result.equal else "[red]DIFFER",
            f"{elapsed:.1f}",
        )
    console.print(table)
    console.print(
        "predicted: remat's simulation of its executor, at the allocator (live tensors plus "
        "each kernel's measured scratch). measured: the CPU allocator's peak on this run "
        "(profiler). tensors: the live-storage meter on the same run (no kernel scratch). "
        "eager: the live-storage meter on the unmodified model. saved: bytes the forward "
        "leaves to the backward. recomputed: ops (and their GFLOP) the backward re-runs. "
        "overhead: recompute time / step time on the 'cpu' roofline profile. vs eager: "
        f"outputs, gradients, parameters and buffers bitwise equal over {args.steps} AdamW "
        "steps with dropout on. time: planning plus the run."
    )
    if args.out and problem is not None:
        _demo_sweep(console, args, plans, problem)
    return 0 if ok else 1


def _demo_sweep(
    console: Console, args: argparse.Namespace, plans: dict[str, Plan], problem: Problem
) -> None:
    """Every solver at budgets from the least peak to keep-all's; Pareto and timeline plots."""
    config = SolverConfig(time_limit_s=args.time_limit)
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    least = min(least_peak(problem, n, config) for n in HEURISTICS)
    budgets = [least + (keep_all - least) * k // (args.budgets - 1) for k in range(args.budgets)]
    points: dict[str, list[tuple[int, float]]] = {}
    found: dict[tuple[str, int], Plan] = {}
    for name in SOLVERS:
        for b in budgets:
            try:
                with console.status(f"sweep: {name} at {_mib(b)} MiB..."):
                    found[name, b] = solve(problem, solver=name, budget_bytes=b, config=config)
            except (BudgetError, ValueError, RuntimeError):
                continue
    # The best floor at a budget holds for every plan there: each plan's gap is to it.
    floors = {b: floor_of(p for (_, at), p in found.items() if at == b) for b in budgets}
    table = Table(title="recompute % of the step, by solver and budget (- : does not fit; "
                  "opt: proven least; +x%: above the best floor proven at that budget)",
                  box=box.SIMPLE_HEAD)  # fmt: skip
    table.add_column("solver")
    for b in budgets:
        table.add_column(f"{_mib(b)} MiB", justify="right")
    for name in SOLVERS:
        cells = []
        for b in budgets:
            plan = found.get((name, b))
            if plan is None:
                cells.append("-")
                continue
            sim = plan.simulation
            pct = 100 * sim.recompute_time_s / sim.step_time_s
            points.setdefault(name, []).append((plan.predicted_peak_bytes, pct))
            cells.append(f"{pct:.2f} {gap_text(plan, floors[b])}".rstrip())
        table.add_row(name, *cells)
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        pareto = pareto_plot(points, out / "pareto.png")
        timeline = timeline_plot(
            {k: v for k, v in plans.items() if k in ("keep_all", "auto @ block peak")},
            out / "timeline.png",
        )
    except ImportError as e:
        console.print(f"[yellow]no plots: {escape(str(e))}")
        return
    console.print(f"wrote {pareto} (overhead vs peak per solver) and {timeline} (memory timeline)")


def plan_command(args: argparse.Namespace) -> int:
    """``remat plan MODEL --budget-gb N ...``: plan a model under FakeTensorMode and report."""
    console = _console(120)
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
    if args.sequence_parallel and args.tp_size < 2:
        console.print("[red]remat plan: --sequence-parallel needs --tp-size 2 or more")
        return 2
    t0 = time.perf_counter()
    try:
        built = build(args.model, seq=args.seq, batch=args.batch, settings=parse_settings(args.set))
        executor = executor_of(args, built)
        if args.pp_size > 1:
            _no_factory_loss(built)
    except ValueError as e:
        console.print(f"[red]remat plan: {e}")
        return 2
    n = sum(p.numel() for p in built.model.parameters())
    if args.pp_size > 1:
        return _plan_pipeline(args, built, executor, console)
    tp = ""
    if args.tp_size > 1:
        try:
            _tensor_parallel(built.model, args, executor)
        except ValueError as e:
            console.print(f"[red]remat plan: {e}")
            return 2
        tp = _tp_text(args)
        if args.zero_stage == 3 and args.world_size > 1:
            tp += f": {args.world_size * args.tp_size} ranks on a 2-D mesh"
    console.print(
        f"[bold]{built.description}[/]: {n / 1e9:.2f}B parameters; {args.precision}, "
        f"{args.optimizer}, ZeRO-{args.zero_stage} x {args.world_size}{tp}, profile "
        f"{args.device}, budget {args.budget_gb} GB per device"
    )
    console.print(f"executor: {executor}")
    progress = console.status("planning...")
    with progress:
        try:
            req = _request(args, lambda msg: progress.update(f"planning: {msg}"))
            planned = executor.plan(
                built.model, built.args, example_kwargs=built.kwargs, request=req, **built.loss()
            )
        except (ValueError, TraceError) as e:
            console.print(f"[red]remat plan: {e}")
            return 1
    wall = time.perf_counter() - t0
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
    """``--pp-size``: the model cut into stages (:mod:`remat.native.split`), every stage
    planned at once (:func:`remat.plan_pipeline`), one device budget per rank; with
    ``--stages-per-rank V`` (Interleaved1F1B, LoopedBFS) ``pp_size x V`` stages."""
    t0 = time.perf_counter()
    per_rank = args.stages_per_rank
    try:
        stages, inputs, micro, microbatches = _pipeline_stages(args, built, executor)
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
        f"{args.precision}, {args.optimizer}, "
        f"profile {args.device}, budget {args.budget_gb} GB per rank's device"
    )
    console.print(f"executor: {executor}")
    progress = console.status("planning...")
    with progress:
        try:
            req = _request(args, lambda msg: progress.update(f"planning: {msg}"))
            planned = plan_pipeline(
                stages, inputs, **_pipeline_options(args, req, micro, microbatches)
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


def _pipeline_stages(
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
        _tensor_parallel_stages(stages, args, per_rank)
    return stages, inputs, micro, microbatches


def _pipeline_options(
    args: argparse.Namespace, req: Request, micro: torch.Tensor, microbatches: int
) -> dict[str, Any]:
    """What ``remat plan`` and ``remat fit`` with ``--pp-size`` tell the pipeline planner
    (:func:`remat.plan_pipeline`, :func:`remat.fit_pipeline`) besides the stages: the
    schedule, the next-token loss on ``micro``, and the request with the stages' layers as
    the blocks (one layer a stage too; a rank of several stages plans them as one list)."""
    return {
        "schedule": args.pp_schedule,
        "microbatches": microbatches,
        "loss_fn": _next_token_loss,
        "target": micro,
        "stages_per_rank": args.stages_per_rank,
        "request": dataclasses.replace(req, block_types=("layers.*", "*.layers.*")),
    }


def _tensor_parallel_stages(
    stages: list[CausalLMStage], args: argparse.Namespace, per_rank: int
) -> None:
    """``--pp-size`` with ``--tp-size``: each pipeline rank's stages parallelized together
    on a fake ``(pp, tp)`` mesh as that rank (:func:`remat.native.parallel.tensor_parallel`),
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


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss in ``remat plan --pp-size``: cross-entropy against the tokens."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _tensor_parallel(model: torch.nn.Module, args: argparse.Namespace, executor: Executor) -> None:
    """``--tp-size``: the model parallelized on a fake process group as torchtitan does Llama
    (:mod:`remat.native.parallel`); only ``remat.apply``'s executor runs tensor-parallel.
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


def _no_factory_loss(built: Built) -> None:
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


def _request(args: argparse.Namespace, progress: Callable[[str], None]) -> Request:
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
    )


def compare_command(args: argparse.Namespace) -> int:
    """``remat compare MODEL``: every solver at one device budget, or over a sweep of them."""
    console = _console(120)
    try:
        built = build(args.model, seq=args.seq, batch=args.batch, settings=parse_settings(args.set))
        options = Options(
            optimizer=args.optimizer,
            precision=args.precision,
            zero_stage=args.zero_stage,
            world_size=args.world_size,
        )
    except ValueError as e:
        console.print(f"[red]remat compare: {e}")
        return 2
    config = SolverConfig(time_limit_s=args.time_limit, floor_time_s=args.floor_time)
    static = model_static_memory(built.model, options)
    try:
        executor = executor_of(args, built)
    except ValueError as e:
        console.print(f"[red]remat compare: {e}")
        return 2
    console.print(f"executor: {executor}")
    with console.status("analysing..."):
        try:
            side = executor.compare(
                built.model,
                built.args,
                request=Request.of(
                    optimizer=args.optimizer, precision=args.precision,
                    zero_stage=args.zero_stage, world_size=args.world_size,
                    device_profile=args.device,
                ),
                example_kwargs=built.kwargs,
                loss=Loss.of(built.loss_fn, built.target),
            )  # fmt: skip
        except (ValueError, TraceError) as e:
            console.print(f"[red]remat compare: {escape(str(e))}")
            return 1
    if args.sweep:
        least, keep_all = side.peak_range(config)
        # Device totals whose step budgets run from the least peak to keep_all's.
        budgets = [
            math.ceil((least + (keep_all - least) * k // max(1, args.sweep - 1) + static.total)
                      / (1 - args.reserve)) + 1
            for k in range(args.sweep)
        ]  # fmt: skip
    else:
        budgets = [int(args.budget_gb * GB)]
    rows: list[dict[str, object]] = []
    for total in budgets:
        try:
            d = device_budget(total, static, options, args.reserve)
        except StaticMemoryError as e:
            console.print(f"[red]remat compare: {e}")
            return 1
        for name in side.solvers:
            t0 = time.perf_counter()
            try:
                with console.status(f"{_gb_text(total)}: {name}..."):
                    peak, recompute_pct, bound_pct, proof = side.solve(
                        name, d.step_budget_bytes, config
                    )
            except (BudgetError, ValueError, RuntimeError) as e:
                rows.append({"budget_bytes": total, "solver": name, "error": str(e)[:200]})
                continue
            rows.append(
                {
                    "budget_bytes": total,
                    "solver": name,
                    "step_peak_bytes": peak,
                    "total_bytes": d.total_for(peak),
                    "recompute_pct": recompute_pct,
                    "bound_pct": bound_pct,
                    "proof": proof.value,
                    "solve_s": time.perf_counter() - t0,
                    "error": "",
                }
            )
    console.print(
        _compare_table(rows, f"{built.description}: every solver (profile {args.device})")
    )
    if args.csv:
        fields = ["budget_bytes", "solver", "step_peak_bytes", "total_bytes", "recompute_pct",
                  "bound_pct", "proof", "solve_s", "error"]  # fmt: skip
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
        console.print(f"wrote {args.csv}")
    if args.plot:
        points: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if not r["error"]:
                points.setdefault(str(r["solver"]), []).append(
                    (int(r["step_peak_bytes"]), float(r["recompute_pct"]))  # type: ignore[call-overload, arg-type]
                )
        console.print(f"wrote {pareto_plot(points, args.plot)} (overhead vs step peak per solver)")
    return 0


def _compare_table(rows: list[dict[str, object]], title: str) -> Table:
    """``remat compare``'s rows, each plan's proof read from its data: ``opt`` (proven least,
    or at the best floor any plan proved at that budget), ``+x%`` above that floor, or what
    kind of plan it is."""
    floors: dict[object, float] = {}
    for r in rows:
        if r["error"]:
            continue
        found = [r["bound_pct"], r["recompute_pct"] if r["proof"] == Proof.OPTIMAL.value else None]
        for f in found:
            if isinstance(f, float):
                floors[r["budget_bytes"]] = max(f, floors.get(r["budget_bytes"], 0.0))
    table = Table(title=title)
    for col in ("budget", "solver", "step peak", "total", "recompute %", "floor %", "proof",
                "solve s"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("solver", "proof") else "right")
    for r in rows:
        budget_text = _gb_text(float(r["budget_bytes"]))  # type: ignore[arg-type]
        if r["error"]:
            table.add_row(budget_text, str(r["solver"]), "[dim]does not fit", "", "", "", "", "")
            continue
        bound, pct = r["bound_pct"], float(r["recompute_pct"])  # type: ignore[arg-type]
        floor = floors.get(r["budget_bytes"])
        if r["proof"] == Proof.OPTIMAL.value or (floor is not None and pct <= floor * (1 + 1e-9)):
            proof = "optimal"
        elif floor:
            proof = f"within {pct / floor - 1:.1%} of the floor"
        else:
            proof = f"{Proof(r['proof']).value.replace('_', ' ')}, no floor"
        table.add_row(
            budget_text,
            str(r["solver"]),
            _gb_text(float(r["step_peak_bytes"])),  # type: ignore[arg-type]
            _gb_text(float(r["total_bytes"])),  # type: ignore[arg-type]
            f"{pct:.2f}",
            "-" if bound is None else f"{bound:.2f}",
            proof,
            f"{r['solve_s']:.1f}",
        )
    return table


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
        _tensor_parallel(model, args, executor)
        return model

    return parallel


def fit_command(args: argparse.Namespace) -> int:
    """``remat fit MODEL --budget-gb N``: the longest sequence and largest batch per plan."""
    console = _console(140)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        built = build(args.model, seq=args.seq, batch=args.batch, settings=parse_settings(args.set))
        executor = executor_of(args, built)
        if args.pp_size > 1:
            _no_factory_loss(built)
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
            _tensor_parallel(built.model, args, executor)
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
                request=_request(args, lambda msg: status.update(msg)),
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
    d = report.budget
    console.print(
        f"[bold]{built.description}[/]; {args.precision}, {args.optimizer}, ZeRO-{args.zero_stage}"
        f" x {args.world_size}{_tp_text(args)}, profile {args.device}, executor {executor.name}. "
        f"Budget {_gb_text(d.budget_bytes)}: static "
        f"{_gb_text(d.static.total)}, reserve {_gb_text(d.reserve_bytes)}, step "
        f"{_gb_text(d.step_budget_bytes)}"
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
    return 0


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
    stages, inputs, micro, microbatches = _pipeline_stages(args, built, executor)
    err.print(f"executor: {executor}")
    status = err.status("tracing the stages...")
    with status:
        req = _request(args, lambda msg: status.update(msg))
        try:
            report = fit_pipeline(
                stages,
                inputs,
                menus=args.menus,
                **_pipeline_options(args, req, micro, microbatches),
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
        f"{report.schedule}, {microbatches} microbatches{_tp_text(args)}; {args.precision}, "
        f"{args.optimizer}, ZeRO-{args.zero_stage} x {args.world_size}, profile "
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


def _gb_text(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _executor_name(name: str) -> str:
    if name not in ("auto", *EXECUTORS):
        raise argparse.ArgumentTypeError(
            f"unknown executor {name!r}; valid: auto, {', '.join(EXECUTORS)}"
        )
    return name


def _tp_text(args: argparse.Namespace) -> str:
    if args.tp_size < 2:
        return ""
    sp = " with sequence parallelism" if args.sequence_parallel else ""
    return f", tensor parallel x {args.tp_size}{sp} (rank 0's shard)"


def _tp_options(p: argparse.ArgumentParser) -> None:
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


def _pp_options(p: argparse.ArgumentParser) -> None:
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


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="bf16-fsdp: FSDP2's MixedPrecisionPolicy (--executor sac, ZeRO-3)")  # fmt: skip
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "none"])
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
        type=_executor_name,
        default="auto",
        help="graph (remat.optimize), sac (remat.apply: FSDP2, DDP, compile) or auto (the "
        "default: sac with --world-size above 1, graph on one device)",
    )


def _floor_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--floor-time",
        type=float,
        default=0.0,
        help="seconds more for a tighter proven floor under a whole-graph chain plan (the "
        "blocks' fronts, plan.lower_bound_s)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan and run the built-in GPT-style model")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--dim", type=int, default=128)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--vocab", type=int, default=512)
    d.add_argument("--seq", type=int, default=128)
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--steps", type=int, default=2, help="optimizer steps per plan")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--time-limit",
        type=float,
        default=30.0,
        help="counted seconds of work for the exact MILP (auto row)",
    )
    d.add_argument("--budgets", type=int, default=4, help="budgets of the solver sweep")
    d.add_argument(
        "--out", default="remat-demo", help="folder for pareto.png and timeline.png ('' : none)"
    )
    d.set_defaults(func=demo)
    p = sub.add_parser(
        "plan",
        help="plan a preset, hf:MODEL_TYPE or pkg.module:factory under a device budget",
        description="Plan under FakeTensorMode (no memory needed for 70B shapes) and print "
        "the memory breakdown and the plan by module.",
    )
    p.add_argument("model", nargs="?", help="preset name, hf:MODEL_TYPE or pkg.module:factory")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.add_argument("--budget-gb", type=float, default=80.0, help="device memory (1 GB = 1e9 B)")
    _model_options(p)
    _floor_option(p)
    p.add_argument("--solver", default=None, help="default: auto")
    p.add_argument("--save", default=None, metavar="PLAN.json", help="write the plan file")
    _tp_options(p)
    _pp_options(p)
    p.set_defaults(func=plan_command)
    c = sub.add_parser(
        "compare",
        help="every solver side by side at one device budget or over a sweep",
        description="Plan MODEL (as remat plan) with every solver; print and optionally "
        "write a CSV.",
    )
    c.add_argument("model", help="preset name, hf:MODEL_TYPE or pkg.module:factory")
    c.add_argument("--budget-gb", type=float, default=80.0, help="device memory (1 GB = 1e9 B)")
    c.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="instead: N budgets from the least feasible to keep-all's")  # fmt: skip
    _model_options(c)
    _floor_option(c)
    c.add_argument("--csv", default=None, metavar="OUT.csv")
    c.add_argument("--plot", default=None, metavar="OUT.png",
                   help="Pareto plot: recompute %% vs step peak, one curve per solver")  # fmt: skip
    c.set_defaults(func=compare_command)
    f = sub.add_parser(
        "fit",
        help="the longest sequence and the largest batch each plan fits in a budget",
        description="For no checkpointing, Megatron selective, every block, the least-peak "
        "plan and remat at recompute caps: the longest sequence at --batch and the largest "
        "batch at --seq that fit --budget-gb, from an exact formula of the peak in (b, s).",
    )
    f.add_argument("model", help="preset name, hf:MODEL_TYPE or pkg.module:factory")
    f.add_argument("--budget-gb", type=float, required=True, help="device memory (1 GB = 1e9 B)")
    _model_options(f)
    f.add_argument("--max-seq", type=int, default=None,
                   help="longest length searched (default: the model's positions)")  # fmt: skip
    f.add_argument("--workers", type=int, default=None,
                   help="processes tracing the sac executor's steps at once (default: one per "
                   "core, up to 8, where the traces add up to 10 s or more; 1: this process)")  # fmt: skip
    _tp_options(f)
    _pp_options(f)
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
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
