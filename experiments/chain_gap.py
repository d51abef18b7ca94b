"""Benchmark (not a test): the chain solver (per-block menus + DP) against the flat exact MILP.

    python experiments/chain_gap.py [--layers 4] [--budgets 5] [--time-limit 60]
    python experiments/chain_gap.py --model gpt2_small [--time-limit 120]

On models small enough for the flat MILP (a small Llama, 4x128, seq 128, batch 2, built with
random weights; GPT-2 small, 12x768, seq 1024, batch 8, under FakeTensorMode), plans both at
budgets spread from the least peak the chain reaches to keep-all's, with the ``a100`` profile.
The flat MILP is time-limited: where it does not prove optimality its plan is only an upper
bound on the optimum (its dual bound is printed beside it). Writes
experiments/results/chain_gap_<layers>layers.csv (Llama) or chain_gap_gpt2_small.csv.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import remat
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.plan import Proof
from remat.solver.registry import least_peak, solve

RESULTS = Path(__file__).parent / "results"


def _llama(layers: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(cfg), (torch.randint(0, 256, (2, 128)),)


def _gpt2_small() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    with remat.fake_mode():
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024))
        return model, (torch.randint(0, 50257, (8, 1024)),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("llama", "gpt2_small"), default="llama")
    parser.add_argument("--layers", type=int, default=4, help="Llama's layers")
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, inputs = _gpt2_small() if args.model == "gpt2_small" else _llama(args.layers)
    label = "gpt2_12x768" if args.model == "gpt2_small" else f"llama_{args.layers}x128"
    problem = remat.analyze(model, inputs, device_profile="a100").problem
    config = SolverConfig(time_limit_s=args.time_limit)
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    lo = least_peak(problem, "chain", config)
    rows = []
    for k in range(args.budgets):
        budget = lo + (keep_all - lo) * k // max(1, args.budgets - 1)
        row: dict[str, object] = {"model": label, "budget_bytes": budget}
        for name in ("chain", "exact", "megatron", "chen_greedy"):
            t0 = time.perf_counter()
            try:
                plan = solve(problem, solver=name, budget_bytes=budget, config=config)
            except BudgetError:
                row[f"{name}_us"] = None
                continue
            row[f"{name}_us"] = plan.recompute_time_s * 1e6
            row[f"{name}_s"] = time.perf_counter() - t0
            if name == "exact":
                bound = plan.lower_bound_s
                row["exact_bound_us"] = None if bound is None else bound * 1e6
                row["exact_proven"] = plan.proof is Proof.OPTIMAL
        c, e = row.get("chain_us"), row.get("exact_us")
        row["gap_pct"] = (
            100 * (c - e) / e if isinstance(c, float) and isinstance(e, float) and e else None
        )
        rows.append(row)
    table = Table(title="chain DP vs flat exact MILP (recompute us)")
    cols = ["budget_bytes", "chain_us", "exact_us", "exact_bound_us", "exact_proven", "gap_pct",
            "megatron_us", "chen_greedy_us", "chain_s", "exact_s"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(
            *(f"{r.get(c):.2f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols)
        )
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    stem = "gpt2_small" if args.model == "gpt2_small" else f"{args.layers}layers"
    out = RESULTS / f"chain_gap_{stem}.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["model", *cols])
        w.writeheader()
        w.writerows({k: r.get(k) for k in ["model", *cols]} for r in rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
