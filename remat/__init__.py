"""remat: automatic activation-checkpoint planning for PyTorch training.

fast = remat.optimize(model, example_inputs, budget_gb=40)   # the whole device
loss_fn(fast(*batch)).backward()   # same gradients as model, the plan's memory peak
print(fast.plan.summary())

remat.apply(model, example_inputs, budget_gb=40)   # or: SAC policies on model's own blocks
print(remat.plan_of(model).summary())              # then fully_shard / DDP, then compile
"""

from remat._torch_compat import fake_mode
from remat._version import __version__ as __version__
from remat.api import optimize
from remat.budget import DeviceBudgetError, StaticMemoryError
from remat.formula import MemoryFormula, memory_formula
from remat.graph.capture import CaptureError
from remat.graph.profiles import DeviceProfile
from remat.meter import LiveMemoryMeter, measure_step
from remat.native.api import apply, save_plan, unapply
from remat.native.events import TraceError
from remat.native.pipeline_plan import PipelinePlan, plan_pipeline
from remat.native.pipelining import Pipeline, PipelineError
from remat.native.regions import BlockError
from remat.native.state import plan_of
from remat.pipeline import Analysis, BudgetError, analyze
from remat.pipeline_fit import fit_pipeline
from remat.planfile import PlanFileError
from remat.problem import Problem
from remat.report import explain
from remat.request import Request
from remat.rewrite.module import RematModule
from remat.solver.plan import Plan

__all__ = [
    "Analysis",
    "BlockError",
    "BudgetError",
    "CaptureError",
    "DeviceBudgetError",
    "DeviceProfile",
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
