"""``remat.apply``'s second opinion below shallow copies: the per-block family bisected (what
``auto`` runs on a stack of fewer than 12 regions) against the chain DP tracing every
option on the model, at six budgets between the least peak and no checkpointing, on the
zoo's ``remat.apply`` models, under the ``cpu`` and ``h100`` profiles: each plan's added
time (the profile's estimate of recompute and SAC's dispatch, not a wall-clock
measurement) and the planning seconds of each (wall clock, one process, one thread: the
ratio is what to read).

The chain DP run replaces ``planner.per_block`` with the chain DP, the MILP's plan to beat,
as ``auto`` ran it before. Writes ``experiments/results/second_opinion.csv``.

    .venv/bin/python experiments/second_opinion.py
"""

from __future__ import annotations

import copy
import csv
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from remat.executors.sac import planner, traced_chain  # noqa: E402
from remat.solver.config import SolverConfig  # noqa: E402
from tests.zoo import NATIVE_ZOO  # noqa: E402

POINTS = 6
PROFILES = ("cpu", "h100")
TIME_LIMIT_S = 10.0


def _chain_dp(problem: Any, tracer: Any, budget: int, beat: Any = None) -> Any:
    config = SolverConfig(time_limit_s=TIME_LIMIT_S)
    return traced_chain.chain_solution(problem, tracer, budget, config, None, beat)


def _planned(model: torch.nn.Module, case: Any, budget: int, profile: str) -> tuple[float, float]:
    """The plan's added time (ms) and the planning seconds."""
    t0 = time.perf_counter()
    applied = remat.apply(copy.deepcopy(model), case.inputs(), example_kwargs=case.kwargs,
                          activation_budget_bytes=budget, time_limit_s=TIME_LIMIT_S,
                          device_profile=profile)  # fmt: skip
    took = time.perf_counter() - t0
    return remat.plan_of(applied).added_time_s * 1e3, took


def _rows(case: Any, profile: str, bisect: Any) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = case.build().train()
    try:
        remat.apply(copy.deepcopy(model), case.inputs(), example_kwargs=case.kwargs,
                    activation_budget_bytes=1, device_profile=profile)  # fmt: skip
    except remat.BudgetError as e:
        least = e.least_peak_bytes
    kept = remat.apply(copy.deepcopy(model), case.inputs(), example_kwargs=case.kwargs,
                       plan="keep_all", device_profile=profile)  # fmt: skip
    eager = remat.plan_of(kept).predicted_peak_bytes
    rows = []
    for i in range(POINTS):
        budget = least + (eager - least) * i // POINTS
        family_ms, family_s = _planned(model, case, budget, profile)
        planner.per_block = _chain_dp  # type: ignore[assignment]
        try:
            chain_ms, chain_s = _planned(model, case, budget, profile)
        finally:
            planner.per_block = bisect
        rows.append({"profile": profile, "model": case.name, "budget_bytes": budget,
                     "per_block_ms": round(family_ms, 4), "per_block_s": round(family_s, 2),
                     "chain_dp_ms": round(chain_ms, 4), "chain_dp_s": round(chain_s, 2)})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    torch.set_num_threads(1)
    bisect = planner.per_block
    rows: list[dict[str, Any]] = []
    for profile in PROFILES:
        for case in NATIVE_ZOO:
            rows += _rows(case, profile, bisect)
    out = Path(__file__).parent / "results" / "second_opinion.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    same = sum(r["per_block_ms"] == r["chain_dp_ms"] for r in rows)
    dearer = [r for r in rows if r["per_block_ms"] > r["chain_dp_ms"]]
    worst = max((r["per_block_ms"] / r["chain_dp_ms"] - 1 for r in dearer), default=0.0)
    time_ratio = sum(r["per_block_s"] for r in rows) / sum(r["chain_dp_s"] for r in rows)
    cheaper = sum(r["per_block_ms"] < r["chain_dp_ms"] for r in rows)
    print(f"same plan cost at {same} of {len(rows)} budgets; dearer at {len(dearer)} (at most "
          f"{100 * worst:.1f}%), cheaper at {cheaper}; planning time {time_ratio:.2f}x the "
          "chain DP's")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
