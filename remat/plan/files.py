"""Plan files: a plan as JSON, tied to the graph it was solved for.

A plan names joint-graph nodes, so it only means something for the graph it was solved on. The
file records a fingerprint of that graph (every value's name, role, op, inputs, shape and the
bytes it allocates; not op costs, which vary with the device profile and, for ``cpu``, from run
to run), the torch and remat versions, and what the plan decided and predicted. Loading checks
the fingerprint against the model at hand and refuses a mismatch with the first differences.
The file doubles as the audit record of what was recomputed and why.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from remat._version import __version__
from remat.problem import Problem
from remat.solver.offload import Offload
from remat.solver.plan import Plan, Proof, make_plan

FORMAT = "remat-plan"
VERSION = 1
GRAPH = "graph"
"""``graph.executor`` of remat.optimize's plan files (absent in files written before it was
recorded)."""
NATIVE = "native-sac"
"""``graph.executor`` of a plan made by :func:`remat.apply`."""


class PlanFileError(ValueError):
    """A plan file that cannot be used: unreadable, corrupt, or solved for another graph."""


def _value_records(problem: Problem) -> list[list[Any]]:
    return [
        [
            v.name,
            v.role.value,
            v.op,
            list(v.inputs),
            list(v.shape),
            [problem.storage_bytes[s] for s in v.allocates],
        ]
        for v in problem.values
    ]


def fingerprint(problem: Problem) -> str:
    """A hash of the graph's structure and sizes (not of its costs)."""
    body = {
        "values": _value_records(problem),
        "user_outputs": list(problem.user_outputs),
        "mutation_outputs": list(problem.mutation_outputs),
        "grad_outputs": list(problem.grad_outputs),
        "grads_held": problem.grads_held,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class PlanFile:
    """What a plan file holds."""

    fingerprint: str
    saved: frozenset[str]
    solver: str
    reason: str
    proof: Proof
    """The plan's :class:`Proof`; :attr:`Proof.HEURISTIC` (no claim) for files written before
    plans recorded it."""
    torch_version: str
    remat_version: str
    record: Mapping[str, Any]
    """The whole JSON document."""
    offloads: tuple[Offload, ...] = ()
    """Saved values offloaded, and their points (none in files written before offload)."""


def plan_document(plan: Plan, problem: Problem) -> dict[str, Any]:
    graph = {"values": len(problem.values), "device_profile": problem.device_profile}
    return document(plan, fingerprint(problem), {**graph, **dict(problem.metadata)})


def document(plan: Plan, fingerprint: str, graph: Mapping[str, Any]) -> dict[str, Any]:
    """A plan file's JSON: ``fingerprint`` identifies what it was solved for, ``graph``
    describes it (``executor``: ``native-sac`` for :func:`remat.apply`'s plans)."""
    sim = plan.simulation
    return {
        "format": FORMAT,
        "version": VERSION,
        "remat_version": __version__,
        "torch_version": torch.__version__,
        "fingerprint": fingerprint,
        "graph": dict(graph),
        "solver": plan.solver,
        "reason": plan.reason,
        "proof": plan.proof.value,
        "saved": sorted(plan.saved),
        "recomputed": list(plan.recomputed),
        "decisions": dict(sorted(plan.decisions.items())),
        "predicted_peak_bytes": sim.peak_bytes,
        "peak_step": sim.peak_step,
        "saved_bytes": sim.saved_bytes,
        "recompute_flops": sim.recompute_flops,
        "recompute_time_s": sim.recompute_time_s,
        "step_time_s": sim.step_time_s,
        "dispatch_time_s": sim.dispatch_time_s,
        "offloaded": [
            {"value": o.value, "wait": o.wait, "prefetch": o.prefetch}
            for o in plan.schedule.offloaded
        ],
        "offloaded_bytes": sim.offloaded_bytes,
        "predicted_host_peak_bytes": sim.host_peak_bytes,
        "copy_exposed_s": sim.copy_exposed_s,
        "lower_bound_s": plan.lower_bound_s,
        "device_memory": dict(plan.device_memory) if plan.device_memory else None,
    }


def save_plan(plan: Plan, problem: Problem, path: str | Path) -> Path:
    return write_document(plan_document(plan, problem), path)


def write_document(doc: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


FIELDS = frozenset(
    {
        "format", "version", "remat_version", "torch_version", "fingerprint", "graph",
        "solver", "reason", "proof", "saved", "recomputed", "decisions",
        "predicted_peak_bytes", "peak_step", "saved_bytes", "recompute_flops",
        "recompute_time_s", "step_time_s", "dispatch_time_s", "lower_bound_s",
        "device_memory", "offloaded", "offloaded_bytes", "predicted_host_peak_bytes",
        "copy_exposed_s",
    }
)  # fmt: skip
"""The top-level fields a plan file may hold (:func:`document` writes them; files written
before some were added lack them). Any other is refused: a field this remat does not know,
from a later remat or an edit, could change what the plan does."""


def read_plan(path: str | Path) -> PlanFile:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanFileError(f"plan file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanFileError(f"plan file {path} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PlanFileError(f'{path} is not a remat plan file (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise PlanFileError(
            f"{path} has plan format version {doc.get('version')!r}; this remat reads {VERSION}"
        )
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise PlanFileError(
            f"plan file {path} has fields this remat ({__version__}) does not know: "
            f"{', '.join(unknown[:5])} (written by remat {doc.get('remat_version')!r}?)"
        )
    try:
        saved = doc["saved"]
        if not isinstance(saved, list) or not all(isinstance(s, str) for s in saved):
            raise TypeError("'saved' must be a list of node names")
        return PlanFile(
            fingerprint=str(doc["fingerprint"]),
            saved=frozenset(saved),
            solver=str(doc["solver"]),
            reason=str(doc["reason"]),
            proof=Proof(doc.get("proof", Proof.HEURISTIC.value)),
            torch_version=str(doc["torch_version"]),
            remat_version=str(doc["remat_version"]),
            record=doc,
            offloads=tuple(
                Offload(value=str(o["value"]), wait=str(o["wait"]), prefetch=str(o["prefetch"]))
                for o in doc.get("offloaded", [])
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(f"plan file {path} is corrupt: {e}") from None


_LOAD_WITH = {
    GRAPH: "a remat.optimize plan (joint-graph node names): load it with "
    "remat.optimize(model, inputs, plan=...)",
    NATIVE: "a remat.apply plan (SAC policies on the model's own blocks): load it with "
    "remat.apply(model, inputs, plan=...)",
}


def load(
    path: str | Path,
    *,
    executor: str,
    fingerprint: str,
    difference: Callable[[Mapping[str, Any]], str] = lambda record: "another model",
    read: PlanFile | None = None,
) -> PlanFile:
    """Read a plan file for ``executor`` (:data:`GRAPH` or :data:`NATIVE`), checking that it
    was solved for that executor and for what has ``fingerprint`` here (``difference``: what
    differs, from the file's record, for the message). The one loader of both front doors.
    ``read``: the file as :func:`read_plan` already read it (a caller that looked inside
    before it knew the fingerprint)."""
    f = read if read is not None else read_plan(path)
    theirs = f.record.get("graph", {}).get("executor", GRAPH)
    if theirs != executor:
        raise PlanFileError(f"plan file {path} holds {_LOAD_WITH.get(theirs, repr(theirs))}")
    if f.fingerprint != fingerprint:
        raise PlanFileError(
            f"plan file {path} was solved for {difference(f.record)} (fingerprint "
            f"{f.fingerprint[:12]}, this model's {fingerprint[:12]}). It was written with "
            f"torch {f.torch_version} (this is {torch.__version__}) and remat "
            f"{f.remat_version}. Plan again for this model and inputs."
        )
    return f


def plan_from_file(path: str | Path, problem: Problem) -> Plan:
    """The file's plan for ``problem``, after checking it was solved for this very graph."""
    f = load(
        path,
        executor=GRAPH,
        fingerprint=fingerprint(problem),
        difference=lambda record: f"a different graph: {_difference(record, problem)}",
    )
    unknown = sorted(f.saved - set(problem.by_name))
    if unknown:  # same fingerprint but edited by hand
        raise PlanFileError(f"plan file {path} saves values the graph lacks: {unknown[:5]}")
    return make_plan(
        problem,
        f.saved,
        solver=f.solver,
        reason=f"loaded from {path} ({f.reason})",
        proof=f.proof,
        offloads=f.offloads,
    )


def _difference(doc: Mapping[str, Any], problem: Problem) -> str:
    graph = doc.get("graph", {})
    parts = []
    n = graph.get("values")
    if n is not None and n != len(problem.values):
        parts.append(f"{n} graph values there, {len(problem.values)} here")
    for key in ("model", "precision"):
        theirs = graph.get(key)
        ours = problem.metadata.get(key)
        if theirs is not None and ours is not None and theirs != ours:
            parts.append(f"{key} {theirs!r} there, {ours!r} here")
    missing = sorted(set(doc.get("saved", [])) - set(problem.by_name))
    if missing:
        parts.append(f"saved values this graph lacks: {missing[:3]}")
    return "; ".join(parts) or "same size, different ops, shapes or sizes (other input shapes?)"
