"""``remat demo``: the built-in GPT-style model planned every way and run beside eager.

It plans the model with the fixed plans, the baselines and the exact MILP (at the peak of
every-block checkpointing), runs real CPU training steps for each beside the unmodified
model, and prints predicted against measured peaks and whether outputs and gradients are
bitwise equal; then it sweeps the solvers over budgets and draws the Pareto front.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from remat.cli.common import (
    make_console,
    mib,
)
from remat.executors.graph.module import RematModule
from remat.models import TinyGPT
from remat.plan.plots import pareto_plot, timeline_plot
from remat.problem import Problem
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import FIXED_PLANS
from remat.solver.plan import Plan, floor_of, gap_text
from remat.solver.registry import HEURISTICS, SOLVERS, least_peak, solve
from remat.verify import verify


def demo(args: argparse.Namespace) -> int:
    console = make_console(120)
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
    table = _demo_table()
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
            mib(step.predicted_peak_bytes),
            ("[green]" if exact else "[yellow]") + mib(step.measured_peak_bytes),
            mib(step.measured_tensor_peak_bytes),
            mib(step.eager_peak_bytes),
            mib(plan.saved_bytes),
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


def _demo_table() -> Table:
    """The demo's table, one row per plan."""
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
    return table


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
                with console.status(f"sweep: {name} at {mib(b)} MiB..."):
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
        table.add_column(f"{mib(b)} MiB", justify="right")
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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``remat demo`` to the command line."""
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
