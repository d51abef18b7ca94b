"""One plan for every rank of a process group: solved on its first rank, broadcast, checked.

Why: the solvers count work instead of reading the clock (:mod:`remat.solver.clock`), so
ranks that trace the same step plan the same, unless a rank's wall-clock safety net expires;
and a rank whose model, shapes or remat differ plans for another step. Either way the job
would train with several plans, peaks and speeds, and nothing would say so (torchtitan's
auto-AC broadcasts rank 0's plan for the same reason). Here only the group's
first rank solves; the others apply its plan as a plan file, whose fingerprint (the blocks'
op streams with their sizes) must match what they traced, or they raise. It also saves each
other rank the solve."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from remat.plan.files import PlanFileError
from remat.solver.config import BudgetError

FROM_FILE = "loaded from "
"""How the reason of a plan read from a file begins
(:func:`remat.executors.sac.files.solution_from_file`)."""


def group_of(group: Any, pipeline: Any) -> Any:
    """The process group whose ranks must agree: ``group``, or by default the default group
    (none under a pipeline, whose stages plan different modules: pass the stage's
    data-parallel group); None outside ``torch.distributed`` or for one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group= needs torch.distributed initialized (init_process_group)")
        return None
    if group is None:
        if pipeline is not None:
            return None
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def agreed(group: Any, solve: Callable[[Path], None], load: Callable[[Path, int], None]) -> None:
    """``solve(path)`` on the group's first rank (it applies the plan and writes its file
    there); ``load(path, first)`` on every other rank, with that file's contents and the
    first rank's number. An error on the first rank reaches the others: a
    :class:`BudgetError` as itself (the least peak is the group's), any other as a
    :class:`RuntimeError` naming it."""
    first = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    mine = dist.get_rank()
    with tempfile.TemporaryDirectory(prefix="remat-plan-") as folder:
        path = Path(folder) / "plan.json"
        if mine == first:
            try:
                solve(path)
            except BaseException as e:
                _broadcast([None, f"{type(e).__name__}: {e}", _budget_of(e)], first, group)
                raise
            _broadcast([path.read_text(), "", None], first, group)
            return
        text, failure, budget = _broadcast([None, "", None], first, group)
        if budget is not None:  # the same figures on every rank: callers read them
            raise _budget_error(*budget)
        if text is None:
            raise RuntimeError(f"rank {first}, which plans for the group, failed: {failure}")
        path.write_text(text)
        try:
            load(path, first)
        except PlanFileError as e:
            raise PlanFileError(
                f"rank {mine} traced another step than rank {first}, which planned for the "
                f"group (its model, inputs, options or remat differ): {e}"
            ) from None


def _budget_of(e: BaseException) -> tuple[int, int, bool, str] | None:
    """A :class:`BudgetError`'s figures and message, to raise it again on the other ranks."""
    if not isinstance(e, BudgetError):
        return None
    return e.budget_bytes, e.least_peak_bytes, e.achievable, str(e)


def _budget_error(budget: int, least: int, achievable: bool, message: str) -> BudgetError:
    error = BudgetError(budget, least, achievable=achievable)
    error.args = (message,)
    return error


def _broadcast(objects: list[Any], src: int, group: Any) -> list[Any]:
    dist.broadcast_object_list(objects, src=src, group=group)
    return objects


def broadcast_reason(reason: str, first: int) -> str:
    """A loaded plan's reason, naming the rank it came from instead of a temporary file."""
    if not reason.startswith(FROM_FILE):
        return reason
    _, _, rest = reason.partition(" (")
    return f"planned on rank {first} and broadcast to the group ({rest}"


__all__ = ["agreed", "broadcast_reason", "group_of"]
