"""Benchmark (not a test): remat's exact MILP against Checkmate's MILP bound on small graphs.

    python experiments/checkmate_gap.py [--budgets 4] [--time-limit 120]

Checkmate (Jain et al. 2020) may recompute a value several times and in any stage; remat's
executor recomputes each value at most once, just before its first use. Over the same graph and
memory accounting Checkmate's optimum is therefore a lower bound on remat's (see
remat/solver/checkmate.py); the gap is what remat's executor gives up for its simplicity.
Checkmate's MILP is O(n^2) binaries, so only small graphs: a 2-layer GPT with dropout, a 1-layer
Hugging Face GPT-2, a CNN with BatchNorm. Planned with the ``a100`` profile. Writes
experiments/results/checkmate_gap.csv.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import remat
from remat.models import TinyGPT
from remat.solver.checkmate import checkmate_bound
from remat.solver.compress import compress
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.plan import Proof
from remat.solver.registry import HEURISTICS, least_peak, solve

RESULTS = Path(__file__).parent / "results"


def _gpt2_1layer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    return GPT2LMHeadModel(cfg), (torch.randint(0, 128, (2, 32)),)


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    layers: list[nn.Module] = []
    ch = 3
    for out in (16, 32, 32):
        layers += [nn.Conv2d(ch, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        ch = out
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, 10))
    return model, (torch.randn(4, 3, 32, 32),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "tiny_gpt_2x64": lambda: (
        TinyGPT(vocab=128, dim=64, heads=4, layers=2, seq=32),
        (torch.randint(0, 128, (2, 32)),),
    ),
    "hf_gpt2_1x64": _gpt2_1layer,
    "cnn_bn_3": _cnn,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", type=int, default=4)
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args()
    console = Console(width=150)
    config = SolverConfig(time_limit_s=args.time_limit)
    rows = []
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model, inputs = build()
        problem = remat.analyze(model, inputs, device_profile="a100").problem
        nodes = len(compress(problem).problem.values)
        keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
        least = min(least_peak(problem, n, config) for n in HEURISTICS)  # a peak some plan reaches
        budgets = [
            least + (keep_all - least) * k // max(1, args.budgets - 1) for k in range(args.budgets)
        ]
        for budget in budgets:
            t0 = time.perf_counter()
            try:
                plan = solve(problem, solver="exact", budget_bytes=budget, config=config)
            except BudgetError as e:
                console.print(f"{name} budget {budget:,}: {e}")
                continue
            exact_s = time.perf_counter() - t0
            cm = checkmate_bound(problem, budget_bytes=budget, config=config)
            cost = plan.recompute_time_s
            bound = cm.lower_bound_s
            rows.append(
                {
                    "model": name,
                    "nodes": nodes,
                    "budget_bytes": budget,
                    "exact_cost_s": cost,
                    "exact_optimal": plan.proof is Proof.OPTIMAL,
                    "exact_solve_s": exact_s,
                    "checkmate_bound_s": bound,
                    "checkmate_optimal": cm.optimal,
                    "checkmate_binaries": cm.binaries,
                    "checkmate_solve_s": cm.solve_s,
                    "gap_pct": (
                        100 * (cost - bound) / cost if bound is not None and cost > 0 else 0.0
                    ),
                }
            )
            console.print(f"{name} budget {budget:,}: done")
    table = Table(title="exact MILP (remat's executor) vs Checkmate's MILP bound (a100 profile)")
    for col in (
        "model",
        "nodes",
        "budget MiB",
        "exact us",
        "proven",
        "Checkmate us",
        "proven",
        "gap %",
        "exact s",
        "Checkmate s",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(
            str(r["model"]),
            str(r["nodes"]),
            f"{r['budget_bytes'] / 2**20:.2f}",
            f"{r['exact_cost_s'] * 1e6:.2f}",
            "yes" if r["exact_optimal"] else "no",
            "-" if r["checkmate_bound_s"] is None else f"{r['checkmate_bound_s'] * 1e6:.2f}",
            "yes" if r["checkmate_optimal"] else "no",
            f"{r['gap_pct']:.1f}",
            f"{r['exact_solve_s']:.1f}",
            f"{r['checkmate_solve_s']:.1f}",
        )
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "checkmate_gap.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
