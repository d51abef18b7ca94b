"""Predicted against measured peak at the allocator and for live tensors, per fixed plan, on the
native zoo (``remat.apply``) and the comparison's models (``remat.optimize``), on this CPU.

    .venv/bin/python experiments/allocator_gap.py                  # native zoo, ~1 minute
    .venv/bin/python experiments/allocator_gap.py --whole resnet,unet,gpt

Each row: plan, predicted and measured allocator peak (profiler) and their gap in bytes,
predicted and measured tensor peak (live-storage meter), bitwise over 2 AdamW steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

import compare  # noqa: E402

from remat.verify import verify  # noqa: E402
from tests.zoo import NATIVE_ZOO  # noqa: E402


def _show(name: str, plan: str, result: object) -> None:
    step = result.steps[-1]  # type: ignore[attr-defined]
    gap = step.measured_peak_bytes - step.predicted_peak_bytes
    print(
        f"{name:16} {plan:13} allocator {step.predicted_peak_bytes:>12,} predicted "
        f"{step.measured_peak_bytes:>12,} measured {gap:+6} B | tensors "
        f"{step.predicted_tensor_peak_bytes:>12,} / {step.measured_tensor_peak_bytes:>12,} | "
        f"bitwise {result.equal}",  # type: ignore[attr-defined]
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--native", default=",".join(c.name for c in NATIVE_ZOO))
    ap.add_argument("--whole", default="", help="models of experiments/compare.py")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for case in NATIVE_ZOO:
        if case.name not in a.native.split(","):
            continue
        torch.manual_seed(0)
        model = case.build()
        for plan in ("keep_all", "keep_matmuls", "block"):
            result = verify(
                model, case.inputs(), example_kwargs=case.kwargs, plan=plan, steps=2, executor="sac"
            )
            _show(f"native {case.name}", plan, result)
    for name in filter(None, a.whole.split(",")):
        torch.manual_seed(0)
        model, args = compare.MODELS[name].build()
        for plan in ("keep_all", "keep_inputs", "keep_matmuls"):
            _show(name, plan, verify(model, args, plan=plan, steps=2))


if __name__ == "__main__":
    main()
