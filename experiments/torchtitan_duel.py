"""torchtitan's own Llama 3 and its own activation checkpointing against ``remat.apply`` on
the step torchtitan's trainer runs, on one CPU.

The model is torchtitan's ``debugmodel`` (``llama3_configs["debugmodel"]``: 6 layers, dim
256, 16 heads, vocabulary 2048) built from its own code, fp32, with SDPA as the inner
attention (torchtitan 0.3.0 defaults to flex attention, whose backward does not run on the
CPU, and refuses ``"sdpa"`` by name for language models: each layer's attention config is
given ``ScaledDotProductAttention.Config()``). Its blocks sit in a ``ModuleDict``; remat
finds them without ``block_types``. The step is the trainer's: ``pred = model(tokens); loss =
cross_entropy_loss(pred, labels) / n_tokens; del pred; loss.backward()``, which remat plans
with ``loss_fn=``.

Peers: torchtitan's AC modes as its ``apply_ac`` applies them (0.3.0 has no per-layer
selective mode; its memory-budget mode needs ``torch.compile``): ``none``, ``full``
(``FullAC``) and ``op-sac`` (``SelectiveAC``: compute-intensive ops kept, every second
matmul and, on the CPU, attention recomputed). For each, remat is asked for the peer's
measured allocator peak. Columns: live and allocator peaks (bytes), remat's predicted peaks,
recompute GFLOP (FlopCounterMode over the step, minus no checkpointing's), step time over no
checkpointing (one thread, interleaved rounds) and whether the loss and every gradient are
bitwise no checkpointing's. Also remat's ``torchtitan_op`` fixed plan, torchtitan's policy
run by remat, whose predicted peak is compared with torchtitan's measured op-SAC peak.

torchtitan 0.3.0 imports triton when its model code loads (expert-parallel kernels a dense
Llama never calls); without triton (the CPU wheel has none) that one module is replaced by a
stub whose kernels raise if called. Install: ``pip install -e ".[titan]"``, then
``pip install "huggingface-hub>=2.4,<3"`` (torchtitan's ``datasets`` pins a hub older than
transformers 5 imports; torchtitan's model code does not import ``datasets``).

    .venv/bin/python experiments/torchtitan_duel.py [--seq 256 --batch 2 --reps 5]

Writes ``experiments/results/torchtitan_duel.csv``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from experiments import peers  # noqa: E402
from experiments.rows import save  # noqa: E402
from remat.measure.meter import Loss, measure_step  # noqa: E402

TRITON_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


def _without_triton() -> None:
    """Replace torchtitan's triton kernel module by a stub where triton is missing."""
    if importlib.util.find_spec("triton") is not None or TRITON_MODULE in sys.modules:
        return
    stub = types.ModuleType(TRITON_MODULE)

    def missing(name: str) -> Callable[..., Any]:
        if name.startswith("__"):  # module attributes (``__file__``) stay missing
            raise AttributeError(name)

        def kernel(*_: Any, **__: Any) -> Any:
            raise RuntimeError(f"{name}: triton is not installed (a CPU-only environment)")

        return kernel

    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[TRITON_MODULE] = stub


def build(seed: int = 0) -> nn.Module:
    """torchtitan's Llama 3 ``debugmodel`` with SDPA attention, initialised its own way."""
    _without_triton()
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model.train()


def titan_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: its ``cross_entropy_loss`` (a sum) over the tokens."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels) / labels.numel()


def with_ac(mode: str) -> nn.Module:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    model = build()
    if mode == "full":
        FullAC(FullAC.Config()).apply(model)
    elif mode == "op-sac":
        SelectiveAC(SelectiveAC.Config()).apply(model)
    return model


def _step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    pred = model(tokens)
    loss = titan_loss(pred, labels)
    del pred
    loss.backward()
    return loss.detach()


