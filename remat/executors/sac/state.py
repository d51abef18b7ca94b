"""What :func:`remat.apply` leaves on a model: its plan and each block's policy.

Kept apart from :mod:`remat.executors.sac.apply` so that reports and the driver can read a model's
plan without importing the planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from remat.executors.sac.offload import Offloads
from remat.executors.sac.regions import Policy
from remat.parallel.pipelining import ScheduleTrace
from remat.solver.plan import Plan

__all__ = ["Applied", "applied", "plan_of"]

_STATE = "_remat_native"


@dataclass(frozen=True, kw_only=True)
class Applied:
    """What ``remat.apply`` left on a model: its plan and the policy of each block."""

    plan: Plan
    blocks: tuple[str, ...]
    policies: tuple[Policy, ...]
    timings: Mapping[str, float]
    """Seconds spent planning (``plan``: tracing the eager step, then every candidate)."""
    use_cache: tuple[str, ...] = ()
    """Paths of the modules whose ``config.use_cache`` ``apply`` turned off."""
    fingerprint: str = ""
    """Of the blocks' op streams (:func:`remat.executors.sac.planner.fingerprint`)."""
    describe: Mapping[str, str] = field(default_factory=dict)
    """Model class, precision and device profile, for the plan file."""
    options: tuple[str, ...] = ()
    """Per block, the menu option the plan chose."""
    eager_peak_bytes: int = 0
    """The traced step's peak with every block eager (no checkpoint)."""
    block_recompute_s: tuple[float, ...] = ()
    """Per block, the estimated time its plan adds: what its backward recomputes and its
    policy's dispatch (:class:`remat.problem.DispatchCosts`)."""
    scratch: str = ""
    """Where the allocator-only bytes (kernel scratch, RNG states) were measured, or why not."""
    schedule: ScheduleTrace | None = None
    """For a pipeline stage, its traced ``schedule.step()`` under the plan."""
    eager_times_s: tuple[float, float] = (0.0, 0.0)
    """Estimated forward and backward time of one step (a pipeline stage: one microbatch)
    with every block eager."""
    eager_schedule: ScheduleTrace | None = None
    """For a pipeline stage, its traced ``schedule.step()`` with every block eager."""
    offloads: Offloads | None = None
    """Where the plan offloads region inputs: their host store (its ``peak_bytes`` is the
    host memory the steps took, which the plan's ``predicted_host_peak_bytes`` predicts)."""


def applied(model: nn.Module) -> Applied:
    """What :func:`apply` left on ``model`` (its plan and the block policies)."""
    state = _find_state(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no remat plan: call remat.apply first")
    return state


def plan_of(model: nn.Module) -> Plan:
    """The plan :func:`apply` applied to ``model`` (also through DDP or compile wrappers)."""
    return applied(model).plan


def _find_state(model: nn.Module) -> Applied | None:
    for m in model.modules():
        state = m.__dict__.get(_STATE)
        if isinstance(state, Applied):
            return state
    return None
