"""Benchmark (not a test): the exact MILP with HiGHS vs CBC, same graphs, same budgets, one run.

    python experiments/backends.py [--time-limit 120]

For each graph (the small models of checkmate_gap.py and a 2-layer GPT-2 768 wide, seq 1024,
batch 8 under FakeTensorMode; ``a100`` profile) and budgets at 0%, 50% and 90% of the way from
the least heuristic peak to keep_all's: solve time, recompute time found and whether optimality
was proven, per backend, alternating backends. Writes experiments/results/backends.csv.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
from checkmate_gap import MODELS  # a sibling script (experiments/ is on sys.path)
from rich.console import Console
from rich.table import Table

import remat
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.plan import Proof
from remat.solver.registry import HEURISTICS, least_peak, solve

RESULTS = Path(__file__).parent / "results"


def _gpt2_2layer() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    with remat.fake_mode():
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=768, n_head=12))
        return model, (torch.randint(0, 50257, (8, 1024)),)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args()
    console = Console(width=150)
    rows = []
    for name, build in {**MODELS, "gpt2_2x768_s1024_b8": _gpt2_2layer}.items():
        torch.manual_seed(0)
        model, inputs = build()
        problem = remat.analyze(model, inputs, device_profile="a100").problem
        base = SolverConfig(time_limit_s=args.time_limit)
        keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
        least = min(least_peak(problem, n, base) for n in HEURISTICS)
        for frac in (0.0, 0.5, 0.9):
            budget = least + int((keep_all - least) * frac)
            for backend in ("highs", "cbc"):
                config = SolverConfig(time_limit_s=args.time_limit, backend=backend)
                t0 = time.perf_counter()
                try:
                    plan = solve(problem, solver="exact", budget_bytes=budget, config=config)
                except BudgetError as e:
                    console.print(f"{name} {frac:.0%} {backend}: {e}")
                    continue
                rows.append(
                    {
                        "model": name,
                        "budget_frac": frac,
                        "budget_bytes": budget,
                        "backend": backend,
                        "solve_s": time.perf_counter() - t0,
                        "recompute_s": plan.recompute_time_s,
                        "proven_optimal": plan.proof is Proof.OPTIMAL,
                    }
                )
                console.print(f"{name} {frac:.0%} {backend}: {rows[-1]['solve_s']:.1f} s")
    table = Table(title="exact MILP: HiGHS vs CBC (same process, alternating)")
    for col in ("model", "budget", "backend", "solve s", "recompute us", "proven"):
        table.add_column(col, justify="left" if col in ("model", "backend") else "right")
    for r in rows:
        table.add_row(
            str(r["model"]),
            f"{r['budget_frac']:.0%}",
            str(r["backend"]),
            f"{r['solve_s']:.1f}",
            f"{r['recompute_s'] * 1e6:.2f}",
            "yes" if r["proven_optimal"] else "no",
        )
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "backends.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
