"""Benchmark (not a test): what a host budget buys ``remat.apply``'s plans at scale, predicted.

Llama 3 8B, seq 8192, batch 1, FSDP2's mixed precision, ZeRO-3 x 8, the ``h100`` profile
(its PCIe Gen5 link), planned on FakeTensors with ``remat plan --executor sac --json`` in a
fresh process per command, at device budgets from tight to roomy, each without a host budget
and with 64 GB per rank: the predicted step time, its recompute and exposed copy time, the
bytes offloaded (checkpointed blocks' inputs), the host peak, the device peak, and the
planning seconds. Every figure is remat's prediction (the device peak is the traced one,
which the CPU tests measure; the times are the profile's roofline and link rates: no GPU
ran). Writes ``experiments/results/offload.csv``.

    .venv/bin/python experiments/offload.py [--budgets 32 36 40 44] [--host-gb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from rows import save, show

COMMON = (
    "llama3-8b --executor sac --precision bf16-fsdp --zero-stage 3 --world-size 8 "
    "--seq 8192 --batch 1 --device h100 --json"
)


def run(budget_gb: float, host_gb: float) -> dict[str, object]:
    args = [*COMMON.split(), "--budget-gb", str(budget_gb)]
    if host_gb:
        args += ["--host-budget-gb", str(host_gb)]
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "remat.cli", "plan", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    wall = time.perf_counter() - t0
    row: dict[str, object] = {"budget_gb": budget_gb, "host_gb": host_gb, "wall_s": round(wall)}
    if done.returncode:
        fields = ("step_ms", "recompute_ms", "copy_exposed_ms", "offloaded_gb", "host_peak_gb",
                  "step_peak_gb")  # fmt: skip
        return {**row, **dict.fromkeys(fields, ""), "error": _why(done.stderr)}
    doc = json.loads(done.stdout)
    return {
        **row,
        "step_ms": round(doc["step_time_s"] * 1e3, 2),
        "recompute_ms": round(doc["recompute_time_s"] * 1e3, 2),
        "copy_exposed_ms": round(doc["copy_exposed_s"] * 1e3, 3),
        "offloaded_gb": round(doc["offloaded_bytes"] / 1e9, 3),
        "host_peak_gb": round(doc["predicted_host_peak_bytes"] / 1e9, 3),
        "step_peak_gb": round(doc["predicted_peak_bytes"] / 1e9, 3),
        "error": "",
    }


def _why(stderr: str) -> str:
    """The refusal in one line: the device total the least step needs, or the last line."""
    text = " ".join(stderr.split())
    found = re.search(r"the device needs at least ([\d.]+ GB)", text)
    return f"does not fit: needs {found[1]}" if found else text[-200:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[32.0, 36.0, 40.0, 44.0])
    parser.add_argument("--host-gb", type=float, default=64.0)
    args = parser.parse_args()
    rows = [run(b, h) for b in args.budgets for h in (0.0, args.host_gb)]
    show(rows, "remat plan llama3-8b --executor sac, without and with a host budget")
    print(f"wrote {save(rows, 'offload.csv')}")


if __name__ == "__main__":
    main()
