"""Benchmark (not a test): ``remat.apply``'s planning of a 7B Llama, its uniform plans costed
on shallow copies (:mod:`remat.native.shallow`) against traced on the whole model.

    python experiments/native_scale.py [--budgets 24 40] [--time-limit 60]

Llama-7B (32 blocks), seq 4096, batch 1, built on FakeTensors; FSDP2 over 8 ranks with its own
bf16 mixed precision (``precision="bf16-fsdp"``), the ``h100`` profile, AdamW; ``solver="auto"``
(the chain DP, then the exact MILP on the step's dataflow; then, with the time left, the
same on the blocks' sub-modules, MILP first). Each
configuration runs in a fresh child process, one after the other; ``whole`` is the same run
with the copies turned off (``MIN_REGIONS`` raised past the model's regions: the uniform
plans, and what the modules outside the blocks hold, measured on the model). Per
run: seconds to the end of the analysis (the eager traces), to the chain DP's answer, and in
all; plans traced on the model; the chain DP's recompute (estimated, roofline) and the final
plan's, its predicted peak, which solver's plan it is and on which regions (the chain DP's
columns are empty where the sub-modules' plan won without its chain DP). Writes
``experiments/results/native_scale.csv``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import save, show  # noqa: E402


def _run(budget_gb: float, copies: bool, time_limit: float) -> dict[str, Any]:
    import remat
    from remat.native import planner, shallow
    from remat.native.state import applied
    from remat.presets import build

    if not copies:  # no copies: the uniform plans and the outside modules on the model
        planner.MIN_REGIONS = shallow.MIN_REGIONS = 10**9  # type: ignore[misc]
    marks: dict[str, float] = {}
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        now = time.perf_counter() - t0
        if "options;" in msg:
            marks.setdefault("analysis", now)
        if "exact MILP on the step's dataflow" in msg:
            marks.setdefault("chain", now)

    built = build("llama-7b", seq=4096, batch=1, settings={})
    t0 = time.perf_counter()
    remat.apply(
        built.model,
        built.args,
        example_kwargs=built.kwargs,
        budget_gb=budget_gb,
        precision="bf16-fsdp",
        zero_stage=3,
        world_size=8,
        device_profile="h100",
        time_limit_s=time_limit,
        progress=progress,
    )
    total = time.perf_counter() - t0
    state = applied(built.model)
    reason = state.plan.reason
    chain_ms = re.search(r"(?:against|the chain DP's best,) ([0-9.]+) ms", reason)
    traced = re.search(r"(\d+) plans traced on FakeTensors|\((\d+) traced\)", reason)
    return {
        "budget_gb": budget_gb,
        "uniform plans": "copies" if copies else "whole",
        "analysis_s": round(marks.get("analysis", float("nan")), 1),
        "chain_s": round(marks.get("chain", float("nan")), 1),
        "total_s": round(total, 1),
        "chain_traced": int(traced.group(1) or traced.group(2)) if traced else "",
        "chain_recompute_ms": float(chain_ms.group(1)) if chain_ms else "",
        "plan_recompute_ms": round(sum(state.block_recompute_s) * 1e3, 3),
        "predicted_peak_bytes": state.plan.predicted_peak_bytes,
        "solver": "MILP" if re.match(r"(regions: [^;]*; )?MILP", reason) else "chain DP",
        "regions": "sub-modules" if reason.startswith("regions: ") else "blocks",
    }


def _child(budget_gb: float, copies: bool, time_limit: float, out: Any) -> None:
    out.put(_run(budget_gb, copies, time_limit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[24.0, 40.0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for budget in args.budgets:
        for copies in (False, True):
            queue = ctx.Queue()
            p = ctx.Process(target=_child, args=(budget, copies, args.time_limit, queue))
            p.start()
            rows.append(queue.get())
            p.join()
    show(rows, "remat.apply, Llama-7B, bf16-fsdp, ZeRO-3 x 8, seq 4096, h100", width=200)
    save(rows, "native_scale.csv")


if __name__ == "__main__":
    main()
