"""The device-memory table both executors' reports print: what is held across steps, the
step's own rows, its peak as planned (at the allocator and for tensors), the reserve and the
total against the budget."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from remat.budget import format_bytes
from remat.solver.plan import Plan

Row = tuple[str, int, str]
"""``(what, bytes, note)``."""


def memory_table(plan: Plan, step_rows: Sequence[Row], scratch: str) -> Table:
    """``step_rows``: the executor's own rows before the planned peak (gradients, the peak
    without checkpointing); ``scratch``: where kernel scratch was measured."""
    mem = plan.device_memory
    table = Table(title="memory per device", title_justify="left")
    table.add_column("what")
    table.add_column("bytes", justify="right")
    table.add_column("note")
    rows: list[Row] = []
    if mem is not None:
        rows.append(("parameters", mem["parameters"], "held across steps"))
        rows.append(("optimizer state", mem["optimizer_state"], "held across steps"))
        if mem["gradient_shards"]:
            rows.append(("gradient shards", mem["gradient_shards"], "ZeRO >= 2"))
    rows.extend(step_rows)
    sim = plan.simulation
    rows.append(
        ("step peak, planned", plan.predicted_peak_bytes, f"at the allocator, at {sim.peak_step}")
    )
    rows.append(
        (
            "step peak, tensors only",
            plan.predicted_tensor_peak_bytes,
            f"live storages at their own peak; kernel scratch {scratch}",
        )
    )
    if mem is not None:
        rows.append(("reserve", mem["reserve"], "allocator, workspaces, buffers"))
    for what, n, note in rows:
        table.add_row(what, format_bytes(n), note)
    if mem is not None:
        fits = "fits" if mem["total"] <= mem["budget"] else "OVER"
        table.add_row(
            "total", format_bytes(mem["total"]), f"{fits}: budget {format_bytes(mem['budget'])}",
            style="bold",
        )  # fmt: skip
    return table
