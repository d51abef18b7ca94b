"""Split the joint graph into forward and backward GraphModules that follow a schedule exactly.

Nodes are copied in the schedule's order; FX's code generator then frees every value right
after its last use. The backward uses the boxed calling convention so the saved values handed
to it are freed after their last use too, not when the backward returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.fx as fx

from remat import _torch_compat as tc
from remat.executors.graph.joint import JointGraph
from remat.executors.host_store import HostStore, fetch_value, offload_value, wait_offload
from remat.solver.offload import Offload
from remat.solver.schedule import Schedule


@dataclass(frozen=True)
class SplitGraphs:
    forward: fx.GraphModule
    """``forward(*primals) -> (*user_outputs, *buffer_updates, *saved)``."""
    backward: fx.GraphModule
    """``backward([*saved, *external_reads, *tangents]) -> grads`` (boxed: clears its list)."""
    inference: fx.GraphModule
    """``inference(*primals) -> (*user_outputs, *buffer_updates)``: no saved values."""


Hook = Callable[[fx.Graph, dict[str, fx.Node]], None]


def _copy_nodes(
    joint: fx.Graph,
    names: tuple[str, ...],
    graph: fx.Graph,
    env: dict[str, fx.Node],
    before: Mapping[str, list[Hook]] | None = None,
    after: Mapping[str, list[Hook]] | None = None,
) -> None:
    """Copy ``names`` in order; ``before``/``after``: nodes to add around a copied op."""
    by_name = {n.name: n for n in joint.nodes}
    before, after = before or {}, after or {}
    for name in names:
        for hook in before.get(name, ()):
            hook(graph, env)
        node = by_name[name]
        env[name] = graph.node_copy(node, lambda n: _lookup(env, by_name, graph, n))
        for hook in after.get(name, ()):
            hook(graph, env)


def _lookup(
    env: dict[str, fx.Node], by_name: dict[str, fx.Node], graph: fx.Graph, n: fx.Node
) -> fx.Node:
    if n.name not in env:
        if n.op != "get_attr":
            raise AssertionError(f"{n.name} used before it is available in the new graph")
        env[n.name] = graph.node_copy(by_name[n.name])
    return env[n.name]


def _forward_graph(
    joint: JointGraph,
    ops: tuple[str, ...],
    outputs: tuple[str, ...],
    copies: _Copies | None = None,
) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for ph in joint.primals:
        env[ph.name] = graph.placeholder(ph.name)
    after = None if copies is None else copies.forward()
    _copy_nodes(joint.graph_module.graph, ops, graph, env, after=after)
    offloaded = frozenset() if copies is None else copies.values
    graph.output(tuple(env[OUT + n if n in offloaded else n] for n in outputs))
    return graph


OUT = "remat_offloaded_"
"""The forward graph's name for an offloaded value's host copy (its output in the value's
place)."""


@dataclass(frozen=True)
class _Copies:
    """The offload ops a schedule adds to its graphs (:mod:`remat.solver.offload`): the
    copy-out after the value's op, its wait after the op the plan names (the graph frees the
    device copy right after, its last reader), and the copy back before the backward op the
    plan names."""

    store: int
    offloads: tuple[Offload, ...]

    @property
    def values(self) -> frozenset[str]:
        return frozenset(o.value for o in self.offloads)

    def forward(self) -> dict[str, list[Hook]]:
        """Nodes to add after forward ops: every copy-out, then every wait."""
        after: dict[str, list[Hook]] = {}
        for o in self.offloads:
            after.setdefault(o.value, []).append(self._start(o.value))
        for o in self.offloads:
            after.setdefault(o.wait, []).append(self._wait(o.value))
        return after

    def backward(self) -> dict[str, list[Hook]]:
        """Nodes to add before backward ops: the copies back."""
        before: dict[str, list[Hook]] = {}
        for o in self.offloads:
            before.setdefault(o.prefetch, []).append(self._fetch(o.value))
        return before

    def _start(self, value: str) -> Hook:
        def hook(graph: fx.Graph, env: dict[str, fx.Node]) -> None:
            env[OUT + value] = graph.call_function(offload_value, (self.store, env[value]))

        return hook

    def _wait(self, value: str) -> Hook:
        def hook(graph: fx.Graph, env: dict[str, fx.Node]) -> None:
            graph.call_function(wait_offload, (self.store, env[OUT + value], env[value]))

        return hook

    def _fetch(self, value: str) -> Hook:
        def hook(graph: fx.Graph, env: dict[str, fx.Node]) -> None:
            env[value] = graph.call_function(fetch_value, (self.store, env[value]))

        return hook


def split(
    joint: JointGraph,
    schedule: Schedule,
    random_ops: frozenset[str],
    store: HostStore | None = None,
) -> SplitGraphs:
    """The three graphs of a schedule; ``random_ops`` run in every forward, used or not, so the
    random stream is consumed exactly as in eager mode. ``store``: where the schedule's
    offloaded values go (needed when it has any)."""
    root = joint.graph_module
    jgraph = root.graph
    user = joint.user_outputs
    mutations = tuple(n for n, _ in joint.mutations)
    copies = None
    if schedule.offloaded:
        if store is None:
            raise ValueError("a schedule that offloads needs a host store")
        copies = _Copies(store.key, schedule.offloaded)
    fw = _forward_graph(joint, schedule.forward, (*user, *mutations, *schedule.saved), copies)

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
    _copy_nodes(jgraph, schedule.backward, bw, env, copies.backward() if copies else None)
    bw.output(tuple(env[g] for g, _ in joint.grads))
    bw.set_codegen(tc.boxed_codegen())

    return SplitGraphs(
        forward=fx.GraphModule(root, fw, class_name="RematForward"),
        backward=fx.GraphModule(root, bw, class_name="RematBackward"),
        inference=fx.GraphModule(root, inf, class_name="RematInference"),
    )
