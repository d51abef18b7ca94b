"""Per-stage plans of a pipeline against one plan for every stage.

Small, on CPU (no processes: each rank is traced through PyTorch's schedule on a fake process
group, as ``remat.apply(..., pipeline=...)`` does; the 2- and 4-rank checks of these
predictions are ``tests/parallel/test_pipelining.py`` and ``tests/parallel/test_tensor_ranks.py``): a GPT
decoder of 8 blocks (``tests.zoo.GPTStage``, dropout on), 8 and 16 microbatches, one budget
per rank (the eager peaks of ranks 1 and 2), under

- 1F1B, 4 stages of 2 blocks, one per rank;
- Interleaved1F1B, 8 stages of 1 block, 2 per rank (rank r holds stages r and r + 4).

At Llama 3 70B shape (FakeTensors, no memory): TP 8 x PP 4 (1F1B, 20 layers a stage) x
FSDP2 over 4, bf16 FSDP2 mixed precision, AdamW, seq 8192, 8 microbatches of 1 sequence,
80 GB h100s: each rank's budget is what its device leaves after its static memory.

Plans compared, each rank traced over a whole ``schedule.step()``:

- remat: each rank's own cheapest traced plan that fits (``auto`` on the blocks);
- uniform: one option of the chain DP's menu on every rank (small), or every block
  recomputed (70B: Hugging Face's ``gradient_checkpointing_enable()``), the cheapest that
  fits all;
- Megatron: its ``recompute_num_layers``, the first N blocks of every stage (every chunk
  under Interleaved1F1B) recomputed whole, the least N that fits all;
- none: no checkpoint (over the budget, for reference).

The step is simulated (:func:`remat.solver.stages.simulate_ranks`) from each rank's traced
action order, each action with its own traced time (``cpu`` device profile small, ``h100``
at 70B; recompute included). Writes ``experiments/results/parallel.csv``.

    .venv/bin/python experiments/parallel.py [--small-only]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from remat.executors.sac import planner  # noqa: E402
from remat.executors.sac.passes import Stage  # noqa: E402
from remat.executors.sac.passes import analyze as native_analyze  # noqa: E402
from remat.executors.sac.regions import Policy  # noqa: E402
from remat.executors.sac.trace import FSDP_PARAM_DTYPES, StepTrace  # noqa: E402
from remat.measure.profiles import DeviceProfile, get_profile  # noqa: E402
from remat.parallel.pipelining import Pipeline  # noqa: E402
from remat.parallel.split import causal_lm_stages, stage_example  # noqa: E402
from remat.parallel.tensor import tensor_parallel  # noqa: E402
from remat.presets import build  # noqa: E402
from remat.request import Request  # noqa: E402
from remat.solver.config import BudgetError, SolverConfig  # noqa: E402
from remat.solver.stages import PipelineTiming, RankAction, simulate_ranks  # noqa: E402
from tests.zoo import GPTStage, pipeline_loss, stage_inputs  # noqa: E402

SMALL = (("1F1B", 4, 2, 1), ("Interleaved1F1B", 8, 1, 2))
"""(schedule, stages, blocks per stage, stages per rank) on the 8-block GPT decoder."""
MICROBATCHES = (8, 16)
OUT = Path(__file__).resolve().parent / "results" / "parallel.csv"


@dataclass(frozen=True)
class Rank:
    """One pipeline rank's blocks, traced with every block eager, and how to trace a plan."""

    problem: planner.NativeProblem
    tracer: planner.Tracer
    layers: int
    """Blocks per stage (a chunk, under a multi-stage schedule)."""
    budget: int | None = None


def _small_ranks(schedule: str, n_stages: int, layers: int, per_rank: int, m: int) -> list[Rank]:
    out = []
    profile = get_profile("cpu")
    pipe0 = Pipeline(schedule, 0, n_stages, m, loss_fn=pipeline_loss, stages_per_rank=per_rank)
    for r in range(pipe0.ranks):
        pipe = Pipeline(schedule, r, n_stages, m, loss_fn=pipeline_loss, stages_per_rank=per_rank)
        held = [GPTStage(i, n_stages, layers=layers) for i in pipe.indices]
        xs = tuple(stage_inputs(i)[0] for i in pipe.indices)
        target = stage_inputs(n_stages - 1)[1] if pipe.last else None
        if per_rank == 1:
            module: nn.Module = held[0]
            blocks = tuple(f"blocks.{k}" for k in range(layers))
        else:
            module = nn.ModuleList(held)
            blocks = tuple(f"{j}.blocks.{k}" for j in range(per_rank) for k in range(layers))
        out.append(_rank(module, blocks, xs, Request.of(), profile, Stage(pipe, target), layers))
    return out


