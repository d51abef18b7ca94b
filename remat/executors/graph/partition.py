"""Split the joint graph into forward and backward GraphModules that follow a schedule exactly.

Nodes are copied in the schedule's order; FX's code generator then frees every value right
after its last use. The backward uses the boxed calling convention so the saved values handed
to it are freed after their last use too, not when the backward returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from remat import _torch_compat as tc
from remat.executors.graph.joint import JointGraph
from remat.solver.schedule import Schedule


@dataclass(frozen=True)
class SplitGraphs:
    forward: fx.GraphModule
    """``forward(*primals) -> (*user_outputs, *buffer_updates, *saved)``."""
    backward: fx.GraphModule
    """``backward([*saved, *external_reads, *tangents]) -> grads`` (boxed: clears its list)."""
    inference: fx.GraphModule
    """``inference(*primals) -> (*user_outputs, *buffer_updates)``: no saved values."""


def _copy_nodes(
    joint: fx.Graph, names: tuple[str, ...], graph: fx.Graph, env: dict[str, fx.Node]
) -> None:
    by_name = {n.name: n for n in joint.nodes}
    for name in names:
        node = by_name[name]
        env[name] = graph.node_copy(node, lambda n: _lookup(env, by_name, graph, n))


def _lookup(
    env: dict[str, fx.Node], by_name: dict[str, fx.Node], graph: fx.Graph, n: fx.Node
) -> fx.Node:
    if n.name not in env:
        if n.op != "get_attr":
            raise AssertionError(f"{n.name} used before it is available in the new graph")
        env[n.name] = graph.node_copy(by_name[n.name])
    return env[n.name]


def _forward_graph(joint: JointGraph, ops: tuple[str, ...], outputs: tuple[str, ...]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for ph in joint.primals:
        env[ph.name] = graph.placeholder(ph.name)
    _copy_nodes(joint.graph_module.graph, ops, graph, env)
    graph.output(tuple(env[n] for n in outputs))
    return graph


def split(joint: JointGraph, schedule: Schedule, random_ops: frozenset[str]) -> SplitGraphs:
    """The three graphs of a schedule; ``random_ops`` run in every forward, used or not, so the
    random stream is consumed exactly as in eager mode."""
    root = joint.graph_module
    jgraph = root.graph
    user = joint.user_outputs
    mutations = tuple(n for n, _ in joint.mutations)
    fw = _forward_graph(joint, schedule.forward, (*user, *mutations, *schedule.saved))

    needed_inference: set[str] = set()
    by_name = {n.name: n for n in jgraph.nodes}
    forward_set = set(schedule.forward)
    stack = [*user, *mutations, *(n for n in schedule.forward if n in random_ops)]
    while stack:
        name = stack.pop()
        if name in needed_inference or name not in forward_set:
            continue
        needed_inference.add(name)
        stack.extend(i.name for i in by_name[name].all_input_nodes)
    inference_ops = tuple(n for n in schedule.forward if n in needed_inference)
    inf = _forward_graph(joint, inference_ops, (*user, *mutations))

    bw = fx.Graph()
    env: dict[str, fx.Node] = {}
    primal_names = {p.name for p in joint.primals}
    external = (n for n in schedule.external_reads if n in primal_names)  # constants: get_attr
    for name in (*schedule.saved, *external):
        env[name] = bw.placeholder(name)
    for ph in joint.tangents:
        env[ph.name] = bw.placeholder(ph.name)
    _copy_nodes(jgraph, schedule.backward, bw, env)
    bw.output(tuple(env[g] for g, _ in joint.grads))
    bw.set_codegen(tc.boxed_codegen())

    return SplitGraphs(
        forward=fx.GraphModule(root, fw, class_name="RematForward"),
        backward=fx.GraphModule(root, bw, class_name="RematBackward"),
        inference=fx.GraphModule(root, inf, class_name="RematInference"),
    )
