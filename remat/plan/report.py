"""What a plan does, in a practitioner's terms: the device's memory and the plan by module.

``remat.explain(module)`` (or ``module.report()``) prints two tables. The first is the
whiteboard sum: parameters, gradients, optimizer state, the step's activations with everything
kept and as planned, the reserve, and the total against the budget. The second groups the plan
by module path with layer indices folded (``blocks.*.attn``): what each kind of module keeps
for the backward and what it recomputes, and the recompute time.
"""

from __future__ import annotations

import io
import re
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rich.console import Console
from rich.table import Table

from remat.budget import format_bytes as _bytes
from remat.executors.sac.report import explain_applied
from remat.executors.sac.state import applied
from remat.plan.memory_table import memory_table as device_memory_table
from remat.problem import Problem, Role
from remat.solver.fixed import fixed_saved_set
from remat.solver.plan import Plan, Proof, make_plan

if TYPE_CHECKING:
    from torch import nn

_INDEX = re.compile(r"(^|\.)\d+(?=\.|$)")


def module_group(path: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn``; empty -> ``(top level)``."""
    return _INDEX.sub(r"\1*", path) if path else "(top level)"


def _op(name: str) -> str:
    return name.removeprefix("aten.").split(".")[0]


def memory_table(plan: Plan, problem: Problem) -> Table:
    keep_all = make_plan(
        problem, fixed_saved_set(problem, "keep_all"), solver="", reason="", proof=Proof.HEURISTIC
    )
    grads = problem.storages_bytes(
        s for g in problem.grad_outputs for s in problem.by_name[g].storages
    )
    held = "inside the step peak" if problem.grads_held else "released as produced (ZeRO >= 2)"
    rows = [
        ("gradients", grads, held),
        ("step peak, keep all", keep_all.predicted_peak_bytes, "what eager autograd would need"),
    ]
    return device_memory_table(plan, rows, str(problem.metadata.get("scratch", "")))


def plan_table(plan: Plan, problem: Problem) -> Table:
    values = problem.by_name
    saved: dict[str, Counter[str]] = defaultdict(Counter)
    saved_bytes: Counter[str] = Counter()
    recomputed: dict[str, Counter[str]] = defaultdict(Counter)
    time_s: defaultdict[str, float] = defaultdict(float)
    counted: set[str] = set()
    for n in sorted(plan.saved, key=problem.index.__getitem__):
        v = values[n]
        held = [s for s in v.storages if s in problem.storage_bytes]
        if not held:
            continue  # a view of a parameter or input: kept for free
        group = module_group(v.module_path)
        saved[group][_op(v.op)] += 1
        saved_bytes[group] += problem.storages_bytes(s for s in held if s not in counted)
        counted.update(held)
    for n in plan.recomputed:
        v = values[n]
        if not v.allocates and v.time_s == 0:
            continue  # views and tuple projections: free
        group = module_group(v.module_path)
        recomputed[group][_op(v.op)] += 1
        time_s[group] += v.time_s
    step = plan.simulation.step_time_s
    table = Table(title=f"plan {plan.solver!r} by module", title_justify="left")
    for col in ("module", "kept for backward", "kept bytes", "recomputed", "recompute %"):
        table.add_column(col, justify="right" if "%" in col or "bytes" in col else "left")
    for group in sorted(set(saved) | set(recomputed)):
        table.add_row(
            group,
            _counts(saved[group]),
            _bytes(saved_bytes[group]),
            _counts(recomputed[group]) or "-",
            f"{100 * time_s[group] / step:.2f}" if step else "-",
        )
    return table


def _counts(c: Counter[str], top: int = 4) -> str:
    items = c.most_common()
    text = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in items[:top])
    return text + (f", +{len(items) - top} more" if len(items) > top else "")


def explain_plan(plan: Plan, problem: Problem, *, width: int = 120) -> str:
    """The report as text (rich tables rendered at ``width`` columns)."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False)
    sim = plan.simulation
    console.print(memory_table(plan, problem))
    console.print(plan_table(plan, problem))
    forward = [v for v in problem.values if v.role is Role.FORWARD]
    console.print(
        f"{len(plan.saved)} of {len(forward)} forward values kept, "
        f"{len(plan.recomputed)} recomputed ({sim.recompute_flops / 1e9:,.2f} GFLOP): recompute "
        f"{100 * sim.recompute_time_s / sim.step_time_s:.2f}% of the step on the "
        f"{problem.device_profile!r} profile; predicted step peak "
        f"{_bytes(plan.predicted_peak_bytes)}; {plan.proof_text}. {plan.reason}"
        if sim.step_time_s
        else plan.reason
    )
    if plan.offloaded:
        console.print(
            f"{len(plan.offloaded)} saved values offloaded to host memory "
            f"({_bytes(plan.offloaded_bytes)}; host peak "
            f"{_bytes(plan.predicted_host_peak_bytes)}), their copies exposing "
            f"{sim.copy_exposed_s * 1e3:.3f} ms of the predicted {sim.step_time_s * 1e3:.3f} ms "
            f"step: {', '.join(plan.offloaded[:8])}{' ...' if len(plan.offloaded) > 8 else ''}."
        )
    if plan.step:
        console.print(f"The peak covers {plan.step}.")
    return buf.getvalue()


@runtime_checkable
class Explainable(Protocol):
    """A module that reports its own plan (:class:`remat.RematModule`)."""

    def explain_text(self, width: int = 120) -> str: ...


def explain(module: nn.Module, *, width: int = 120) -> str:
    """Print and return the report of ``module``'s plan (see the module docstring): a
    :class:`RematModule` from :func:`remat.optimize`, or a model :func:`remat.apply` wrapped."""
    if isinstance(module, Explainable):
        text = module.explain_text(width=width)
    else:
        text = explain_applied(applied(module), width=width)
    print(text, end="")
    return text
