"""Benchmark (not a test): planning 7B and 70B Llama shapes on this machine, and the chain
solver against Megatron's selective recompute at the same peak.

    python experiments/scale.py [--only llama-7b@24]

Each configuration runs in a fresh child process (so max RSS is its own), through the same
path as ``remat plan``: FakeTensorMode, bf16-mixed, AdamW, ZeRO-3, the ``h100`` profile, seq
4096, batch 1. Prints wall time per stage (capture, joint, annotate, solve, rewrite), max RSS,
the plan's predicted step peak and recompute overhead; then, from the same graph, Megatron's
selective recompute (its peak and overhead) and the chain solver's overhead at exactly
Megatron's peak. The floor under each plan gets ``--floor-time`` seconds more (the blocks'
exact fronts, :mod:`remat.solver.block_bound`); ``moments_bound_ms`` is the backward's
moments bound alone in 10 s, what a plan records without that time. Writes
experiments/results/scale.csv.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"
CONFIGS = {
    "llama-7b@24": ("llama-7b", 24.0, 8),
    "llama-7b@40": ("llama-7b", 40.0, 8),
    "llama-70b@80": ("llama-70b", 80.0, 64),
}


def _run(name: str, floor_time_s: float) -> dict[str, object]:
    import remat
    from remat.presets import build
    from remat.solver.bound import backward_bound
    from remat.solver.config import SolverConfig
    from remat.solver.registry import solve

    preset, budget_gb, world = CONFIGS[name]
    t0 = time.perf_counter()
    built = build(preset, seq=4096, batch=1, settings={})
    t_build = time.perf_counter() - t0
    fast = remat.optimize(built.model, built.args, example_kwargs=built.kwargs,
                          budget_gb=budget_gb, precision="bf16-mixed", zero_stage=3,
                          world_size=world, device_profile="h100",
                          floor_time_s=floor_time_s)  # fmt: skip
    wall = time.perf_counter() - t0
    plan, problem = fast.plan, fast._first.problem
    sim = plan.simulation
    row: dict[str, object] = {
        "config": name,
        "solver": plan.solver,
        "build_s": t_build,
        **{f"{k}_s": v for k, v in fast._first.timings.items()},
        "wall_s": wall,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_peak_gb": plan.predicted_peak_bytes / 1e9,
        "total_gb": (plan.device_memory or {}).get("total", 0) / 1e9,
        "recompute_pct": 100 * sim.recompute_time_s / sim.step_time_s,
        # The proven floor on recompute (remat.solver.bound): the plan is within
        # recompute_pct - bound_pct of the optimum, in % of the step.
        "bound_pct": None
        if plan.lower_bound_s is None
        else 100 * plan.lower_bound_s / sim.step_time_s,
        "recompute_ms": 1e3 * sim.recompute_time_s,
        "bound_ms": None if plan.lower_bound_s is None else 1e3 * plan.lower_bound_s,
    }
    # The backward's moments alone, as the chain solver computes it without floor_time_s.
    budget = fast._planner.step_budget
    moments = backward_bound(problem, budget, SolverConfig(time_limit_s=10.0))
    row["moments_bound_ms"] = None if moments is None else 1e3 * moments
    row["ratio"] = plan.lower_bound_s and sim.recompute_time_s / plan.lower_bound_s
    megatron = solve(problem, solver="megatron", budget_bytes=None)
    m_sim = megatron.simulation
    row["megatron_peak_gb"] = megatron.predicted_peak_bytes / 1e9
    row["megatron_pct"] = 100 * m_sim.recompute_time_s / m_sim.step_time_s
    try:
        chain = solve(problem, solver="chain", budget_bytes=megatron.predicted_peak_bytes)
        row["chain_at_megatron_peak_pct"] = (
            100 * chain.simulation.recompute_time_s / chain.simulation.step_time_s
        )
    except remat.BudgetError:
        row["chain_at_megatron_peak_pct"] = None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=list(CONFIGS), action="append")
    parser.add_argument(
        "--floor-time", type=float, default=90.0, help="seconds for the blocks' fronts floor"
    )
    args = parser.parse_args()
    rows = []
    ctx = mp.get_context("spawn")
    for name in args.only or CONFIGS:
        with ctx.Pool(1) as pool:
            rows.append(pool.apply(_run, (name, args.floor_time)))
        print(rows[-1], flush=True)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    table = Table(title="planning Llama shapes (bf16-mixed, ZeRO-3, h100 profile, seq 4096)")
    for c in cols:
        table.add_column(c, justify="left" if c in ("config", "solver") else "right")
    for r in rows:
        table.add_row(
            *(f"{r.get(c):.2f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols)
        )
    Console(width=250).print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "scale.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