def _rank(
    module: nn.Module,
    blocks: tuple[str, ...],
    xs: tuple[torch.Tensor, ...],
    req: Request,
    profile: DeviceProfile,
    stage: Stage,
    layers: int,
    budget: int | None = None,
) -> Rank:
    traced, problem = native_analyze(
        module, blocks, xs, {}, req, profile, fsdp_units=blocks, stage=stage
    )

    def tracer(policies: Sequence[Policy], schedule: bool = True) -> StepTrace:
        return traced.trace(xs, {}, policies, schedule)

    return Rank(problem, tracer, layers, budget)


def _actions(trace: StepTrace) -> list[RankAction]:
    assert trace.schedule is not None
    return [RankAction(a.stage, a.kind, a.microbatch, a.time_s) for a in trace.schedule.actions]


def _timing(plans: Sequence[StepTrace]) -> PipelineTiming:
    return simulate_ranks([_actions(t) for t in plans])


def _row(
    case: str, m: int, budgets: Sequence[int], method: str, plans: Sequence[StepTrace]
) -> dict[str, object]:
    timing = _timing(plans)
    return {
        "case": case,
        "microbatches": m,
        "budget_bytes": " ".join(map(str, budgets)),
        "method": method,
        "fits": all(p.peak_bytes <= b for p, b in zip(plans, budgets, strict=True)),
        "stage_peaks": " ".join(str(p.peak_bytes) for p in plans),
        "stage_recompute_ms": " ".join(f"{p.recompute_time_s * m * 1e3:.3f}" for p in plans),
        "recompute_ms": round(sum(p.recompute_time_s for p in plans) * m * 1e3, 3),
        "step_ms": round(timing.step_s * 1e3, 3),
        "bubble_share": round(timing.bubble_share, 4),
        "stage_idle_ms": " ".join(f"{i * 1e3:.3f}" for i in timing.idle_s),
    }


def _cheapest_fitting(
    candidates: dict[str, list[StepTrace]], budgets: Sequence[int]
) -> tuple[str, list[StepTrace]] | None:
    fitting = {
        n: p
        for n, p in candidates.items()
        if all(t.peak_bytes <= b for t, b in zip(p, budgets, strict=True))
    }
    if not fitting:
        return None
    name = min(fitting, key=lambda n: _timing(fitting[n]).step_s)
    return name, fitting[name]


def _first_n(rank: Rank, n: int) -> tuple[Policy, ...]:
    """Megatron's ``recompute_num_layers``: the first ``n`` blocks of each chunk recomputed."""
    whole = planner.fixed_policies(rank.problem, "block")
    return tuple(p if k % rank.layers < n else None for k, p in enumerate(whole))


def _uniform(ranks: Sequence[Rank]) -> dict[str, list[tuple[Policy, ...]]]:
    """Menu option k on every rank (the ranks' menus are alike: the same block class)."""
    menus = [planner.uniform_plans(r.problem) for r in ranks]
    names = [n for n in menus[0] if all(n in m for m in menus)]
    return {n: [m[n] for m in menus] for n in names if not n.startswith("menu 0:")}


def _ours(ranks: Sequence[Rank], budgets: Sequence[int], config: SolverConfig) -> list[StepTrace]:
    out = []
    for r, b in zip(ranks, budgets, strict=True):
        try:
            out.append(planner.solve(r.problem, r.tracer, budget_bytes=b, config=config).trace)
        except BudgetError as e:
            print(f"remat: {e}")
            return []
    return out


def small(rows: list[dict[str, object]]) -> None:
    config = SolverConfig(time_limit_s=20)
    for schedule, n_stages, layers, per_rank in SMALL:
        case = f"{schedule}, {n_stages} stages x {layers} GPT blocks, {n_stages // per_rank} ranks"
        for m in MICROBATCHES:
            t0 = time.perf_counter()
            ranks = _small_ranks(schedule, n_stages, layers, per_rank, m)
            eager = [r.problem.baseline for r in ranks]
            uniform = {
                name: [r.tracer(p) for r, p in zip(ranks, pols, strict=True)]
                for name, pols in _uniform(ranks).items()
            }
            megatron = {
                f"first {n} of {layers} blocks": [r.tracer(_first_n(r, n)) for r in ranks]
                for n in range(1, layers + 1)
            }
            for budget in sorted({eager[1].peak_bytes, eager[2].peak_bytes}, reverse=True):
                budgets = [budget] * len(ranks)
                rows.append(_row(case, m, budgets, "none (no checkpoint)", eager))
                ours = _ours(ranks, budgets, config)
                if ours:
                    rows.append(_row(case, m, budgets, "remat, per rank", ours))
                for label, candidates in (("uniform", uniform), ("Megatron", megatron)):
                    best = _cheapest_fitting(candidates, budgets)
                    if best is not None:
                        rows.append(_row(case, m, budgets, f"{label}: {best[0]}", best[1]))
            print(f"{case}, {m} microbatches: {time.perf_counter() - t0:.0f} s", flush=True)


