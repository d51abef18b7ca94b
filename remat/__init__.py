"""remat: automatic activation-checkpoint planning for PyTorch training.

fast = remat.optimize(model, example_inputs, budget_gb=40)   # the whole device
loss_fn(fast(*batch)).backward()   # same gradients as model, the plan's memory peak
print(fast.plan.summary())

remat.apply(model, example_inputs, budget_gb=40)   # or: SAC policies on model's own blocks
print(remat.plan_of(model).summary())              # then fully_shard / DDP, then compile
"""

from remat import _aliases
from remat._torch_compat import fake_mode
from remat._version import __version__ as __version__
from remat.budget import DeviceBudgetError, StaticMemoryError
from remat.executors.graph.analyze import Analysis, BudgetError, analyze
from remat.executors.graph.capture import CaptureError
from remat.executors.graph.module import RematModule
from remat.executors.graph.optimize import optimize
from remat.executors.sac.apply import apply, save_plan, unapply
from remat.executors.sac.events import TraceError
from remat.executors.sac.regions import BlockError
from remat.executors.sac.state import plan_of
from remat.fit.formula import MemoryFormula, memory_formula
from remat.fit.pipeline import fit_pipeline
from remat.measure.meter import LiveMemoryMeter, measure_step
from remat.measure.profiles import DeviceProfile
from remat.parallel.pipeline_plan import PipelinePlan, plan_pipeline
from remat.parallel.pipelining import Pipeline, PipelineError
from remat.plan.files import PlanFileError
from remat.plan.report import explain
from remat.problem import Link, Problem
from remat.request import Request
from remat.solver.plan import Plan

_aliases.install()


def __getattr__(name: str) -> object:
    """Modules under their old names (``remat.native``, ``remat.api``), for one release."""
    module = _aliases.old_module(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    return module


__all__ = [
    "Analysis",
    "BlockError",
    "BudgetError",
    "CaptureError",
    "DeviceBudgetError",
    "DeviceProfile",
    "Link",
    "LiveMemoryMeter",
    "MemoryFormula",
    "Pipeline",
    "PipelineError",
    "PipelinePlan",
    "Plan",
    "PlanFileError",
    "Problem",
    "RematModule",
    "Request",
    "StaticMemoryError",
    "TraceError",
    "analyze",
    "apply",
    "explain",
    "fake_mode",
    "fit_pipeline",
    "measure_step",
    "memory_formula",
    "optimize",
    "plan_pipeline",
    "plan_of",
    "save_plan",
    "unapply",
]
