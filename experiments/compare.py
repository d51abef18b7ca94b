"""remat against the peers a user would pick instead, side by side in one process and one run.

    python experiments/compare.py                  # every model, 5 budgets, timing (hours),
                                                   # each model in a fresh process
    python experiments/compare.py --quick          # tiny models, 3 budgets, no timing (~30 s):
                                                   # checks, not figures (solver chen_greedy)
    python experiments/compare.py --models gpt2_small,unet --budgets 4 --reps 5

For each model (built here from small random configs, fp32, CPU, dropout on where the model
has it), one training step as :func:`remat.measure.meter.training_step` defines it:

* **peers** (:mod:`peers`): eager; PyTorch's memory-budget partitioner (``torch.compile``,
  ``aot_eager``) at several ``activation_memory_budget`` fractions; Hugging Face's
  ``gradient_checkpointing_enable()`` (HF models); ``torch.utils.checkpoint`` around every block
  and around ceil(sqrt(L))-block segments. Each peer's peak is *measured* (live-storage meter).
* **remat at each peer's measured allocator peak** (``matched``): planned (``--solver``,
  default ``auto``) for exactly that many bytes, so the two recompute costs compare at equal
  memory where out-of-memory happens.
* **remat's sweep**: budgets evenly from the least peak remat reaches to keep-all's.

Every remat row is run and measured: its predicted allocator peak (live storages plus each
kernel's measured scratch) against the allocator's measured peak, its predicted tensor peak
against the live-storage meter's, and outputs and gradients compared bitwise with eager's.
remat is matched to each peer's *allocator* peak, where a step runs out of memory. Recompute FLOPs are counted with the same FLOP
registry for all: FlopCounterMode (checkpointed step minus eager) for eager checkpointing, the
registry over the recomputed ops for remat's plans and the partitioner's backward graph. With ``--reps`` > 0, CPU step time / eager (one thread, interleaved repetitions, median)
for every row. Writes ``results/compare/<model>.csv`` (one row per measured configuration) and
``results/compare/<model>.png`` (``--out PATH``: one CSV for every model, PNGs beside it);
``paper/build.py`` turns the CSVs into the paper's tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import ctypes
import dataclasses
import functools
import gc
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402

import remat  # noqa: E402
from remat.executors.graph.module import Compiled, RematModule, signature  # noqa: E402
from remat.executors.graph.run import build_executor  # noqa: E402
from remat.models import ResNet, TinyGPT, UNet  # noqa: E402
from remat.solver.config import BudgetError, SolverConfig  # noqa: E402
from remat.solver.plan import Plan  # noqa: E402
from remat.solver.registry import least_peak, solve  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TORCH_BUDGETS = (0.1, 0.3, 0.5, 0.7, 1.0)
QUICK_TORCH_BUDGETS = (0.5,)
COLUMNS = [
    "model", "kind", "method", "setting", "budget_bytes", "peak_bytes",
    "predicted_tensor_peak_bytes", "allocator_peak_bytes", "predicted_peak_bytes",
    "recompute_flops", "step_flops", "time_ratio", "solve_s", "equal",
    "differing", "reason",
]  # fmt: skip


@dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    hf: bool = False
    chain: bool = True
    """Its longest ModuleList is a chain (block i+1 reads block i's output): sqrt(L) segments
    apply. A U-Net's lists are not."""


def _hf(
    kind: str, layers: int, dim: int, seq: int, batch: int
) -> tuple[nn.Module, tuple[Any, ...]]:
    import transformers as tf

    common: dict[str, Any] = {"use_cache": False}
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=dim, n_head=max(2, dim // 64), n_positions=seq,
                            vocab_size=512, **common)  # fmt: skip
        model: nn.Module = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=dim, intermediate_size=2 * dim,
                             num_attention_heads=max(2, dim // 64), num_key_value_heads=max(1, dim // 128),
                             vocab_size=512, max_position_embeddings=seq, **common)  # fmt: skip
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=dim, intermediate_size=4 * dim,
                            num_attention_heads=max(2, dim // 64), vocab_size=512,
                            max_position_embeddings=seq)  # fmt: skip
        model = tf.BertForMaskedLM(cfg)
    return model.train(), (torch.randint(0, 512, (batch, seq)),)


def _tiny_gpt(layers: int, dim: int, seq: int, batch: int) -> tuple[nn.Module, tuple[Any, ...]]:
    model = TinyGPT(vocab=256, dim=dim, heads=max(2, dim // 64), layers=layers, seq=seq)
    return model.train(), (torch.randint(0, 256, (batch, seq)),)


def _cnn(kind: str, width: int, depth: int, side: int) -> tuple[nn.Module, tuple[Any, ...]]:
    model = ResNet(channels=width, blocks=depth) if kind == "resnet" else UNet(width, depth)
    return model.train(), (torch.randn(2, 3, side, side),)


MODELS = {
    "gpt": Spec("gpt", functools.partial(_tiny_gpt, 6, 256, 256, 2)),
    "gpt2_small": Spec("gpt2_small", functools.partial(_hf, "gpt2", 12, 768, 256, 2), hf=True),
    "gpt2_medium": Spec("gpt2_medium", functools.partial(_hf, "gpt2", 24, 1024, 256, 1), hf=True),
    "llama": Spec("llama", functools.partial(_hf, "llama", 8, 512, 256, 2), hf=True),
    "bert": Spec("bert", functools.partial(_hf, "bert", 12, 768, 256, 2), hf=True),
    "resnet": Spec("resnet", functools.partial(_cnn, "resnet", 32, 8, 32)),
    "unet": Spec("unet", functools.partial(_cnn, "unet", 16, 3, 64), chain=False),
}
QUICK = {
    "gpt": Spec("gpt", functools.partial(_tiny_gpt, 3, 32, 32, 2)),
    "gpt2": Spec("gpt2", functools.partial(_hf, "gpt2", 2, 64, 32, 2), hf=True),
    "llama": Spec("llama", functools.partial(_hf, "llama", 2, 64, 32, 2), hf=True),
    "bert": Spec("bert", functools.partial(_hf, "bert", 2, 64, 32, 2), hf=True),
    "resnet": Spec("resnet", functools.partial(_cnn, "resnet", 8, 3, 16)),
    "unet": Spec("unet", functools.partial(_cnn, "unet", 4, 2, 16), chain=False),
}


@dataclass
class Planner:
    """remat on one model: analysed once, then planned, rewritten and measured per budget."""

    model: nn.Module
    args: tuple[Any, ...]
    ref: peers.Reference
    config: SolverConfig
    solver: str = "auto"

    def __post_init__(self) -> None:
        self.analysis = remat.analyze(self.model, self.args)
        self.problem = self.analysis.problem

    def module(self, plan: Plan) -> nn.Module:
        ex = build_executor(self.analysis.joint, self.problem, plan)
        return RematModule(
            copy.deepcopy(self.model),
            Compiled(self.analysis.captured, ex, self.problem),
            signature(self.args, {}),
            planner=None,  # type: ignore[arg-type]
        )

    def row(self, model: str, kind: str, budget: int, setting: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            plan = solve(self.problem, solver=self.solver, budget_bytes=budget, config=self.config)
        except BudgetError as e:
            return {"model": model, "kind": kind, "method": "remat", "setting": setting,
                    "budget_bytes": budget, "reason": f"below remat's least peak "
                    f"{e.least_peak_bytes:,} B"}  # fmt: skip
        solve_s = time.perf_counter() - t0
        fast = self.module(plan)
        r = peers._row("remat", setting, fast, fast, self.args, self.ref, None)
        # The plan's recompute FLOPs: the same FLOP registry FlopCounterMode uses for the eager
        # peers, over the forward ops the plan runs again (FlopCounterMode's module hooks cannot
        # follow the executor's graphs inside its autograd.Function).
        return {
            "model": model,
            "kind": kind,
            "method": "remat",
            "setting": setting,
            "budget_bytes": budget,
            "peak_bytes": r.peak_bytes,
            "predicted_tensor_peak_bytes": plan.predicted_tensor_peak_bytes,
            "allocator_peak_bytes": r.allocator_peak_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "recompute_flops": plan.recompute_flops,
            "step_flops": self.ref.flops + plan.recompute_flops,
            "solve_s": round(solve_s, 3), "equal": r.equal, "differing": r.differing,
            "reason": plan.reason, "_make_step": functools.partial(self.step, plan),
        }  # fmt: skip

    def step(self, plan: Plan) -> Callable[[], Any]:
        """A fresh module for ``plan`` and its step (built when timing needs it: a model copy
        with gradients held per row did not fit in memory for GPT-2 medium)."""
        return functools.partial(peers.step, self.module(plan), self.args)


StepMaker = Callable[[], Callable[[], Any]]
"""Builds a row's module (a model copy) and returns its step: called when timing the row, so
that one copy at a time is alive besides eager's."""


def _eager_step(make: Callable[[nn.Module], nn.Module], model: nn.Module,
                args: tuple[Any, ...]) -> Callable[[], Any]:  # fmt: skip
    return functools.partial(peers.step, make(model), args)


def peer_rows(spec: Spec, model: nn.Module, args: tuple[Any, ...], ref: peers.Reference,
              quick: bool) -> list[tuple[peers.Row, StepMaker]]:  # fmt: skip
    """Each peer's row and what builds its step for timing."""
    out: list[tuple[peers.Row, StepMaker]] = []
    out.append(
        (peers.eager_row(model, args, ref),
         functools.partial(_eager_step, copy.deepcopy, model, args))
    )  # fmt: skip
    for b in QUICK_TORCH_BUDGETS if quick else TORCH_BUDGETS:
        row = peers.memory_budget_peer(model, args, b, ref)
        out.append((row, functools.partial(peers.memory_budget_step, model, args, b)))
    if spec.hf:
        make = functools.partial(_eager_step, peers.hf_checkpointed, model, args)
        out.append((peers.hf_checkpoint_peer(model, args, ref), make))
    for group in (1, "sqrt") if spec.chain else (1,):
        wrap = functools.partial(peers.block_checkpointed, group=group)
        make = functools.partial(_eager_step, wrap, model, args)
        out.append((peers.block_checkpoint_peer(model, args, ref, group), make))
    return out


def run_model(spec: Spec, n_budgets: int, reps: int, time_limit: float, solver: str,
              quick: bool, console: Console) -> list[dict[str, Any]]:  # fmt: skip
    torch.manual_seed(0)
    model, args = spec.build()
    ref = peers.eager_reference(model, args)
    planner = Planner(model, args, ref, SolverConfig(time_limit_s=time_limit), solver)
    rows: list[dict[str, Any]] = []
    steps: dict[int, StepMaker] = {}
    for row, make in peer_rows(spec, model, args, ref, quick):
        d = {"model": spec.name, "kind": "peer", "method": row.peer, "setting": row.setting,
             **{k: v for k, v in dataclasses.asdict(row).items() if k in COLUMNS}}  # fmt: skip
        d["step_flops"] = None
        steps[len(rows)] = make
        rows.append(d)
        if row.peer != "eager":
            setting = f"{row.peer} {row.setting}"
            matched = planner.row(spec.name, "matched", row.allocator_peak_bytes, setting)
            if "_make_step" in matched:
                steps[len(rows)] = matched.pop("_make_step")
            rows.append(matched)
            _release()
    keep_all = solve(planner.problem, solver="keep_all", budget_bytes=None).predicted_peak_bytes
    lo = least_peak(planner.problem, planner.solver, planner.config)
    for k in range(n_budgets):
        budget = lo + (keep_all - lo) * k // max(1, n_budgets - 1)
        swept = planner.row(spec.name, "sweep", budget, f"{k + 1}/{n_budgets}")
        if "_make_step" in swept:
            steps[len(rows)] = swept.pop("_make_step")
        rows.append(swept)
        _release()
    if reps > 0:
        _time(rows, steps, reps)
    _show(console, spec.name, rows)
    return rows


def _release() -> None:
    """Free the model copies a row leaves behind: a compiled copy stays in a reference cycle
    until the collector runs, and glibc keeps freed heap pages (tensors under its 32 MB mmap
    threshold) mapped: GPT-2 medium's process grew by a model copy per row without this."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _time(rows: list[dict[str, Any]], steps: dict[int, StepMaker], reps: int) -> None:
    """Step time / eager for every row with a step, eager interleaved with each in turn; each
    row's module is built for its turn and dropped after it."""
    eager = steps[0]()
    for i, make in steps.items():
        if i:
            fn = make()
            rows[i]["time_ratio"] = round(peers.time_ratio({"eager": eager, "x": fn}, reps)["x"], 3)
            del fn
            peers.tc.dynamo_reset()  # a partitioner row's compiled graphs
            _release()
    rows[0]["time_ratio"] = 1.0


def _show(console: Console, model: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=model)
    cols = ["kind", "method", "setting", "allocator_peak_bytes", "predicted_peak_bytes",
            "peak_bytes", "recompute_flops", "time_ratio", "equal"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(f"{r[c]:,}" if isinstance(r.get(c), int) and not isinstance(r.get(c), bool)
                        else str(r.get(c, "")) for c in cols))  # fmt: skip
    console.print(table)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    """Recompute FLOPs against measured allocator peak, one marker per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["allocator_peak_bytes"] / 2**20, r["recompute_flops"] / 1e9) for r in rows
               if r["method"] == method and r.get("allocator_peak_bytes")
               and r.get("recompute_flops") is not None]  # fmt: skip
        if pts:
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, "o-" if method == "remat" else "s", label=method, alpha=0.8)
    ax.set_xlabel("measured allocator peak (MiB)")
    ax.set_ylabel("recompute (GFLOP)")
    ax.set_title(rows[0]["model"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 3 budgets, no timing")
    ap.add_argument("--models", default="", help="comma-separated subset")
    ap.add_argument("--budgets", type=int, default=None, help="remat sweep points (5; quick 3)")
    ap.add_argument("--reps", type=int, default=None, help="timing rounds (3; quick 0: none)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="remat's solver time limit")
    ap.add_argument("--solver", default=None, help="remat's solver (auto; quick chen_greedy)")
    ap.add_argument("--out", type=Path, default=None, help="CSV path")
    a = ap.parse_args(argv)
    specs = QUICK if a.quick else MODELS
    names = a.models.split(",") if a.models else list(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; valid: {', '.join(specs)}")
    n_budgets = a.budgets or (3 if a.quick else 5)
    reps = a.reps if a.reps is not None else (0 if a.quick else 3)
    solver = a.solver or ("chen_greedy" if a.quick else "auto")
    warnings.filterwarnings("ignore")
    console = Console(width=150)
    if a.out is None and not a.quick and len(names) > 1:
        # One fresh process per model: a process holding every model's compiled graphs reached
        # 18 of this machine's 24 GiB.
        for name in names:
            child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
            subprocess.run([*_without_models(child), "--models", name], check=True)
        return []
    rows: list[dict[str, Any]] = []  # every model's, returned
    # What exists now (imported modules, a caller's objects) is left out of each row's
    # collection (:func:`_release`): scanning it took a third of a second per row. It stays
    # frozen (gc has no nesting to restore a caller's own freeze); it is alive anyway.
    gc.collect()
    gc.freeze()
    for name in names:
        t0 = time.perf_counter()
        new = run_model(specs[name], n_budgets, reps, a.time_limit, solver, a.quick, console)
        console.print(f"{name}: {time.perf_counter() - t0:.1f} s")
        rows += new
        _write(new, rows, name, a.out, a.quick, console)
    return rows


def _write(new: list[dict[str, Any]], rows: list[dict[str, Any]], name: str, out: Path | None,
           quick: bool, console: Console) -> None:  # fmt: skip
    """--out: one CSV for all, rewritten after each model (a long run keeps its rows); else
    one per model under results/compare[_quick]/. A plot of the model's rows beside it."""
    path = out or RESULTS / ("compare_quick" if quick else "compare") / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(new, path.with_name(f"{path.stem}_{name}.png" if out else f"{name}.png"))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k) for k in COLUMNS} for r in (rows if out else new))
    console.print(f"wrote {path}")


def _without_models(argv: list[str]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--models":
            skip = True
        elif not x.startswith("--models="):
            out.append(x)
    return out


if __name__ == "__main__":
    main()
