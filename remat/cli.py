"""The ``remat`` command line.

``remat demo`` plans the built-in GPT-style model with the fixed plans, the baselines and the
exact MILP (at the peak of every-block checkpointing), runs real CPU training steps for each
beside the unmodified model, and prints predicted vs measured peaks and whether outputs and
gradients are bitwise equal.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from functools import partial

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from remat.meter import allocator_peak_bytes, training_step
from remat.models import TinyGPT
from remat.solver.fixed import FIXED_PLANS
from remat.verify import verify


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _step_without_grads(module: torch.nn.Module, tokens: torch.Tensor) -> None:
    for p in module.parameters():
        p.grad = None
    training_step(module, (tokens,))
    for p in module.parameters():
        p.grad = None


def demo(args: argparse.Namespace) -> int:
    # Piped output (CI logs, files) gets a fixed width so the table is never squeezed.
    console = Console() if sys.stdout.isatty() else Console(width=120)
    torch.manual_seed(args.seed)
    model = TinyGPT(
        vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq
    )
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]remat demo[/]: TinyGPT, {args.layers} layers x {args.dim} wide, {args.heads} "
        f"heads, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, "
        f"{n_params / 1e6:.2f}M parameters, dropout 0.1, fp32 on CPU"
    )
    table = Table(
        title="one training step per plan; memory in MiB of live tensor storages",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for col in (
        "plan",
        "predicted",
        "measured",
        "allocator",
        "eager",
        "saved",
        "recomputed",
        "GFLOP",
        "overhead",
        "vs eager",
        "time s",
    ):
        table.add_column(col, justify="left" if col == "plan" else "right", no_wrap=True)
    ok = True
    runs: list[tuple[str, dict[str, object]]] = [(n, {"plan": n}) for n in FIXED_PLANS]
    runs += [(n, {"solver": n}) for n in ("block", "megatron", "chen_greedy")]
    block_peak: int | None = None
    for name, opts in runs + [("auto", {})]:
        if name == "auto":
            # The exact MILP at the every-block-checkpointed peak: same memory, less recompute.
            assert block_peak is not None
            opts = {"activation_budget_bytes": block_peak, "time_limit_s": args.time_limit}
            name = "auto @ block peak"
        with console.status(f"planning and running {name}..."):
            t0 = time.perf_counter()
            result = verify(model, (tokens,), steps=args.steps, **opts)  # type: ignore[arg-type]
            elapsed = time.perf_counter() - t0
        if name == "block":
            block_peak = result.module.plan.predicted_peak_bytes
        plan = result.module.plan
        step = result.steps[-1]
        alloc = allocator_peak_bytes(partial(_step_without_grads, result.module, tokens))
        sim = plan.simulation
        exact = step.measured_peak_bytes == step.predicted_peak_bytes
        ok &= result.equal
        table.add_row(
            name,
            _mib(step.predicted_peak_bytes),
            ("[green]" if exact else "[yellow]") + _mib(step.measured_peak_bytes),
            _mib(alloc),
            _mib(step.eager_peak_bytes),
            _mib(plan.saved_bytes),
            str(len(plan.recomputed)),
            f"{plan.recompute_flops / 1e9:.3f}",
            f"{sim.recompute_time_s / sim.step_time_s:.1%}",
            "[green]equal" if result.equal else "[red]DIFFER",
            f"{elapsed:.1f}",
        )
    console.print(table)
    console.print(
        "predicted: remat's simulation of its executor. measured: the live-storage meter on "
        "this run. allocator: the CPU allocator's peak (profiler; adds kernel scratch). "
        "eager: the live-storage meter on the unmodified model. saved: bytes the forward "
        "leaves to the backward. recomputed: ops (and their GFLOP) the backward re-runs. "
        "overhead: recompute time / step time on the 'cpu' roofline profile. vs eager: "
        f"outputs, gradients, parameters and buffers bitwise equal over {args.steps} AdamW "
        "steps with dropout on. time: planning plus the run."
    )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan and run the built-in GPT-style model")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--dim", type=int, default=128)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--vocab", type=int, default=512)
    d.add_argument("--seq", type=int, default=128)
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--steps", type=int, default=2, help="optimizer steps per plan")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--time-limit", type=float, default=30.0, help="seconds for the exact MILP (auto row)"
    )
    d.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
