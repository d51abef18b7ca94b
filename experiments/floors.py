"""Benchmark (not a test): the floor under the chain solver's plans on GPT-2 small, the
backward's moments alone against the blocks' fronts: how far from the optimum a 12-layer
plan can at most be, where the flat MILP proves nothing.

    python experiments/floors.py [--floor-time 60] [--time-limit 60]

GPT-2 small (12x768, seq 1024, batch 8, fp32, ``a100`` profile, under FakeTensorMode) at the
budgets of ``experiments/chain_gap.py --model gpt2_small``. Per budget: the chain
plan's recompute time, the moments bound (:func:`remat.solver.bound.backward_bound`, 10 s, what
a plan records by default), and the plan's floor with ``floor_time_s`` seconds for the
blocks' fronts (:mod:`remat.solver.block_bound`); the ratio plan / floor is the most the plan
can be above the optimum. Writes experiments/results/floors_gpt2_small.csv.
"""

from __future__ import annotations

import argparse
import time

import torch
from rows import save, show  # a sibling module (experiments/ is on sys.path)

import remat
from remat.solver.bound import backward_bound
from remat.solver.config import SolverConfig
from remat.solver.registry import least_peak, solve

BUDGETS = 5
"""As chain_gap.py: from the chain's least peak to keep-all's; all but keep-all's are kept
(where the plan recomputes nothing)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--floor-time", type=float, default=60.0)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    with remat.fake_mode():
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024))
        inputs = (torch.randint(0, 50257, (8, 1024)),)
    problem = remat.analyze(model, inputs, device_profile="a100").problem
    plain = SolverConfig(time_limit_s=args.time_limit)
    keep_all = solve(problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    lo = least_peak(problem, "chain", plain)
    rows = []
    for k in range(BUDGETS - 1):
        budget = lo + (keep_all - lo) * k // (BUDGETS - 1)
        t0 = time.perf_counter()
        config = SolverConfig(time_limit_s=args.time_limit, floor_time_s=args.floor_time)
        plan = solve(problem, solver="chain", budget_bytes=budget, config=config)
        wall = time.perf_counter() - t0
        moments = backward_bound(problem, budget, SolverConfig(time_limit_s=10.0))
        floor = plan.lower_bound_s
        rows.append(
            {
                "budget_bytes": budget,
                "plan_ms": 1e3 * plan.recompute_time_s,
                "moments_ms": None if moments is None else 1e3 * moments,
                "floor_ms": None if floor is None else 1e3 * floor,
                "floor": "blocks' fronts" if "blocks' fronts" in plan.reason else "moments",
                "ratio": plan.recompute_time_s / floor if floor else None,
                "moments_ratio": plan.recompute_time_s / moments if moments else None,
                "solve_s": wall,
            }
        )
        print(rows[-1], flush=True)
    shown = [{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    show(shown, "GPT-2 small: chain plans and their floors (recompute ms)")
    print(f"wrote {save(rows, 'floors_gpt2_small.csv')}")


if __name__ == "__main__":
    main()
