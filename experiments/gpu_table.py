"""Benchmark (not a test): remat's plan for the "GPU table" practitioners quote for a 24-layer
transformer (hidden 2048, batch 4, fp16) on an 80 GB A100:

    seq 2048: no checkpointing 38.4 GB; every-layer checkpointing 12.2 GB, +25% step time
    seq 8192: out of memory without checkpointing on 80 GB; 34.8 GB with it

Model: Hugging Face GPT-2 architecture, GPT2Config(n_layer=24, n_embd=2048, n_head=16,
n_positions=8192) (1.33 B parameters with the tied 50,257-token embedding), built under
FakeTensorMode (remat.presets.build, labels = inputs, loss inside the step), traced with
precision="fp16-mixed" (torch.autocast fp16, fp32 master weights) and the a100 profile.

Attention variants (`--attn`):
* ``sdpa``  (default) HF's default F.scaled_dot_product_attention with attn_pdrop=0: on CPU
            the trace then uses the fused flash kernel, as a GPU run does (flash/efficient
            attention draws its dropout in-kernel and saves no s x s tensor, so attn_pdrop is
            immaterial to memory there). With attn_pdrop>0 a CPU trace falls back to the math
            path, which upcasts to fp32 and keeps s x s tensors a GPU run never makes.
* ``eager`` HF's explicit attention (softmax and dropout over s x s), attn_pdrop=0.1.
Residual and embedding dropout stay 0.1.

For each seq: keep_all, block (every GPT2Block checkpointed: gradient_checkpointing_enable()),
chain at block's peak (what remat pays for the same peak), megatron, and remat.optimize's
the 80 GB device as remat.optimize budgets it (AdamW, fp16-mixed, 5% reserve), solved by chain. Memory is reported four ways:
  step      remat's predicted step peak (activations, output grads, fp32 param grads,
            autocast's fp16 weight copies);
  +params   step + fp32 parameters (4 B/param): what max_memory_allocated shows for a
            forward+backward with no optimizer state;
  +adamw    + AdamW's two fp32 moments (8 B/param): the whole training step's device memory;
  act       step peak - fp32 grads (4 B/param): activations alone.

    python experiments/gpu_table.py --seq 2048 [--attn sdpa|eager]     # one config per run, ~1-2 min
Appends to results/gpu_table.csv.
"""

from __future__ import annotations

import argparse
import csv
import resource
import time
from pathlib import Path

import remat
from remat.budget import DEFAULT_RESERVE, Options, device_budget
from remat.presets import build
from remat.request import model_static_memory
from remat.solver.blocks import block_of
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.registry import solve

