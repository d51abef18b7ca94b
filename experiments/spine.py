"""Benchmark of the spine (not a test): the three fixed plans on GPT-2 small, and a 7B-class
Llama planned under FakeTensorMode.

    python experiments/spine.py            # GPT-2 small 12x768, seq 512, batch 2, fp32
    python experiments/spine.py --quick    # a 2-layer GPT-2, seconds

For each plan: predicted peak, measured peak (live-storage meter), allocator-level peak
(profiler, sees kernel scratch), bytes saved for the backward, recompute FLOPs, CPU step time as
a ratio to eager autograd (single-threaded, interleaved repetitions, median, all in this run),
and planning time. Then, in a child process, plans a Llama of 32 layers x 4096, seq 4096 under
FakeTensorMode and reports its wall time and max RSS. Writes experiments/results/spine.csv.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_FAST_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "1000000000000"}
if any(os.environ.get(k) != v for k, v in _FAST_MALLOC.items()):
    # Fresh large allocations page-fault at ~2.5 GB/s with default glibc malloc settings.
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_FAST_MALLOC})

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import remat  # noqa: E402
from remat.executors.graph.analyze import fixed_plan  # noqa: E402
from remat.executors.graph.module import Compiled, RematModule, signature  # noqa: E402
from remat.executors.graph.run import build_executor  # noqa: E402
from remat.measure.meter import allocator_peak_bytes, measure_step, training_step  # noqa: E402
from remat.solver.fixed import FIXED_PLANS  # noqa: E402
from remat.verify import compare  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 2**20


def gpt2(layers: int, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=max(1024, seq))
    return GPT2LMHeadModel(cfg)


def time_steps(modules: dict[str, torch.nn.Module], args: tuple, reps: int) -> dict[str, float]:
    """Median seconds per training step, round-robin over the modules."""
    times: dict[str, list[float]] = {k: [] for k in modules}
    for _ in range(reps):
        for name, m in modules.items():
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(0)
            t0 = time.perf_counter()
            training_step(m, args)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Unlike ru_maxrss it is not inherited from the parent
    across fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plan_llama_child() -> None:
    """Run in a child process: plan a 7B-class Llama under FakeTensorMode, print JSON."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    with remat.fake_mode():
        cfg = LlamaConfig(
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=11008,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
        )
        model = LlamaForCausalLM(cfg)
        tokens = torch.randint(0, 32000, (1, 4096))
    t_build = time.perf_counter() - t0
    analysis = remat.analyze(model, (tokens,), device_profile="h100")
    plans = {}
    for name in FIXED_PLANS:
        t1 = time.perf_counter()
        plan = fixed_plan(analysis.problem, name)
        plans[name] = {
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "plan_s": time.perf_counter() - t1,
        }
    print(
        json.dumps(
            {
                "nodes": len(analysis.problem.values),
                "build_s": t_build,
                **{f"{k}_s": v for k, v in analysis.timings.items()},
                "total_s": time.perf_counter() - t0,
                "max_rss_bytes": _peak_rss_bytes(),
                "plans": plans,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 layers, seq 128: seconds")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--llama-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_child:
        plan_llama_child()
        return
    torch.set_num_threads(1)
    console = Console(width=140)
    layers, seq, batch = (2, 128, 2) if args.quick else (12, 512, 2)
    torch.manual_seed(0)
    model = gpt2(layers, seq).train()
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    console.print(
        f"GPT-2 {layers}x768, seq {seq}, batch {batch}, fp32, dropout 0.1, CPU, 1 thread, "
        f"torch {torch.__version__}"
    )

    t0 = time.perf_counter()
    analysis = remat.analyze(model, (tokens,), device_profile="cpu")
    t_analyze = time.perf_counter() - t0
    modules: dict[str, torch.nn.Module] = {"eager": copy.deepcopy(model)}
    rows = []
    for name in FIXED_PLANS:
        t1 = time.perf_counter()
        plan = fixed_plan(analysis.problem, name)
        t_plan = time.perf_counter() - t1
        work = copy.deepcopy(model)
        ex = build_executor(analysis.joint, analysis.problem, plan)
        modules[name] = RematModule(
            work,
            Compiled(analysis.captured, ex),
            signature((tokens,), {}),
            planner=None,  # type: ignore[arg-type]
        )
        rows.append({"plan": name, "plan_s": t_plan, "_plan": plan})

    # Memory and equality: one metered step each, same random stream as eager.
    torch.manual_seed(1)
    eager = measure_step(modules["eager"], (tokens,))
    for row in rows:
        m = modules[row["plan"]]
        torch.manual_seed(1)
        measured = measure_step(m, (tokens,))
        bad = compare(modules["eager"], m, eager.outputs, measured.outputs, 0)
        plan = row["_plan"]
        row.update(
            predicted_peak_bytes=plan.predicted_peak_bytes,
            measured_peak_bytes=measured.peak_bytes,
            saved_bytes=plan.saved_bytes,
            recompute_gflop=plan.recompute_flops / 1e9,
            recomputed_ops=len(plan.recomputed),
            bitwise_equal=not bad,
        )
    # Allocator-level peaks (profiler): after the comparisons, as they reset the gradients.
    eager_alloc = allocator_peak_bytes(lambda: _fresh_step(modules["eager"], tokens))
    for row in rows:
        m = modules[row["plan"]]
        row["allocator_peak_bytes"] = allocator_peak_bytes(lambda m=m: _fresh_step(m, tokens))
    steps = time_steps(modules, (tokens,), args.reps)
    for row in rows:
        row["step_ratio"] = steps[row["plan"]] / steps["eager"]

    table = Table(title="fixed plans vs eager autograd (memory in MiB)")
    cols = [
        "plan", "predicted", "measured", "allocator", "saved", "recomp GFLOP",
        "recomp ops", "step / eager", "equal", "plan s",
    ]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "plan" else "right")
    table.add_row(
        "eager", "-", f"{eager.peak_bytes / MiB:,.1f}", f"{eager_alloc / MiB:,.1f}",
        "-", "-", "-", f"1.00 ({steps['eager']:.2f} s)", "-", "-",
    )  # fmt: skip
    for r in rows:
        table.add_row(
            r["plan"],
            f"{r['predicted_peak_bytes'] / MiB:,.1f}",
            f"{r['measured_peak_bytes'] / MiB:,.1f}",
            f"{r['allocator_peak_bytes'] / MiB:,.1f}",
            f"{r['saved_bytes'] / MiB:,.1f}",
            f"{r['recompute_gflop']:.2f}",
            str(r["recomputed_ops"]),
            f"{r['step_ratio']:.3f}",
            "yes" if r["bitwise_equal"] else "NO",
            f"{r['plan_s']:.2f}",
        )
    console.print(table)
    console.print(
        "planning (capture + joint + annotate): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in analysis.timings.items())
        + f"; total {t_analyze:.2f} s; {len(analysis.problem.values)} joint-graph nodes"
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("spine_quick.csv" if args.quick else "spine.csv")
    with out.open("w", newline="") as f:
        fields = [k for k in rows[0] if not k.startswith("_")]
        w = csv.DictWriter(f, fieldnames=["model", *fields, "eager_peak_bytes", "eager_step_s"])
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    "model": f"gpt2-{layers}x768-s{seq}-b{batch}",
                    **{k: r[k] for k in fields},
                    "eager_peak_bytes": eager.peak_bytes,
                    "eager_step_s": steps["eager"],
                }
            )
    console.print(f"wrote {out}")

    if not args.skip_llama:
        console.print("planning Llama 32x4096 (6.7B), seq 4096, batch 1 under FakeTensorMode...")
        child = subprocess.run(
            [sys.executable, __file__, "--llama-child"], capture_output=True, text=True
        )
        if child.returncode:
            raise SystemExit(f"Llama planning failed:\n{child.stderr[-4000:]}")
        info = json.loads(child.stdout.strip().splitlines()[-1])
        console.print(json.dumps(info, indent=1))


def _fresh_step(m: torch.nn.Module, tokens: torch.Tensor) -> None:
    for p in m.parameters():
        p.grad = None
    torch.manual_seed(1)
    training_step(m, (tokens,))
    for p in m.parameters():
        p.grad = None


if __name__ == "__main__":
    main()
