"""Benchmark (not a test): how long ``remat plan`` takes to plan Llama-7B and Llama-70B for
``remat.apply`` (the ``sac`` executor) at the scale users run, and what it plans.

Each command runs in a fresh process, as a user runs it (FakeTensors, FSDP2's mixed
precision, ZeRO-3, seq 4096, batch 1, the ``h100`` profile, the default time limit):

- ``llama-7b``: ZeRO-3 x 8, 24 GB per device;
- ``llama-70b``: ZeRO-3 x 64, 80 GB per device.

Per command: wall seconds of the whole command and of the planning alone (the CLI's own
``wall time`` line), the plan file's predicted recompute time and step peak, its solver and
its reason (which says which of the MILP and the chain DP won and how many plans each
traced). Planning is deterministic (counted work, not the clock), so the plan is the same
on any machine; the seconds are this machine's, under whatever else runs on it.
Writes ``experiments/results/plan_time.csv``.

    .venv/bin/python experiments/plan_time.py [--only llama-70b] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rows import save, show

COMMANDS = {
    "llama-7b": "--precision bf16-fsdp --zero-stage 3 --world-size 8 --budget-gb 24",
    "llama-70b": "--precision bf16-fsdp --zero-stage 3 --world-size 64 --budget-gb 80",
}
COMMON = "--executor sac --seq 4096 --batch 1 --device h100"
WALL = re.compile(r"wall time ([\d.]+) s \(plan ([\d.]+) s\)")


def run(model: str, round_: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        args = [model, *COMMANDS[model].split(), *COMMON.split(), "--save", str(path)]
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "remat.cli", "plan", *args],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "COLUMNS": "400"},
        )
        wall = time.perf_counter() - t0
        found = WALL.search(done.stdout)
        doc = json.loads(path.read_text())
    return {
        "model": model,
        "round": round_,
        "wall_s": round(wall, 1),
        "plan_s": float(found.group(2)) if found else "",
        "recompute_ms": round(doc["recompute_time_s"] * 1e3, 3),
        "predicted_peak_bytes": doc["predicted_peak_bytes"],
        "solver": doc["solver"],
        "reason": doc["reason"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(COMMANDS), action="append")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rows = [run(model, r) for r in range(args.rounds) for model in (args.only or list(COMMANDS))]
    show([{k: v for k, v in row.items() if k != "reason"} for row in rows], "remat plan")
    for row in rows:
        print(f"{row['model']}: {row['reason']}")
    print(f"wrote {save(rows, 'plan_time.csv')}")


if __name__ == "__main__":
    main()
