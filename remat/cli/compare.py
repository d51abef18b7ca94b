"""``remat compare``: every solver side by side at one device budget or over a sweep,
as a table, a CSV and a Pareto plot."""

from __future__ import annotations

import argparse
import csv
import math
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from remat.budget import (
    GB,
    Options,
    StaticMemory,
    StaticMemoryError,
    device_budget,
)
from remat.cli.common import (
    executor_of,
    floor_option,
    gb_text,
    make_console,
    model_options,
)
from remat.executors.base import Comparison
from remat.executors.sac.events import TraceError
from remat.measure.meter import Loss
from remat.plan.plots import pareto_plot
from remat.presets import build, parse_settings
from remat.request import Request, model_static_memory
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.plan import Proof


def compare_command(args: argparse.Namespace) -> int:
    """``remat compare MODEL``: every solver at one device budget, or over a sweep of them."""
    console = make_console(120)
    try:
        built = build(args.model, seq=args.seq, batch=args.batch, settings=parse_settings(args.set))
        options = Options(
            optimizer=args.optimizer,
            precision=args.precision,
            zero_stage=args.zero_stage,
            world_size=args.world_size,
        )
        executor = executor_of(args, built)
    except ValueError as e:
        console.print(f"[red]remat compare: {e}")
        return 2
    config = SolverConfig(time_limit_s=args.time_limit, floor_time_s=args.floor_time)
    static = model_static_memory(built.model, options)
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
    try:
        rows = _rows(side, _budgets(args, side, config, static), static, options, args, config,
                     console)  # fmt: skip
    except StaticMemoryError as e:
        console.print(f"[red]remat compare: {e}")
        return 1
    console.print(
        _compare_table(rows, f"{built.description}: every solver (profile {args.device})")
    )
    _write(rows, args, console)
    return 0


def _budgets(
    args: argparse.Namespace, side: Comparison, config: SolverConfig, static: StaticMemory
) -> list[int]:
    """The device budgets compared: ``--budget-gb``, or ``--sweep`` totals whose step budgets
    run from the least peak to keep_all's."""
    if not args.sweep:
        return [int(args.budget_gb * GB)]
    least, keep_all = side.peak_range(config)
    return [
        math.ceil((least + (keep_all - least) * k // max(1, args.sweep - 1) + static.total)
                  / (1 - args.reserve)) + 1
        for k in range(args.sweep)
    ]  # fmt: skip


def _rows(
    side: Comparison,
    budgets: list[int],
    static: StaticMemory,
    options: Options,
    args: argparse.Namespace,
    config: SolverConfig,
    console: Console,
) -> list[dict[str, object]]:
    """One row per budget and solver: its plan's figures, or the error that stopped it
    (:class:`StaticMemoryError` where a budget does not hold the static memory)."""
    rows: list[dict[str, object]] = []
    for total in budgets:
        d = device_budget(total, static, options, args.reserve)
        for name in side.solvers:
            t0 = time.perf_counter()
            try:
                with console.status(f"{gb_text(total)}: {name}..."):
                    solved = side.solve(name, d.step_budget_bytes, config)
            except (BudgetError, ValueError, RuntimeError) as e:
                rows.append({"budget_bytes": total, "solver": name, "error": str(e)[:200]})
                continue
            rows.append(
                {
                    "budget_bytes": total,
                    "solver": name,
                    "step_peak_bytes": solved.step_peak_bytes,
                    "total_bytes": d.total_for(solved.step_peak_bytes),
                    "recompute_pct": solved.recompute_pct,
                    "added_pct": solved.added_pct,
                    "bound_pct": solved.bound_pct,
                    "proof": solved.proof.value,
                    "solve_s": time.perf_counter() - t0,
                    "error": "",
                }
            )
    return rows


def _write(rows: list[dict[str, object]], args: argparse.Namespace, console: Console) -> None:
    """``--csv``: the rows; ``--plot``: each solver's overhead against its step peak."""
    if args.csv:
        fields = ["budget_bytes", "solver", "step_peak_bytes", "total_bytes", "recompute_pct",
                  "added_pct", "bound_pct", "proof", "solve_s", "error"]  # fmt: skip
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
    for col in ("budget", "solver", "step peak", "total", "recompute %", "added %", "floor %",
                "proof", "solve s"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("solver", "proof") else "right")
    for r in rows:
        budget_text = gb_text(float(r["budget_bytes"]))  # type: ignore[arg-type]
        if r["error"]:
            table.add_row(budget_text, str(r["solver"]), "[dim]does not fit", *[""] * 6)
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
            gb_text(float(r["step_peak_bytes"])),  # type: ignore[arg-type]
            gb_text(float(r["total_bytes"])),  # type: ignore[arg-type]
            f"{pct:.2f}",
            f"{float(r['added_pct']):.2f}",  # type: ignore[arg-type]
            "-" if bound is None else f"{bound:.2f}",
            proof,
            f"{r['solve_s']:.1f}",
        )
    return table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``remat compare`` to the command line."""
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
    model_options(c)
    floor_option(c)
    c.add_argument("--csv", default=None, metavar="OUT.csv")
    c.add_argument("--plot", default=None, metavar="OUT.png",
                   help="Pareto plot: recompute %% vs step peak, one curve per solver")  # fmt: skip
    c.set_defaults(func=compare_command)
