"""Turn an annotated joint graph into the solver-facing :class:`remat.problem.Problem`.

Storage identity comes from the FakeTensors in ``meta["val"]``: views share their base's fake
storage, so grouping nodes by storage gives exact, deduplicated byte counts. The first node (in
graph order) referencing a storage allocates it, unless it belongs to a parameter, buffer or
input, which exist before the step and cost nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from remat import _torch_compat as tc
from remat.executors.graph.joint import JointGraph, backward_nodes
from remat.measure.costs import node_flops, node_time, view_like
from remat.measure.profiles import DeviceProfile, get_profile
from remat.problem import EXTERNAL_ROLES, Problem, Role, Value

BLOCK = 512
"""Bytes of the CUDA caching allocator's smallest block."""


def _storages(val: Any) -> list[tuple[int, int]]:
    """(storage key, bytes) of every tensor in a node's value."""
    out = []
    for t in tc.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            out.append((tc.storage_key(t), t.untyped_storage().nbytes()))
    return out


def _op_name(node: torch.fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    if node.op == "get_attr":
        return "get_attr"
    return str(node.target)


def _is_random(node: torch.fx.Node) -> bool:
    """Draws random numbers. Attention kernels are tagged as seeded whatever their
    ``dropout_p``; at ``dropout_p = 0`` they draw nothing and may be recomputed like any op
    (without this, fused attention could never be recomputed)."""
    target = node.target
    if not isinstance(target, tc.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for k, arg in enumerate(tc.op_arguments(target)):
        if arg.name == "dropout_p":
            p = node.kwargs.get(
                "dropout_p", node.args[k] if k < len(node.args) else arg.default_value
            )
            return bool(p != 0)
    return True


def _module_stack(node: torch.fx.Node) -> tuple[tuple[str, str], ...]:
    """(path, class name) of the enclosing modules, outermost first, without the wrapper."""
    out = []
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        path = str(path).removeprefix("model").lstrip(".")
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
        if path:
            out.append((path, name))
    return tuple(out)


def _shape(val: Any) -> tuple[int, ...]:
    first = next((t for t in tc.tree_leaves(val) if isinstance(t, torch.Tensor)), None)
    if first is None:
        return ()
    try:
        return tuple(int(d) for d in first.shape)
    except TypeError:  # symbolic sizes
        return ()


class _Storages:
    """The storages each node's outputs hold, each named for the node that allocates it
    first (``name#k``); those of parameters, buffers, inputs and constants (the external
    roles) are nobody's. ``output_bytes``: what a node's outputs hold as the device's kernel
    made them, where that is a block or more above its FakeTensor's storage."""

    def __init__(self, output_bytes: Mapping[str, int]) -> None:
        self.output_bytes = output_bytes
        self.owner: dict[int, str] = {}
        self.bytes: dict[str, int] = {}
        self.external: set[int] = set()

    def of(self, node: torch.fx.Node, role: Role) -> tuple[list[str], list[str]]:
        """The storages ``node``'s outputs hold, and those it allocates."""
        keys = _storages(node.meta.get("val"))
        if role in EXTERNAL_ROLES:
            self.external.update(k for k, _ in keys)
        storages: list[str] = []
        allocates: list[str] = []
        for key, nbytes in keys:
            if key in self.external:
                continue
            if key not in self.owner:
                self.owner[key] = sid = f"{node.name}#{len(allocates)}"
                self.bytes[sid] = nbytes
                allocates.append(sid)
            storages.append(self.owner[key])
        if (
            len(allocates) == 1
            and self.output_bytes.get(node.name, 0) >= self.bytes[allocates[0]] + BLOCK
        ):
            self.bytes[allocates[0]] = self.output_bytes[node.name]
        return storages, allocates


def build_problem(
    joint: JointGraph,
    *,
    device_profile: str | DeviceProfile = "cpu",
    metadata: Mapping[str, str] | None = None,
    scratch: Mapping[str, int] | None = None,
    output_bytes: Mapping[str, int] | None = None,
) -> Problem:
    """Annotate every node (role, storages, FLOPs, time, randomness, module path).
    ``scratch``: kernel scratch bytes by node name; ``output_bytes``: what each node's
    outputs hold as the device's kernel made them (:mod:`remat.measure.scratch`), where that
    is more than its FakeTensor's storage (by a block or more: a CUDA allocator's rounding
    alone is not a larger buffer)."""
    scratch = scratch or {}
    profile = get_profile(device_profile)
    graph = joint.graph_module.graph
    roles = {p.name: p.role for p in joint.placeholders}
    owned = _Storages(output_bytes or {})
    backward = backward_nodes(graph, {p.name for p in joint.tangents})
    random: set[str] = set()
    stack_by_seq: dict[int, tuple[tuple[str, str], ...]] = {}
    values: list[Value] = []
    for node in graph.nodes:
        if node.op == "output":
            continue
        inputs = tuple(dict.fromkeys(n.name for n in node.all_input_nodes))
        if node.op == "placeholder":
            role = roles[node.name]
        elif node.op == "get_attr":
            role = Role.CONSTANT
        else:
            role = Role.BACKWARD if node.name in backward else Role.FORWARD
        storages, allocates = owned.of(node, role)
        view = view_like(node, bool(allocates))
        is_random = _is_random(node) or (node.target is operator.getitem and inputs[0] in random)
        if is_random and role is Role.FORWARD:
            random.add(node.name)
        stack = _module_stack(node)
        seq = node.meta.get("seq_nr")
        if role is Role.FORWARD and stack and seq is not None:
            stack_by_seq.setdefault(seq, stack)
        elif role is Role.BACKWARD and not stack and seq is not None:
            stack = stack_by_seq.get(seq, ())
        flops = node_flops(node)
        values.append(
            Value(
                name=node.name,
                role=role,
                op=_op_name(node),
                inputs=inputs,
                storages=tuple(dict.fromkeys(storages)),
                allocates=tuple(allocates),
                flops=flops,
                time_s=node_time(node, flops, view, profile),
                random=is_random,
                module_path=stack[-1][0] if stack else "",
                module_stack=stack,
                shape=_shape(node.meta.get("val")),
                scratch_bytes=scratch.get(node.name, 0),
            )
        )
    return Problem(
        values=tuple(values),
        storage_bytes=owned.bytes,
        user_outputs=joint.user_outputs,
        mutation_outputs=tuple(n for n, _ in joint.mutations),
        grad_outputs=tuple(n for n, _ in joint.grads),
        device_profile=profile.name,
        metadata=dict(metadata or {}),
        link=profile.link,
    )
