"""Benchmark (not a test): ``remat fit llama-70b`` (the issue's command) timed end to end, as
it runs and with each of its speed-ups turned off, run after run on this machine.

    python experiments/fit_time.py [--rounds 1]

The command: Llama-2-70B (80 blocks) on FakeTensors, ZeRO-3 over 64 ranks, bf16-mixed, batch
1 at seq 4096, an 80 GB budget, the ``sac`` executor; its shapes traced on copies with 4 and 5
blocks (:mod:`remat.fit.deep`) and checked against the 80-block model. Configurations, each
``remat fit`` in a fresh process (``python -m remat.cli``'s whole wall time, startup and
imports included), one after the other:

- ``as it runs``: the default (one forked worker per core);
- ``copies with 5 and 6 blocks``: the wider edges (:data:`remat.fit.deep.WIDE`), as the
  fit took them before it tried the narrower ones;
- ``larger copy traced everywhere``: :func:`remat.fit.deep.increments` returns None, so
  the larger copy is traced at every shape rather than at two per range and synthesized
  from the smaller copy's at the others;
- ``one process``: ``--workers 1`` (the model's analysis and checks then run before the
  copies' traces, not beside them).

Per run: wall seconds, CPU seconds of the process and its children,
and whether the printed table is the first run's (a fit's answer does not depend on how it
was traced). Writes ``experiments/results/fit_time.csv``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import save, show  # noqa: E402

COMMAND = ["fit", "llama-70b", "--budget-gb", "80", "--precision", "bf16-mixed",
           "--zero-stage", "3", "--world-size", "64", "--seq", "4096", "--batch", "1"]  # fmt: skip
TRACED_EVERYWHERE = "import remat.fit.sac_formula as f; f.increments = lambda anchors: None; "
WIDER = "import remat.fit.sac_formula as f; f.EDGES = f.WIDE; "
CONFIGS = {
    "as it runs": ("", []),
    "copies with 5 and 6 blocks": (WIDER, []),
    "larger copy traced everywhere": (TRACED_EVERYWHERE, []),
    "one process": ("", ["--workers", "1"]),
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(prelude: str, extra: list[str]) -> tuple[float, float, str, str]:
    code = f"{prelude}import sys; from remat.cli import main; sys.exit(main(sys.argv[1:]))"
    cpu0, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *COMMAND, *extra], capture_output=True, text=True
    )
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if done.returncode != 0:
        raise SystemExit(f"remat fit failed:\n{done.stderr[-3000:]}")
    table = done.stdout.split("wall time")[0]
    return wall, cpu, table, done.stderr


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    rows, first = [], None
    for k in range(args.rounds):
        for name, (prelude, extra) in CONFIGS.items():
            wall, cpu, table, _ = _run(prelude, extra)
            first = table if first is None else first
            rows.append(
                {
                    "round": k + 1,
                    "configuration": name,
                    "wall_s": round(wall, 1),
                    "cpu_s": round(cpu, 1),
                    "same_table": table == first,
                }  # fmt: skip
            )
            print(rows[-1], flush=True)
    show(rows, "remat fit llama-70b (ZeRO-3 x 64, bf16-mixed, seq 4096, 80 GB)")
    print(save(rows, "fit_time.csv"))


if __name__ == "__main__":
    main()
