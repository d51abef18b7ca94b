"""Plan files of the ``sac`` executor: a model's plan written with a fingerprint of its
regions' op streams, and read back as the policies it names, checked against the trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from remat.executors.sac import planner, regions
from remat.executors.sac.state import applied
from remat.plan.files import (
    NATIVE,
    PlanFile,
    PlanFileError,
    document,
    load,
    write_document,
)


def file_regions(f: PlanFile, model: nn.Module, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """The regions a native plan file was solved on, where they are regions
    :func:`~remat.executors.sac.passes.plan_step` plans on (the blocks or their sub-modules,
    and modules outside the blocks), in module order (the trace puts them in the order the
    forward runs them, as when it was solved); otherwise the blocks, whose fingerprint then
    says the file is for another model."""
    saved = set(f.record.get("graph", {}).get("blocks", ()))
    split, outside = regions.split_blocks(model, blocks), regions.outside_blocks(model, blocks)
    for inner in (blocks, split):
        if set(inner) <= saved <= set(inner) | set(outside):
            return tuple(p for p in (*inner, *outside) if p in saved)
    return blocks


def save_plan(model: nn.Module, path: str | Path) -> Path:
    """Write ``model``'s plan (from :func:`apply`) as JSON, with a fingerprint of its blocks'
    op streams, for ``remat.apply(model, inputs, plan=path)`` to re-apply without solving."""
    return write_document(plan_document(model), path)


def plan_document(model: nn.Module) -> dict[str, Any]:
    """The plan file's JSON document of ``model``'s plan (:func:`save_plan` writes it)."""
    state = applied(model)
    graph: dict[str, Any] = {"executor": NATIVE, "blocks": list(state.blocks), **state.describe}
    replayed = [
        p
        for p, policy in zip(state.blocks, state.policies, strict=True)
        if isinstance(policy, regions.FullReplay)
    ]
    if replayed:  # regions replayed whole (torchtitan_op): the file runs them so again
        graph["full_replay"] = replayed
    return document(state.plan, state.fingerprint, graph)


def solution_from_file(
    problem: planner.NativeProblem, f: PlanFile, path: str | Path, tracer: Any
) -> planner.Solution:
    f = load(
        path,
        read=f,
        executor=NATIVE,
        fingerprint=planner.fingerprint(problem),
        difference=lambda record: (
            f"other blocks or shapes (regions there: {len(record['graph'].get('blocks', []))}, "
            f"here: {len(problem.blocks)})"
        ),
    )
    try:
        policies = planner.policies_from_saved(problem, f.saved)
    except ValueError as e:
        raise PlanFileError(f"plan file {path}: {e}") from None
    replayed = set(f.record["graph"].get("full_replay", ()))
    policies = tuple(
        regions.FullReplay(policy) if path in replayed and policy is not None else policy
        for path, policy in zip(problem.blocks, policies, strict=True)
    )
    offloaded = {o.value.removesuffix(":inputs") for o in f.offloads}
    offload = tuple(path in offloaded for path in problem.blocks)
    return planner.Solution(
        policies,
        tracer(policies, True, offload if any(offload) else None),
        f.solver.removeprefix("native:"),  # the file records the plan's name, prefixed
        f"loaded from {path} ({f.reason})",
        f.proof,
        tuple("from file" for _ in policies),
    )
