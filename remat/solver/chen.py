"""Chen et al. 2016, "Training deep nets with sublinear memory cost": segment checkpointing.

Checkpoints are chosen among the forward graph's articulation points (values every path from
the inputs to the outputs goes through, e.g. the residual stream between blocks). Only the
checkpoints (and dropout masks) are kept; the backward recomputes each segment when it first
needs it.

* ``chen_sqrt``: every ~sqrt(n)-th of the n candidates.
* ``chen_greedy`` (Alg. 3): walk the forward, accumulating allocated bytes; at a candidate,
  once the running total exceeds ``b``, checkpoint and restart. ``b`` is grid-searched (a
  geometric grid spanning the sqrt(x*y) the paper suggests) and the cheapest plan whose
  simulated peak fits the budget wins.
"""

from __future__ import annotations

import math

import networkx as nx

from remat.problem import Problem, Role
from remat.solver.config import BudgetError, SolverConfig
from remat.solver.fixed import must_save
from remat.solver.plan import Plan, Proof, make_plan


def checkpoint_candidates(problem: Problem) -> list[str]:
    """Articulation points of the forward graph between the inputs and the outputs, in order
    (over the values that depend on parameters)."""
    values = problem.by_name
    # Values that depend on no parameter (attention masks, position ids) are broadcast into
    # every block; counted as edges they would bypass every block boundary. They are left
    # out, like the parameters themselves.
    trainable: set[str] = set()
    for v in problem.values:
        if v.role is Role.FORWARD and any(
            values[i].role is Role.PARAM or i in trainable for i in v.inputs
        ):
            trainable.add(v.name)
    # Input-derived values without parameters (a reshaped input_ids, a padding mask) link the
    # source only to the entry ops (those with no trainable input, e.g. the embeddings).
    from_input: set[str] = set()
    for v in problem.values:
        if (
            v.role is Role.FORWARD
            and v.name not in trainable
            and any(values[i].role is Role.INPUT or i in from_input for i in v.inputs)
        ):
            from_input.add(v.name)
    g = nx.Graph()
    source, sink = "__source__", "__sink__"
    g.add_edge(source, sink)  # keeps the two ends from being cut vertices of a trivial graph
    for v in problem.values:
        if v.name not in trainable:
            continue
        g.add_node(v.name)
        entry = not any(i in trainable for i in v.inputs)
        for i in v.inputs:
            if i in trainable:
                g.add_edge(i, v.name)
            elif entry and (values[i].role is Role.INPUT or i in from_input):
                g.add_edge(source, v.name)
    for out in problem.user_outputs:
        g.add_edge(out, sink)
    g.remove_edge(source, sink)
    if not nx.has_path(g, source, sink):
        return []
    cut = _cuts_between(g.subgraph(nx.node_connected_component(g, source)), source, sink)
    return [
        v.name
        for v in problem.values
        if v.name in cut
        and v.allocates
        and not v.never_recomputed
        and v.name not in problem.user_outputs
    ]


def _cuts_between(g: nx.Graph, source: str, sink: str) -> set[str]:
    """Cut vertices separating ``source`` from ``sink``: those on the block-cut tree's path."""
    tree = nx.Graph()
    cuts = set(nx.articulation_points(g))
    home: dict[str, tuple[str, int]] = {}
    for i, comp in enumerate(nx.biconnected_components(g)):
        node = ("block", i)
        for v in comp:
            if v in cuts:
                tree.add_edge(node, ("cut", v))
            else:
                home[v] = node
    ends = [("cut", x) if x in cuts else home[x] for x in (source, sink)]
    path = nx.shortest_path(tree, ends[0], ends[1])
    return {name for kind, name in path if kind == "cut"} - {source, sink}


def _plan(problem: Problem, checkpoints: list[str], solver: str, reason: str) -> Plan:
    why = {c: "saved: segment checkpoint" for c in checkpoints} | must_save(problem)
    return make_plan(
        problem, why, solver=solver, reason=reason, proof=Proof.HEURISTIC, why_saved=why
    )


def chen_sqrt(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    cands = checkpoint_candidates(problem)
    if not cands:
        return _plan(problem, [], "chen_sqrt", "no articulation points: nothing to segment")
    step = max(1, round(math.sqrt(len(cands))))
    chosen = cands[step - 1 :: step]
    return _plan(
        problem,
        chosen,
        "chen_sqrt",
        f"{len(chosen)} checkpoints, every {step}th of {len(cands)} articulation points",
    )


def greedy_checkpoints(problem: Problem, cands: list[str], b: float) -> list[str]:
    is_cand = set(cands)
    chosen, running = [], 0
    for v in problem.values:
        if v.role is not Role.FORWARD:
            continue
        running += problem.storages_bytes(v.allocates)
        if v.name in is_cand and running > b:
            chosen.append(v.name)
            running = 0
    return chosen


def chen_greedy(problem: Problem, *, budget_bytes: int | None, config: SolverConfig) -> Plan:
    cands = checkpoint_candidates(problem)
    sizes = [
        problem.storages_bytes(v.allocates)
        for v in problem.values
        if v.role is Role.FORWARD and v.allocates
    ]
    if not cands or not sizes:
        return _plan(problem, [], "chen_greedy", "no articulation points: nothing to segment")
    lo, hi = max(1, min(s for s in sizes if s > 0) if any(sizes) else 1), max(1, sum(sizes))
    grid = sorted({lo * (hi / lo) ** (k / 31) for k in range(32)})
    best: Plan | None = None
    least: Plan | None = None
    tried: set[tuple[str, ...]] = set()
    for b in grid:
        chosen = tuple(greedy_checkpoints(problem, cands, b))
        if chosen in tried:
            continue
        tried.add(chosen)
        plan = _plan(problem, list(chosen), "chen_greedy", f"greedy segments, b = {b:,.0f} B")
        if least is None or plan.predicted_peak_bytes < least.predicted_peak_bytes:
            least = plan
        if budget_bytes is not None and plan.predicted_peak_bytes > budget_bytes:
            continue
        key = (plan.recompute_time_s, plan.predicted_peak_bytes)
        if best is None or key < (best.recompute_time_s, best.predicted_peak_bytes):
            best = plan
    if best is None:
        assert least is not None and budget_bytes is not None
        raise BudgetError(budget_bytes, least.predicted_peak_bytes, "least chen_greedy peak")
    return best


__all__ = ["chen_greedy", "chen_sqrt", "checkpoint_candidates"]
