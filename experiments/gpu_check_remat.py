"""remat's promises on the device a plan runs on: one prepared script for a lent GPU.

    OUT=<dir> python experiments/gpu_check_remat.py            # CUDA: ~3-5 min on an H200
    python experiments/gpu_check_remat.py --quick               # tiny models (CI runs this on CPU)

For each model (the comparison's, :mod:`compare`: GPT, Llama, ResNet, U-Net, and the test
zoo's grouped-query and MoE decoders, ``zoo:qwen2_gqa_loss`` and ``zoo:mixtral_moe``, by
default; any ``zoo:NAME`` of ``tests/zoo.py``; fp32, dropout on), one training step as :func:`remat.measure.meter.training_step` defines it, on CUDA when
there is one, else on the CPU:

* eager, and the peers a user would pick instead: ``torch.utils.checkpoint`` around every block,
  and Hugging Face's every-layer checkpointing on HF models;
* remat's whole-graph plans (:func:`remat.optimize`: ``keep_all``, ``keep_matmuls``, and
  ``auto`` at the every-block peer's measured allocator peak) and native plans
  (:func:`remat.apply`: ``block`` and ``auto`` at the same peak), each planned on the device.

Each row: predicted peak (allocator level) and predicted tensor peak; measured allocator peak
above the memory at the step's start (CUDA: ``torch.cuda.max_memory_allocated``, CPU: the
profiler), the caching allocator's reserved peak (CUDA), the live-storage meter's peak; outputs
and gradients ``torch.equal`` to eager's (CUDA: deterministic algorithms); step time over eager
(interleaved, median). Writes ``gpu_check_remat[_quick].json`` to ``$OUT`` (or
``experiments/results/``). Rows that fail keep their error and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Deterministic cuBLAS needs this before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import compare  # noqa: E402
import peers  # noqa: E402

import remat  # noqa: E402
from remat.measure.meter import LiveMemoryMeter, measure_step, training_step  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODELS = ("gpt", "llama", "resnet", "unet", "zoo:qwen2_gqa_loss", "zoo:mixtral_moe")
QUICK_MODELS = ("gpt", "resnet")


@dataclass(frozen=True)
class ZooSpec:
    """A case of ``tests/zoo.py`` as the comparison's specs are used here."""

    case: Any
    hf: bool = False
    """Hugging Face's switch is for the HF model at the top; zoo cases may wrap one."""

    def build(self) -> tuple[nn.Module, tuple[Any, ...]]:
        if self.case.kwargs:
            raise ValueError(f"zoo case {self.case.name} takes keyword inputs: not supported")
        return self.case.build().train(), self.case.inputs()


