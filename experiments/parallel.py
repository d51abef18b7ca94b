"""Per-stage plans of a 1F1B pipeline against one plan for every stage.

A GPT decoder (``tests.zoo.GPTStage``: 4 stages of 2 blocks, dropout on) under 1F1B with 8
and 16 microbatches, one budget per stage. Each stage is traced through PyTorch's schedule
on a fake process group, as ``remat.apply(..., pipeline=...)`` does (no processes: the
2-rank check of the predictions is ``tests/native/test_pipeline.py``). Plans compared:

- remat: each stage's own cheapest traced plan that fits (``auto``);
- uniform: one option of the chain DP's menu on every stage, the cheapest that fits all;
- Megatron: its ``recompute_num_layers``, the first N blocks of every stage recomputed
  whole, the least N that fits all (N = every block is Hugging Face's checkpointing);
- none: no checkpoint (over the budget, for reference).

The step time is simulated (:func:`remat.solver.stages.simulate_pipeline`) from each
stage's traced action order and its estimated per-microbatch forward and backward times
(the ``cpu`` device profile, recompute included). Writes ``experiments/results/parallel.csv``.

    .venv/bin/python experiments/parallel.py
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from remat.graph.profiles import get_profile  # noqa: E402
from remat.native import planner  # noqa: E402
from remat.native.api import Stage  # noqa: E402
from remat.native.api import analyze as native_analyze  # noqa: E402
from remat.native.pipelining import Pipeline  # noqa: E402
from remat.native.regions import Policy  # noqa: E402
from remat.native.trace import StepTrace  # noqa: E402
from remat.request import Request  # noqa: E402
from remat.solver.config import BudgetError, SolverConfig  # noqa: E402
from remat.solver.stages import StageTimes, simulate_pipeline  # noqa: E402
from tests.zoo import GPTStage, pipeline_loss, stage_inputs  # noqa: E402

STAGES, LAYERS, MICROBATCHES = 4, 2, (8, 16)
OUT = Path(__file__).resolve().parent / "results" / "parallel.csv"


@dataclass(frozen=True)
class StagePlan:
    trace: StepTrace

    @property
    def peak(self) -> int:
        return self.trace.peak_bytes

    def times(self) -> StageTimes:
        forward = sum(e.time_s for e in self.trace.events if e.phase == "forward")
        return StageTimes(forward, sum(e.time_s for e in self.trace.events) - forward)


def _stages(microbatches: int) -> list[tuple[planner.NativeProblem, planner.Tracer]]:
    out = []
    profile = get_profile("cpu")
    for s in range(STAGES):
        x, target = stage_inputs(s)
        pipe = Pipeline("1F1B", s, STAGES, microbatches, loss_fn=pipeline_loss)
        model = GPTStage(s, STAGES, layers=LAYERS)
        blocks = tuple(f"blocks.{k}" for k in range(LAYERS))
        traced, problem = native_analyze(
            model,
            blocks,
            (x,),
            {},
            Request.of(),
            profile,
            stage=Stage(pipe, target if pipe.last else None),
        )
        out.append((problem, lambda pol, t=traced, x=x: t.trace((x,), {}, pol)))
    return out


def _row(
    method: str, microbatches: int, budget: int, plans: Sequence[StagePlan], orders: list
) -> dict[str, object]:
    timing = simulate_pipeline(orders, [p.times() for p in plans])
    return {
        "microbatches": microbatches,
        "budget_bytes": budget,
        "method": method,
        "fits": all(p.peak <= budget for p in plans),
        "stage_peaks": " ".join(str(p.peak) for p in plans),
        "stage_recompute_ms": " ".join(
            f"{p.trace.recompute_time_s * microbatches * 1e3:.3f}" for p in plans
        ),
        "recompute_ms": round(sum(p.trace.recompute_time_s for p in plans) * microbatches * 1e3, 3),
        "step_ms": round(timing.step_s * 1e3, 3),
        "bubble_share": round(timing.bubble_share, 4),
        "stage_idle_ms": " ".join(f"{i * 1e3:.3f}" for i in timing.idle_s),
    }


def _cheapest_fitting(
    candidates: dict[str, list[StagePlan]], budget: int, orders: list
) -> tuple[str, list[StagePlan]] | None:
    fitting = {n: p for n, p in candidates.items() if all(x.peak <= budget for x in p)}
    if not fitting:
        return None
    name = min(
        fitting,
        key=lambda n: simulate_pipeline(orders, [p.times() for p in fitting[n]]).step_s,
    )
    return name, fitting[name]


def main() -> None:
    torch.manual_seed(0)
    rows = []
    config = SolverConfig(time_limit_s=20)
    for m in MICROBATCHES:
        stages = _stages(m)
        eager = [StagePlan(p.baseline) for p, _ in stages]
        assert all(e.trace.schedule is not None for e in eager)
        orders = [[(a.kind, a.microbatch) for a in e.trace.schedule.actions] for e in eager]  # type: ignore[union-attr]
        uniform = {
            name: [StagePlan(t(pol)) for (_, t), pol in zip(stages, pols, strict=True)]
            for name, pols in _uniform(stages).items()
        }
        megatron = {
            f"first {n} of {LAYERS} blocks": [StagePlan(t(_first_n(p, n))) for p, t in stages]
            for n in range(1, LAYERS + 1)
        }
        # One budget per stage: the eager peaks of the middle stages (1F1B: P - i in flight).
        for budget in sorted({eager[1].peak, eager[2].peak}, reverse=True):
            rows.append(_row("none (no checkpoint)", m, budget, eager, orders))
            ours = []
            for problem, tracer in stages:
                try:
                    ours.append(
                        StagePlan(
                            planner.solve(problem, tracer, budget_bytes=budget, config=config).trace
                        )
                    )
                except BudgetError as e:
                    print(f"remat: {e}")
                    break
            if len(ours) == STAGES:
                rows.append(_row("remat, per stage", m, budget, ours, orders))
            for label, candidates in (("uniform", uniform), ("Megatron", megatron)):
                best = _cheapest_fitting(candidates, budget, orders)
                if best is not None:
                    rows.append(_row(f"{label}: {best[0]}", m, budget, best[1], orders))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = Table(title=f"1F1B, {STAGES} stages x {LAYERS} blocks, one budget per stage")
    for col in ("mb", "budget", "method", "fits", "stage peaks", "recompute ms", "step ms"):
        table.add_column(col)
    table.add_column("bubble")
    for r in rows:
        table.add_row(
            str(r["microbatches"]),
            f"{r['budget_bytes']:,}",
            str(r["method"]),
            "yes" if r["fits"] else "no",
            str(r["stage_peaks"]),
            str(r["recompute_ms"]),
            str(r["step_ms"]),
            f"{r['bubble_share']:.1%}",
        )
    Console(width=200).print(table)
    print(f"wrote {OUT}")


def _uniform(
    stages: Sequence[tuple[planner.NativeProblem, planner.Tracer]],
) -> dict[str, list[tuple[Policy, ...]]]:
    """Menu option k on every stage (the stages' menus are alike: the same block class)."""
    menus = [planner.uniform_plans(p) for p, _ in stages]
    names = [n for n in menus[0] if all(n in m for m in menus)]
    return {n: [m[n] for m in menus] for n in names if not n.startswith("menu 0:")}


def _first_n(problem: planner.NativeProblem, n: int) -> tuple[Policy, ...]:
    whole = planner.fixed_policies(problem, "block")
    return tuple(p if k < n else None for k, p in enumerate(whole))


if __name__ == "__main__":
    main()