def _flops(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> int:
    with FlopCounterMode(display=False, custom_mapping=peers._cpu_sdpa_flops()) as counter:
        _step(model, tokens, labels)
    return int(counter.get_total_flops())


def _state(model: nn.Module) -> list[torch.Tensor]:
    """The loss of a step and every gradient, in parameter order (torchtitan's wrappers
    rename parameters, not reorder them)."""
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run(seq: int, batch: int, reps: int, time_limit: float) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    vocab = 2048
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    loss = Loss(titan_loss, labels)
    reference = with_ac("none")
    base_flops = _flops(reference, tokens, labels)
    ref_loss = _step(reference, tokens, labels)
    ref_state = [ref_loss, *_state(reference)]
    rows: list[dict[str, Any]] = []
    steps: dict[str, Callable[[], Any]] = {}

    def add(name: str, model: nn.Module, plan: remat.Plan | None, budget: int | None) -> None:
        measured = measure_step(model, (tokens,), allocator=True, loss=loss)
        flops = _flops(model, tokens, labels) - base_flops
        state = [_step(model, tokens, labels), *_state(model)]
        rows.append(
            {
                "peer": name,
                "budget_bytes": budget,
                "live_bytes": measured.peak_bytes,
                "allocator_bytes": measured.allocator_peak_bytes,
                "predicted_bytes": None if plan is None else plan.predicted_peak_bytes,
                "predicted_live_bytes": None if plan is None else plan.predicted_tensor_peak_bytes,
                "recompute_gflop": flops / 1e9,
                "bitwise": _bitwise(ref_state, state),
                "solver": "" if plan is None else plan.solver,
            }
        )
        steps[name] = lambda m=model: _step(m, tokens, labels)

    for mode in ("none", "full", "op-sac"):
        add(f"torchtitan {mode}", with_ac(mode), None, None)
    fixed = build()
    remat.apply(fixed, tokens, loss_fn=titan_loss, target=labels, plan="torchtitan_op")
    add("remat torchtitan_op", fixed, remat.plan_of(fixed), None)
    for mode in ("none", "full", "op-sac"):
        budget = next(r["allocator_bytes"] for r in rows if r["peer"] == f"torchtitan {mode}")
        model = build()
        try:
            remat.apply(
                model, tokens, loss_fn=titan_loss, target=labels,
                activation_budget_bytes=budget, time_limit_s=time_limit,
            )  # fmt: skip
        except remat.BudgetError as e:
            rows.append({"peer": f"remat @ {mode}", "budget_bytes": budget, "solver": str(e)})
            continue
        add(f"remat @ {mode}", model, remat.plan_of(model), budget)
    steps = {"eager": steps.pop("torchtitan none"), **steps}
    ratios = peers.time_ratio(steps, reps=reps)
    ratios["torchtitan none"] = ratios.pop("eager")
    for r in rows:
        r["time_x"] = ratios.get(r["peer"])
    return rows


def show(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="torchtitan Llama 3 debugmodel, fp32, CPU")
    cols = ("peer", "allocator B", "predicted B", "live B", "predicted live B", "GFLOP", "time x",
            "bitwise")  # fmt: skip
    for col in cols:
        table.add_column(col)
    for r in rows:
        if "live_bytes" not in r:
            table.add_row(r["peer"], r["solver"], *[""] * 6)
            continue

        def fmt(v: Any) -> str:
            return "" if v is None else f"{v:,}"

        table.add_row(
            r["peer"],
            fmt(r["allocator_bytes"]),
            fmt(r["predicted_bytes"]),
            fmt(r["live_bytes"]),
            fmt(r["predicted_live_bytes"]),
            f"{r['recompute_gflop']:.3f}",
            "" if r.get("time_x") is None else f"{r['time_x']:.3f}x",
            "yes" if r["bitwise"] else "NO",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=60.0)
    opts = parser.parse_args(argv)
    found = run(opts.seq, opts.batch, opts.reps, opts.time_limit)
    show(Console(width=160), found)
    save(found, "torchtitan_duel.csv")  # the first row has every column


if __name__ == "__main__":
    main()
