"""Figures: the overhead-vs-peak Pareto front of each solver, and a plan's memory timeline.

matplotlib is an optional dependency (``pip install 'remat[plots]'``); it is imported when a
figure is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from remat.solver.plan import Plan


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'remat[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_plot(points: Mapping[str, Sequence[tuple[int, float]]], path: str | Path) -> Path:
    """One curve per solver: (predicted peak bytes, recompute % of the step) at each budget."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # The exact MILP last and widest: where another solver matches it, both stay visible.
    for name, pts in sorted(points.items(), key=lambda kv: (kv[0] == "exact", kv[0])):
        if not pts:
            continue
        xs, ys = zip(*sorted(set(pts)), strict=True)
        exact = name == "exact"
        ax.plot(
            [x / 2**20 for x in xs],
            ys,
            marker="o",
            label=name,
            linewidth=3 if exact else 1.2,
            alpha=0.6 if exact else 1.0,
            zorder=1 if exact else 2,
        )
    return _finish(
        plt, fig, ax, path,
        xlabel="predicted step peak (MiB)",
        ylabel="recompute time (% of the step)",
        title="memory vs recompute, per solver",
    )  # fmt: skip


def timeline_plot(plans: Mapping[str, Plan], path: str | Path) -> Path:
    """Live bytes over the step's execution order, one line per plan, recomputations marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, plan in plans.items():
        steps = plan.simulation.timeline
        ys = [s.allocated_bytes / 2**20 for s in steps]
        (line,) = ax.plot(range(len(ys)), ys, label=f"{name} (peak {max(ys):,.1f} MiB)")
        rec = [i for i, s in enumerate(steps) if s.recompute]
        if rec:
            ax.scatter(rec, [ys[i] for i in rec], s=4, color=line.get_color(), alpha=0.6)
    return _finish(
        plt, fig, ax, path,
        xlabel="step of the executor (forward, then backward with recomputations dotted)",
        ylabel="allocated (MiB)",
        title="memory timeline",
    )  # fmt: skip


def _finish(
    plt: Any, fig: Any, ax: Any, path: str | Path, *, xlabel: str, ylabel: str, title: str
) -> Path:
    """Labels, grid and legend, then write the PNG and free the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def fit_plot(
    curves: Mapping[str, Sequence[tuple[int, int]]],
    budget_bytes: int,
    path: str | Path,
    title: str = "",
) -> Path:
    """Device bytes against sequence length, one curve per plan, and the budget line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, [y / 1e9 for y in ys], label=name)
    ax.axhline(budget_bytes / 1e9, color="black", linestyle="--", label="budget")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("device memory (GB) at the step's peak")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
