"""``remat.explain(model)`` for a model prepared with :func:`remat.apply`: the device's memory
and, per region (a block, or a block's sub-module), what its policy keeps and what its backward recomputes."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from remat.executors.sac.state import Applied
from remat.parallel.pipelining import ScheduleTrace
from remat.plan.memory_table import memory_table
from remat.solver.plan import Plan


def explain_applied(state: Applied, *, width: int = 120) -> str:
    """The report as text (rich tables rendered at ``width`` columns)."""
    plan = state.plan
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False)
    memory = memory_table(
        plan,
        [("step peak, no checkpoint", state.eager_peak_bytes, "every region eager")],
        f"and RNG states {state.scratch}",
    )
    console.print(memory)

    blocks = Table(title="plan by region", title_justify="left")
    offloaded = {o.removesuffix(":inputs") for o in plan.offloaded}
    columns = ("region", "option", "keeps", *(("inputs",) if offloaded else ()), "added ms")
    for col in columns:
        blocks.add_column(col, justify="right" if col == "added ms" else "left")
    options = state.options or ("",) * len(state.blocks)
    times = state.block_recompute_s or (0.0,) * len(state.blocks)
    for path, policy, option, t in zip(state.blocks, state.policies, options, times, strict=True):
        keeps = "everything autograd saves" if policy is None else f"{len(policy)} op outputs"
        where = ("host" if path in offloaded else "device",) if offloaded else ()
        blocks.add_row(path, option, keeps, *where, f"{t * 1e3:.3f}")
    console.print(blocks)
    if state.schedule is not None:
        console.print(_schedule_table(state.schedule))
    sim = plan.simulation
    share = sim.recompute_time_s / sim.step_time_s if sim.step_time_s else 0.0
    dispatch = sim.dispatch_time_s / sim.step_time_s if sim.step_time_s else 0.0
    console.print(
        f"{len(plan.recomputed)} ops recomputed ({sim.recompute_flops / 1e9:,.2f} GFLOP of "
        f"matmuls and attention, {share:.2%} of the estimated step time); selective "
        f"checkpointing's own dispatch {dispatch:.2%} (added ms: both, per region); outside "
        f"the regions: eager.{_copies(plan)} {plan.reason}"
    )
    if plan.step:
        console.print(f"The peak covers {plan.step}.")
    return buf.getvalue()


def _copies(plan: Plan) -> str:
    """The offloaded inputs' line (empty without offload)."""
    if not plan.offloaded:
        return ""
    sim = plan.simulation
    return (
        f" {len(plan.offloaded)} regions' inputs wait in host memory between their forward and "
        f"their backward ({sim.offloaded_bytes:,} B, host peak {sim.host_peak_bytes:,} B; "
        f"{sim.copy_exposed_s * 1e3:.3f} ms of copies not hidden, in the step time)."
    )


def _schedule_table(schedule: ScheduleTrace) -> Table:
    """A pipeline stage's actions as its ``schedule.step()`` ran them under the plan."""
    table = Table(
        title=f"pipeline: {schedule.pipeline.describe()}, at most {schedule.max_in_flight} "
        f"{'microbatch-stage pairs' if schedule.pipeline.stages_per_rank > 1 else 'microbatches'}"
        " in flight",
        title_justify="left",
    )
    for col in ("action", "in flight before", "live tensors at its peak"):
        table.add_column(col, justify="left" if col == "action" else "right")
    top = max(a.peak_bytes for a in schedule.actions)
    for a, name in zip(schedule.actions, schedule.order.split(), strict=True):  # 2F0: stage 2
        mark = "  <- peak" if a.peak_bytes == top else ""
        table.add_row(name, str(a.in_flight), f"{a.peak_bytes:,} B{mark}")
    return table