def spec_of(name: str, quick: bool) -> Any:
    """A model of the comparison (``gpt``, ...) or of the test zoo (``zoo:NAME``)."""
    if name.startswith("zoo:"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests import zoo

        cases = {c.name: c for c in (*zoo.ZOO, *zoo.GQA_ZOO, *zoo.NATIVE_ZOO)}
        return ZooSpec(cases[name.removeprefix("zoo:")])
    return (compare.QUICK if quick else compare.MODELS)[name]


def _to(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _clear(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def measured(module: nn.Module, args: tuple[Any, ...], seed: int = 0) -> dict[str, Any]:
    """One step from cleared gradients: its peaks, outputs and gradients."""
    _clear(module)
    torch.manual_seed(1000 + seed)
    device = next(module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        with LiveMemoryMeter() as meter:
            outputs = training_step(module, args, seed=seed)
        torch.cuda.synchronize()
        peaks = {
            "allocator_peak_bytes": torch.cuda.max_memory_allocated() - base,
            "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
            "reserved_at_start_bytes": base_reserved,
            "tensor_peak_bytes": meter.peak_bytes,
        }
    else:
        step = measure_step(module, args, seed=seed, allocator=True)
        outputs = step.outputs
        peaks = {
            "allocator_peak_bytes": step.allocator_peak_bytes,
            "reserved_peak_bytes": None,
            "reserved_at_start_bytes": None,
            "tensor_peak_bytes": step.peak_bytes,
        }
    grads = [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]
    return {**peaks, "outputs": outputs, "grads": grads}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    pairs = list(zip(a["outputs"], b["outputs"], strict=True))
    pairs += list(zip(a["grads"], b["grads"], strict=True))
    return all((x is None) == (y is None) and (x is None or torch.equal(x, y)) for x, y in pairs)


def _timed(module: nn.Module, args: tuple[Any, ...]) -> Callable[[], Any]:
    def run() -> None:
        _clear(module)
        training_step(module, args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return run


def check_model(
    name: str, spec: Any, device: torch.device, args_: argparse.Namespace
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, args = spec.build()
    model = model.to(device)
    args = _to(args, device)
    rows: list[dict[str, Any]] = []
    steps: dict[str, Callable[[], Any]] = {}
    eager_model = copy.deepcopy(model)
    eager = measured(eager_model, args)
    steps["eager"] = _timed(eager_model, args)
    rows.append({"model": name, "method": "eager", **_peaks(eager), "equal": True})

    every_block = peers.block_checkpointed(model, group=1)
    peer = measured(every_block, args)
    rows.append({"model": name, "method": "torch_checkpoint every block", **_peaks(peer),
                 "equal": _equal(eager, peer)})  # fmt: skip
    steps[rows[-1]["method"]] = _timed(every_block, args)
    if spec.hf:
        hf = peers.hf_checkpointed(model)
        got = measured(hf, args)
        rows.append({"model": name, "method": "hf every layer", **_peaks(got),
                     "equal": _equal(eager, got)})  # fmt: skip
        steps[rows[-1]["method"]] = _timed(hf, args)

    target = peer["allocator_peak_bytes"]
    limit = {"time_limit_s": args_.time_limit}
    plans: list[tuple[str, Callable[[nn.Module], nn.Module]]] = [
        ("remat keep_all", lambda m: remat.optimize(m, args, plan="keep_all")),
        ("remat keep_matmuls", lambda m: remat.optimize(m, args, plan="keep_matmuls")),
        ("remat auto at every-block peak",
         lambda m: remat.optimize(m, args, activation_budget_bytes=target, **limit)),
        ("native block", lambda m: remat.apply(m, args, plan="block")),
        ("native auto at every-block peak",
         lambda m: remat.apply(m, args, activation_budget_bytes=target, **limit)),
    ]  # fmt: skip
    for method, make in plans:
        row: dict[str, Any] = {"model": name, "method": method}
        try:
            t0 = time.perf_counter()
            fast = make(copy.deepcopy(model))
            row["plan_s"] = round(time.perf_counter() - t0, 2)
            plan = fast.plan if hasattr(fast, "plan") else remat.plan_of(fast)
            row["predicted_peak_bytes"] = plan.predicted_peak_bytes
            row["predicted_tensor_peak_bytes"] = plan.predicted_tensor_peak_bytes
            row["recompute_flops"] = plan.recompute_flops
            got = measured(fast, args)
            row.update(_peaks(got))
            row["equal"] = _equal(eager, got)
            row["gap_bytes"] = row["allocator_peak_bytes"] - row["predicted_peak_bytes"]
            steps[method] = _timed(fast, args)
        except Exception as e:  # noqa: BLE001 - a lent device's minutes: record and go on
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=4)
        rows.append(row)
    if args_.reps > 0:
        ratios = peers.time_ratio(steps, args_.reps)
        for row in rows:
            if row["method"] in ratios:
                row["time_ratio"] = round(ratios[row["method"]], 3)
    return rows


def _peaks(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k.endswith("_bytes")}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models (checks, not figures)")
    ap.add_argument("--models", default="", help="comma-separated subset of the comparison's")
    ap.add_argument("--reps", type=int, default=None, help="timing rounds (3; quick 0)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="solver seconds per plan")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    a = ap.parse_args(argv)
    a.reps = a.reps if a.reps is not None else (0 if a.quick else 3)
    names = a.models.split(",") if a.models else list(QUICK_MODELS if a.quick else DEFAULT_MODELS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "quick": a.quick}  # fmt: skip
    rows: list[dict[str, Any]] = []
    stem = "gpu_check_remat_quick" if a.quick else "gpu_check_remat"
    out = a.out or Path(os.environ.get("OUT") or RESULTS) / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        rows += check_model(name, spec_of(name, a.quick), device, a)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        out.write_text(
            json.dumps({"info": info, "rows": rows}, indent=1)
        )  # a partial run keeps its rows
    for r in rows:
        cells = [r["model"], r["method"], r.get("predicted_peak_bytes", ""),
                 r.get("allocator_peak_bytes", ""), r.get("gap_bytes", ""),
                 r.get("reserved_peak_bytes", ""), r.get("equal", ""), r.get("time_ratio", ""),
                 r.get("error", "")]  # fmt: skip
        print(" | ".join(str(c) for c in cells))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