RESULTS = Path(__file__).parent / "results"
GB = 1e9
TABLE = {  # the practitioner's table, GB
    (2048, "keep_all"): 38.4,
    (2048, "block"): 12.2,
    (8192, "block"): 34.8,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--auto", action="store_true", help="also solver=auto (adds ~2-3 min)")
    args = ap.parse_args()
    settings = {
        "n_layer": 24,
        "n_embd": 2048,
        "n_head": 16,
        "n_positions": 8192,
        "attn_implementation": args.attn,
        "attn_pdrop": 0.0 if args.attn == "sdpa" else 0.1,
    }
    t0 = time.perf_counter()
    built = build("gpt2", seq=args.seq, batch=args.batch, settings=settings)
    problem = remat.analyze(
        built.model, built.args, built.kwargs, device_profile="a100", precision="fp16-mixed"
    ).problem
    t_an = time.perf_counter() - t0
    n_params = sum(p.numel() for p in built.model.parameters())
    static = model_static_memory(built.model, Options("adamw", "fp16-mixed"))
    params_b = static.parameters  # fp32 weights, 4 B/param
    grads_b = 4 * n_params  # fp32 grads, inside the step peak
    adam_b = static.optimizer_state  # 8 B/param
    print(
        f"GPT-2 24x2048 ({n_params / 1e9:.3f} B params), seq {args.seq}, batch {args.batch}, "
        f"attn={args.attn}: {len(problem.values)} joint nodes, analysed in {t_an:.1f} s; "
        f"params {params_b / GB:.2f} GB, grads {grads_b / GB:.2f} GB, AdamW {adam_b / GB:.2f} GB",
        flush=True,
    )
    config = SolverConfig(time_limit_s=args.time_limit)
    step_flops = sum(v.flops for v in problem.values if v.role.value in ("forward", "backward"))
    # what gradient_checkpointing_enable() replays: every op of every block's forward
    blocks = block_of(problem)
    block_fwd_flops = sum(
        v.flops for v in problem.values if v.role.value == "forward" and blocks[v.name] is not None
    )
    print(
        f"  full replay of every block's forward (HF checkpointing): "
        f"{100 * block_fwd_flops / step_flops:.1f}% of the step's FLOPs",
        flush=True,
    )
    plans = {}
    for name in ("keep_all", "block", "megatron"):
        t1 = time.perf_counter()
        plans[name] = (
            solve(problem, solver=name, budget_bytes=None, config=config),
            time.perf_counter() - t1,
        )
    solvers_at_block = ("chain", "auto") if args.auto else ("chain",)
    for name in solvers_at_block:
        t1 = time.perf_counter()
        try:
            plans[f"{name}@block_peak"] = (
                solve(
                    problem,
                    solver=name,
                    budget_bytes=plans["block"][0].predicted_peak_bytes,
                    config=config,
                ),
                time.perf_counter() - t1,
            )
        except (BudgetError, ValueError, RuntimeError) as e:
            print(f"  {name} at block's peak: {e}")
    # The whole 80 GB device as remat.optimize(budget_gb=80, optimizer="adamw",
    # precision="fp16-mixed") budgets it (static memory and a 5% reserve subtracted); solved
    # with `chain` (auto, which also tries the flat LP and others, takes minutes at this size)
    device = device_budget(int(80 * GB), static, Options("adamw", "fp16-mixed"), DEFAULT_RESERVE)
    step_budget = device.step_budget_bytes
    for name in ("keep_all", "chain", *(("auto",) if args.auto else ())):
        t1 = time.perf_counter()
        try:
            plan = (
                solve(problem, solver=name, budget_bytes=step_budget, config=config)
                if name != "keep_all"
                else plans["keep_all"][0]
            )
            if plan.predicted_peak_bytes > step_budget:
                print(
                    f"  {name} at 80 GB: step peak {plan.predicted_peak_bytes / GB:.1f} GB "
                    f"> step budget {step_budget / GB:.1f} GB: does not fit"
                )
                continue
            plans[f"{name}@80GB"] = (plan, time.perf_counter() - t1)
        except (BudgetError, ValueError, RuntimeError) as e:
            print(f"  {name} at 80 GB: {e}")
    rows = []
    for name, (plan, secs) in plans.items():
        sim = plan.simulation
        step = plan.predicted_peak_bytes
        row = {
            "model": "gpt2-24x2048",
            "attn": args.attn,
            "precision": "fp16-mixed",
            "seq": args.seq,
            "batch": args.batch,
            "params": n_params,
            "plan": name,
            "solver": plan.solver,
            "step_peak_gb": step / GB,
            "act_gb": (step - grads_b) / GB,
            "plus_params_gb": (step + params_b) / GB,
            "plus_adamw_gb": (step + params_b + adam_b) / GB,
            "saved_gb": plan.saved_bytes / GB,
            "recompute_pct": 100 * sim.recompute_time_s / sim.step_time_s,
            "recompute_gflop": sim.recompute_flops / 1e9,
            "recompute_flops_pct": 100 * sim.recompute_flops / step_flops,
            "hf_full_replay_flops_pct": 100 * block_fwd_flops / step_flops,
            "fits_80gb_total": step + params_b + adam_b <= 0.95 * 80 * GB,
            "table_gb": TABLE.get((args.seq, name)),
            "solve_s": secs,
            "analyze_s": t_an,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "reason": plan.reason,
        }
        if name.endswith("@80GB"):
            row["step_budget_gb"] = step_budget / GB
        rows.append(row)
        print(
            f"  {name:16s} step {row['step_peak_gb']:6.2f} GB | act {row['act_gb']:6.2f} | "
            f"+params {row['plus_params_gb']:6.2f} | +adamw {row['plus_adamw_gb']:6.2f} | "
            f"saved {row['saved_gb']:6.2f} | recompute {row['recompute_pct']:5.1f}% time, "
            f"{row['recompute_flops_pct']:4.1f}% flops "
            f"[{plan.solver}, {secs:.0f}s] {plan.reason[:70]}",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "gpu_table.csv"
    fields = [
        "model",
        "attn",
        "precision",
        "seq",
        "batch",
        "params",
        "plan",
        "solver",
        "step_peak_gb",
        "act_gb",
        "plus_params_gb",
        "plus_adamw_gb",
        "saved_gb",
        "recompute_pct",
        "recompute_gflop",
        "recompute_flops_pct",
        "hf_full_replay_flops_pct",
        "fits_80gb_total",
        "table_gb",
        "step_budget_gb",
        "solve_s",
        "analyze_s",
        "max_rss_gib",
        "reason",
    ]
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)
    print("appended", out, f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
