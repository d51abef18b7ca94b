"""Benchmark (not a test): ``remat.apply``'s planning of a 7B Llama, as it runs (the exact
MILP first) and with its chain DP alone, whose uniform plans are costed on shallow copies
(:mod:`remat.executors.sac.shallow`) or traced on the whole model.

    python experiments/native_scale.py [--budgets 24 40] [--time-limit 60]

Llama-7B (32 blocks), seq 4096, batch 1, built on FakeTensors; FSDP2 over 8 ranks with its own
bf16 mixed precision (``precision="bf16-fsdp"``), the ``h100`` profile, AdamW; ``solver="auto"``:
on the blocks, the exact MILP on the step's dataflow, then the chain DP as its fallback or a
second opinion on shallow copies; then, on steps of few enough events, the same on the blocks'
sub-modules.
``chain DP alone`` turns the MILP off (``planner._milp`` returns no plan, as for a dataflow
beyond its model), to time the chain DP, with the copies and without them (``whole``:
``MIN_REGIONS`` raised past the model's regions, so the uniform plans and what the modules
outside the blocks hold are measured on the model). Each configuration runs in a fresh
child process, one after the other. Per run: seconds to the end of the analysis (the eager
traces), to the end of the blocks' pass, and in all; plans the chain DP traced; the chain DP's
recompute (estimated, roofline) where it ran, the final plan's, its predicted peak, which
solver's plan it is and on which regions. Writes ``experiments/results/native_scale.csv``.
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


def _run(budget_gb: float, mode: str, copies: bool, time_limit: float) -> dict[str, Any]:
    import remat
    from remat.executors.sac import planner, shallow, traced_chain
    from remat.executors.sac.state import applied
    from remat.presets import build

    if not copies:  # no copies: the uniform plans and the outside modules on the model
        traced_chain.MIN_REGIONS = shallow.MIN_REGIONS = 10**9  # type: ignore[misc]
    if mode == "chain DP alone":
        planner._milp = lambda *args: None  # type: ignore[assignment]
    marks: dict[str, float] = {}
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        now = time.perf_counter() - t0
        if "exact MILP on the step's dataflow" in msg or "options;" in msg:
            marks.setdefault("analysis", now)  # the blocks' first solver starts
        if "planning again" in msg or "sub-modules are not" in msg:
            marks.setdefault("blocks", now)  # the blocks' pass has its plan

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
    solver = "MILP" if re.match(r"(regions: [^;]*; )?MILP", reason) else "chain DP"
    plan_ms = round(sum(state.block_recompute_s) * 1e3, 3)
    return {
        "budget_gb": budget_gb,
        "mode": mode,
        "uniform plans": "copies" if copies else "whole",
        "analysis_s": round(marks.get("analysis", float("nan")), 1),
        "blocks_pass_s": round(marks.get("blocks", total), 1),
        "total_s": round(total, 1),
        "chain_traced": int(traced.group(1) or traced.group(2)) if traced else "",
        "chain_recompute_ms": (
            float(chain_ms.group(1)) if chain_ms else plan_ms if solver == "chain DP" else ""
        ),
        "plan_recompute_ms": plan_ms,
        "predicted_peak_bytes": state.plan.predicted_peak_bytes,
        "solver": solver,
        "regions": "sub-modules" if reason.startswith("regions: ") else "blocks",
    }


def _child(budget_gb: float, mode: str, copies: bool, time_limit: float, out: Any) -> None:
    out.put(_run(budget_gb, mode, copies, time_limit))


MODES = (("auto", True), ("chain DP alone", True), ("chain DP alone", False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[24.0, 40.0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for budget in args.budgets:
        for mode, copies in MODES:
            queue = ctx.Queue()
            p = ctx.Process(target=_child, args=(budget, mode, copies, args.time_limit, queue))
            p.start()
            rows.append(queue.get())
            p.join()
    show(rows, "remat.apply, Llama-7B, bf16-fsdp, ZeRO-3 x 8, seq 4096, h100", width=200)
    save(rows, "native_scale.csv")


if __name__ == "__main__":
    main()