LLAMA = "llama3-70b"
PP, TP, DP, SEQ, BATCH, M70 = 4, 8, 4, 8192, 8, 8


def _llama_ranks(progress: Callable[[str], None]) -> list[Rank]:
    """The 70B stages, each tensor-parallel and FSDP2-sharded as its rank, on FakeTensors."""
    built = build(LLAMA, seq=SEQ, batch=BATCH)
    stages = causal_lm_stages(built.model, PP)
    tokens = built.args[0]
    micro = tokens[: tokens.shape[0] // M70]
    xs = [stage_example(s, micro, FSDP_PARAM_DTYPES["bf16-fsdp"]) for s in stages]
    req = Request.of(
        budget_gb=80,
        optimizer="adamw",
        precision="bf16-fsdp",
        zero_stage=3,
        world_size=DP,
        device_profile="h100",
        time_limit_s=60,
        progress=progress,
    )
    out = []
    for r, stage in enumerate(stages):
        tensor_parallel(stage, TP, dp_size=DP, pp_size=PP, pp_rank=r)
        pipe = Pipeline("1F1B", r, PP, M70, loss_fn=_next_token_loss)
        budget = req.step_budget(req.device(stage))
        blocks = tuple(f"layers.{k}" for k in range(len(stage.layers)))
        target = micro if pipe.last else None
        out.append(
            _rank(
                stage,
                blocks,
                (xs[r],),
                req,
                get_profile("h100"),
                Stage(pipe, target),
                len(blocks),
                budget,
            )
        )
    return out


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _least_n(rank: Rank, budget: int) -> int | None:
    """The least N whose Megatron plan fits ``rank`` (bisection: a larger N holds less)."""
    if rank.problem.baseline.peak_bytes <= budget:
        return 0
    if rank.tracer(_first_n(rank, rank.layers)).peak_bytes > budget:
        return None
    lo, hi = 0, rank.layers  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rank.tracer(_first_n(rank, mid)).peak_bytes <= budget else (mid, hi)
    return hi


def llama70b(rows: list[dict[str, object]]) -> None:
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"  [{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    ranks = _llama_ranks(progress)
    budgets = [r.budget for r in ranks]
    assert all(b is not None for b in budgets)
    fits = [int(b) for b in budgets if b is not None]
    case = f"Llama 3 70B, TP {TP} x PP {PP} (1F1B) x FSDP {DP}, seq {SEQ}, h100 80 GB (fake)"
    eager = [r.problem.baseline for r in ranks]
    rows.append(_row(case, M70, fits, "none (no checkpoint)", eager))
    t1 = time.perf_counter()
    ours = _ours(ranks, fits, SolverConfig(time_limit_s=60, progress=progress))
    progress(f"remat's plans: {time.perf_counter() - t1:.0f} s")
    if ours:
        rows.append(_row(case, M70, fits, "remat, per rank", ours))
    block = [r.tracer(planner.fixed_policies(r.problem, "block")) for r in ranks]
    rows.append(_row(case, M70, fits, "uniform: every block recomputed", block))
    least = [_least_n(r, b) for r, b in zip(ranks, fits, strict=True)]
    if all(n is not None for n in least):
        n = max(x for x in least if x is not None)
        plans = [r.tracer(_first_n(r, n)) for r in ranks]
        rows.append(_row(case, M70, fits, f"Megatron: first {n} of {ranks[0].layers}", plans))
    progress("done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-only", action="store_true", help="skip the 70B plans (~15 min)")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    small(rows)
    _write(rows)
    if not a.small_only:
        llama70b(rows)
        _write(rows)
    table = Table(title="one budget per rank; step simulated from each rank's traced actions")
    for col in ("case", "mb", "method", "fits", "peak / budget per rank", "recompute ms"):
        table.add_column(col)
    table.add_column("step ms")
    table.add_column("bubble")
    for r in rows:
        peaks = str(r["stage_peaks"]).split()
        budgets = str(r["budget_bytes"]).split()
        table.add_row(
            str(r["case"]),
            str(r["microbatches"]),
            str(r["method"]),
            "yes" if r["fits"] else "no",
            " ".join(f"{int(p) / int(b):.2f}" for p, b in zip(peaks, budgets, strict=True)),
            str(r["recompute_ms"]),
            str(r["step_ms"]),
            f"{r['bubble_share']:.1%}",
        )
    Console(width=220).print(table)
    print(f"wrote {OUT}")


def _write(rows: list[dict[str, object]]) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
