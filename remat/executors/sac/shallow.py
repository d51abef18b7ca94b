"""The chain DP's uniform plans of a deep stack, costed on two shallow copies of the model.

The chain DP reads its per-region costs from one trace per option of the menu, that option
on every region (:func:`remat.executors.sac.planner.uniform_plans`): 11 traces of the whole step.
With one policy on every region, a deep stack's step is determined by copies with
:data:`SHALLOW` regions (:mod:`remat.fit.deep`), so each option is
traced on the copies instead, at a fraction of the cost (a 32-block Llama: ~0.5 s for both
copies against ~3 s for the model). The copies are the model with the ModuleList that holds
its blocks cut short; its other modules are shared, not copied (the trace copies what it
runs onto FakeTensors).

Nothing here is trusted unchecked: the copies' steps must match op for op
(:func:`remat.fit.deep.deep_costs`), and the eager option's costs and peak must be those
of the model's own eager trace, to the byte; the caller traces every plan it may return on
the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from remat import _torch_compat as tc
from remat.executors.sac.events import StepTrace
from remat.executors.sac.regions import STACKS
from remat.fit.deep import WIDE, deep_costs, deep_sample
from remat.fit.workers import Mapped, mapped
from remat.solver.chain_dp import ChainCosts
from remat.solver.formula import FitError

__all__ = ["MIN_REGIONS", "SHALLOW", "Copy", "UniformCosts", "truncated", "uniform_costs"]

SHALLOW = WIDE.copies
"""Regions of the two copies: two at each end taken as differing from the middle ones
(:data:`remat.fit.deep.WIDE`), the layout this path has been checked with; the fit's
copies try narrower edges first (:data:`remat.fit.deep.EDGES`)."""
MIN_REGIONS = sum(SHALLOW) + 1
"""Regions from which the copies' two steps cost less than one of the model's."""

FORK_WORK_S = 3.0
"""With the worker count automatic, the uniform plans are traced on forked workers where
they would take this long or more here (a 70B Llama's copies: ten plans of about a second;
a fork of the analysed process costs a fraction of one)."""

Copy = Callable[[nn.Module, tuple[str, ...], tuple[str, ...]], Callable[[str], StepTrace]]
"""Analyzes a copy (the model, its regions, its FSDP2 units) and returns how to trace it
under one of its uniform plans, by the plan's name (its menu must be the model's)."""

UniformCosts = Callable[[Sequence[str]], Mapped]
"""Per uniform plan (by name, in menu order): the model's chain costs and peak under it,
started at the call (on forked workers where they pay, so the caller can solve meanwhile)
and read in order; closing it stops the workers."""


def _stack(model: nn.Module, regions: Sequence[str]) -> str:
    """Path of the ModuleList (or ModuleDict, as torchtitan holds its layers) whose
    children are the regions between the outside ones."""
    lists = [p for p, m in model.named_modules() if isinstance(m, STACKS) and p]
    if not lists:
        raise FitError("no ModuleList holds the regions")
    path = max(lists, key=lambda p: sum(r.startswith(p + ".") for r in regions))
    inside = [k for k, r in enumerate(regions) if r.startswith(path + ".")]
    if not inside:
        raise FitError("no ModuleList holds the regions")
    names = [regions[k][len(path) + 1 :] for k in inside]
    if names != [str(i) for i in range(len(names))] or inside != list(
        range(inside[0], inside[0] + len(inside))
    ):
        raise FitError(f"the regions inside {path} are not its children 0, 1, ... in order")
    return path


def truncated(
    model: nn.Module, regions: Sequence[str], keep: int
) -> tuple[nn.Module, tuple[str, ...]]:
    """``model`` with the ModuleList holding ``regions`` cut to its first ``keep`` children,
    and the regions that remain. The modules on the path to the list are shallow copies
    with their own child dictionaries; everything else is the model's own."""
    path = _stack(model, regions)
    *parents, name = path.split(".")
    root = new = tc.module_shell(model)
    for part in parents:
        child = tc.module_shell(new.get_submodule(part))
        new.register_module(part, child)
        new = child
    stack = new.get_submodule(name)
    if isinstance(stack, nn.ModuleDict):
        new.register_module(name, nn.ModuleDict(dict(list(stack.items())[:keep])))
    else:
        assert isinstance(stack, nn.ModuleList)
        new.register_module(name, nn.ModuleList(list(stack)[:keep]))
    return root, _kept(regions, path, keep)


def _kept(paths: Sequence[str], stack: str, keep: int) -> tuple[str, ...]:
    """``paths`` but those under the stack's children from ``keep`` on."""
    return tuple(
        p
        for p in paths
        if not p.startswith(stack + ".") or int(p[len(stack) + 1 :].split(".")[0]) < keep
    )


def uniform_costs(
    model: nn.Module,
    regions: tuple[str, ...],
    units: tuple[str, ...],
    analyzed: Copy,
    workers: int | None = None,
) -> UniformCosts | None:
    """The costs of the uniform plans of ``model`` (with ``regions``, FSDP2 ``units``) from
    its two copies, analyzed with ``analyzed`` on first use; None where the regions are not
    a ModuleList's children. Its calls raise :class:`FitError` where the copies are no stack
    of equal blocks (and whatever the copies' traces raise). ``workers``: processes tracing
    the plans at once (:func:`remat.fit.workers.mapped`; None: one per core where the
    traces take long; a 70B Llama's eleven plans on its copies: 11 s on one core)."""
    try:
        path = _stack(model, regions)
    except FitError:
        return None
    outside = sum(not r.startswith(path + ".") for r in regions)
    tracers: list[Callable[[str], StepTrace]] = []

    def costs(names: Sequence[str]) -> Mapped:
        if not tracers:
            for n in SHALLOW:
                copy_, kept = truncated(model, regions, n - outside)
                if len(kept) != n:
                    raise FitError(f"the copy has {len(kept)} regions, not {n}")
                tracers.append(analyzed(copy_, kept, _kept(units, path, n - outside)))
        return mapped(one, [(name,) for name in names], workers, min_work_s=FORK_WORK_S)

    def one(name: str) -> tuple[ChainCosts, int]:
        small, large = (trace(name) for trace in tracers)
        layers = len(regions)
        peak = deep_sample(small, large, layers, WIDE).peak
        return deep_costs(small, large, layers, WIDE), peak

    return costs
