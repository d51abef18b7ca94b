"""The ``remat`` command line, one module per subcommand.

- ``remat plan`` (:mod:`remat.cli.plan`): one plan for a preset, a transformers architecture
  or a factory, under FakeTensors, for the device and parallel layout named.
- ``remat compare`` (:mod:`remat.cli.compare`): every solver side by side.
- ``remat fit`` (:mod:`remat.cli.fit`): the longest sequence and largest batch per plan.
- ``remat demo`` (:mod:`remat.cli.demo`): the built-in model planned every way and run.

``--executor graph|sac|auto`` names the executor a plan is for (:mod:`remat.executors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from remat.cli import compare, demo, fit, plan
from remat.cli.common import executor_of
from remat.cli.compare import compare_command
from remat.cli.demo import demo as demo_command
from remat.cli.fit import fit_command
from remat.cli.plan import plan_command

__all__ = [
    "compare_command",
    "demo_command",
    "executor_of",
    "fit_command",
    "main",
    "plan_command",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="remat", description="Activation-checkpoint plans for PyTorch training steps."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (demo, plan, compare, fit):
        command.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
