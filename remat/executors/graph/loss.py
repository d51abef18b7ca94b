"""The user's loss in the whole-graph executor's plan.

``remat.optimize``'s module returns the model's outputs; the training loop computes the loss
eagerly and starts the backward from it::

    out = module(*inputs); loss = loss_fn(out, target); del out; loss.backward()

The step's peak depends on the loss: cross-entropy keeps its log-softmax and not the logits,
which are freed once the loss is computed; its backward builds the outputs' gradients, which
autograd's engine then holds until remat's backward returns.

The loss is captured on its own, on tensors shaped like the module's outputs and the target,
and its problem spliced into the module's (:func:`splice`): the module's tangents become the
loss's gradients of the outputs, the loss's forward values are pinned (eager autograd, not
the plan, decides what they keep: what their backward reads), the outputs it reads too, and
a last backward value holds the output gradients to the end. The module's executor runs the
module's part of the step's schedule (:func:`module_schedule`): the names are the module
graph's, so plan and executor agree by construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat import _torch_compat as tc
from remat.executors.graph.capture import Captured, OutputLayout, capture
from remat.executors.graph.joint import JointGraph, build_joint
from remat.fit.graph_shapes import Dims, inputs_at
from remat.measure.meter import Loss, LossError
from remat.problem import EXTERNAL_ROLES, Problem, Role, Value
from remat.solver.schedule import Schedule

__all__ = ["LossGraph", "capture_loss", "loss_at", "module_schedule", "splice"]

PREFIX = "loss."
"""Prefix of the loss's value and storage names in the step's problem."""
HOLD = f"{PREFIX}output_grads_held"
"""The last backward value: reads the output gradients, as the engine holds them until remat's
backward returns."""
RELEASE = f"{PREFIX}outputs_released"
"""The last forward value: reads every output, as the training loop holds them until the loss
is computed (``del out``), and every value of the loss's forward, as its Python frames may
(``logits = out.float()`` lives until ``loss_fn`` returns; an expression's temporary dies
sooner, so this bound is where eager code can reach, not below it)."""


class _LossModule(nn.Module):
    """``fn(output, target)`` on flat tensors: the model's output tensors, then the target's."""

    def __init__(
        self,
        fn: Callable[[Any, Any], torch.Tensor],
        outputs: OutputLayout,
        target_spec: tc.TreeSpec,
        target_leaves: Sequence[Any],
    ) -> None:
        super().__init__()
        self.fn = fn
        self.outputs = outputs
        self.target_spec = target_spec
        self.target_leaves = list(target_leaves)

    def forward(self, *flat: torch.Tensor) -> torch.Tensor:
        n = len(self.outputs.tensor_positions)
        tensors = iter(flat[n:])
        leaves = [next(tensors) if isinstance(x, torch.Tensor) else x for x in self.target_leaves]
        return self.fn(self.outputs.rebuild(flat[:n]), tc.tree_unflatten(leaves, self.target_spec))


@dataclass(frozen=True)
class LossGraph:
    """The loss captured on the module's output shapes, and how it joins the module."""

    joint: JointGraph
    problem: Problem
    """Its problem, the output placeholders as forward values (their storages named, so
    that the loss's views of an output share the output's storage once spliced)."""
    outputs: Mapping[str, str]
    """Loss placeholder -> the module's output value it stands for."""
    grads: Mapping[str, str]
    """The module's tangent -> the loss's gradient of that output."""


def capture_loss(
    fn: Callable[[Any, Any], torch.Tensor],
    target: Any,
    captured: Captured,
    joint: JointGraph,
    *,
    autocast: torch.dtype | None,
    autocast_policy: str,
    problem_of: Callable[[JointGraph], Problem],
) -> LossGraph:
    """Capture ``fn(output, target)`` on tensors shaped like the module's outputs (fake ones
    for a fake model), as the training loop runs it (under the same autocast).
    ``problem_of``: the module's :func:`remat.executors.graph.to_problem.build_problem`, bound to
    its
    device profile and scratch."""
    nodes = {n.name: n for n in joint.graph_module.graph.nodes}
    vals = [nodes[name].meta["val"] for name in joint.user_outputs]
    mode = tc.fake_mode_of(captured.graph_module)
    outputs = [_like(v, mode) for v in vals]
    leaves, spec = tc.tree_flatten(target)
    flat = (*outputs, *(t for t in leaves if isinstance(t, torch.Tensor)))
    module = _LossModule(fn, captured.outputs, spec, leaves)
    try:
        loss_captured = capture(module, flat, autocast=autocast, autocast_policy=autocast_policy)
        loss_joint = build_joint(loss_captured)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise LossError(
            f"loss_fn could not be traced on tensors shaped like the module's outputs "
            f"({type(e).__name__}: {first}). It must compute the loss from the output and the "
            "target alone, with torch ops; otherwise plan with remat.apply, which runs the "
            "loss as written"
        ) from e
    _check(loss_joint, loss_captured)
    n = len(outputs)
    placeholders = tuple(
        dataclasses.replace(p, role=Role.FORWARD) if p.role is Role.INPUT and int(p.key) < n else p
        for p in loss_joint.placeholders
    )
    problem = problem_of(dataclasses.replace(loss_joint, placeholders=placeholders))
    stand_in = {
        p.name: joint.user_outputs[int(p.key)]
        for p in loss_joint.placeholders
        if p.role is Role.INPUT and int(p.key) < n
    }
    grad_of = {ph.name: g for g, ph in loss_joint.grads if ph.name in stand_in}
    loss_nodes = {nd.name: nd for nd in loss_joint.graph_module.graph.nodes}
    grads: dict[str, str] = {}
    for ph in joint.tangents:
        k = int(ph.key)
        found = next((g for p, g in grad_of.items() if stand_in[p] == joint.user_outputs[k]), None)
        if found is None:
            continue  # no gradient from the loss: the executor passes zeros, as a tangent
        grads[ph.name] = found
        traced, given = nodes[ph.name].meta["val"], loss_nodes[found].meta["val"]
        if not same_layout(traced.shape, traced.stride(), given.stride()):
            raise LossError(
                f"the module's output {k} (shape {tuple(traced.shape)}, stride "
                f"{traced.stride()}) gets its gradient from loss_fn with stride "
                f"{given.stride()}: remat's backward, traced in the output's layout, would copy "
                "it and reduce in another order than eager (gradients off in the last bits). "
                "Return the output contiguous (.contiguous() at the end of the forward), or "
                "plan with remat.apply"
            )
    return LossGraph(loss_joint, problem, stand_in, grads)


def same_layout(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    """Strides ``a`` and ``b`` lay out a tensor of ``shape`` alike in memory (dimensions of
    size 1 may have any stride)."""
    return all(n == 1 or x == y for n, x, y in zip(shape, a, b, strict=True))


def _like(val: torch.Tensor, mode: Any) -> torch.Tensor:
    """A tensor of ``val``'s layout, differentiable where its dtype is."""
    with mode if mode is not None else contextlib.nullcontext():
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        t.zero_()
    return t.requires_grad_(val.is_floating_point() or val.is_complex())


def _check(joint: JointGraph, captured: Captured) -> None:
    """A scalar loss whose backward reaches the output, and no trainable tensor of its own."""
    nodes = {n.name: n for n in joint.graph_module.graph.nodes}
    if len(joint.user_outputs) != 1 or nodes[joint.user_outputs[0]].meta["val"].numel() != 1:
        shapes = [tuple(nodes[o].meta["val"].shape) for o in joint.user_outputs]
        raise LossError(f"loss_fn must return the loss as a scalar tensor, not {shapes}")
    if not joint.tangents or not any(ph.role is Role.INPUT for _, ph in joint.grads):
        raise LossError(
            "loss_fn's result does not require grad: it must be computed from the model's "
            "output (not detached, not under torch.no_grad)"
        )
    own = [n for n, p in captured.graph_module.named_parameters() if p.requires_grad]
    if own or any(ph.role is Role.PARAM for ph in joint.placeholders):
        raise LossError(
            "loss_fn reads trainable parameters of its own; remat.optimize plans a loss of the "
            "module's output and the target alone: move that computation into the module, or "
            "plan with remat.apply"
        )


def splice(module: Problem, loss: LossGraph) -> Problem:
    """The step's problem: the module's forward, the loss's forward and backward, then the
    module's backward from the loss's gradients of the outputs (see the module docstring)."""
    lp = loss.problem
    mod = module.by_name
    stand_in = loss.outputs
    storage: dict[str, str | None] = {}
    for name, out in stand_in.items():
        own = mod[out].storages
        for s in lp.by_name[name].allocates:
            storage[s] = own[0] if own else None

    def value(name: str) -> str:
        return stand_in.get(name) or PREFIX + name

    def store(names: Sequence[str]) -> tuple[str, ...]:
        out = (storage.get(s, PREFIX + s) for s in names)
        return tuple(s for s in out if s is not None)

    read_by_loss = {i for v in lp.values for i in v.inputs if i in stand_in}
    pinned_outputs = {stand_in[i] for i in read_by_loss}
    tangent_of = {t: PREFIX + g for t, g in loss.grads.items()}
    # The module's views of a tangent (``tangents_1.t()``) view the loss's gradient.
    storage_of = {
        s: PREFIX + lp.by_name[g].storages[0]
        for t, g in loss.grads.items()
        for s in mod[t].allocates
    }
    head: list[Value] = []
    tail: list[Value] = []
    for v in module.values:
        if v.role is Role.TANGENT and v.name in loss.grads:
            continue
        v = dataclasses.replace(
            v,
            inputs=tuple(tangent_of.get(i, i) for i in v.inputs),
            storages=tuple(dict.fromkeys(storage_of.get(s, s) for s in v.storages)),
            pinned=v.pinned or v.name in pinned_outputs,
        )
        (tail if v.role is Role.BACKWARD else head).append(v)
    spliced = [
        dataclasses.replace(
            v,
            name=PREFIX + v.name,
            inputs=tuple(value(i) for i in v.inputs),
            storages=store(v.storages),
            allocates=store(v.allocates),
            pinned=v.role is Role.FORWARD,
            module_path="loss_fn",
            module_stack=(("loss_fn", "loss_fn"),),
        )
        for v in lp.values
        if v.name not in stand_in
    ]
    external = [v for v in spliced if v.role in EXTERNAL_ROLES or v.role is Role.TANGENT]
    forward = [v for v in spliced if v.role is Role.FORWARD]
    backward = [v for v in spliced if v.role is Role.BACKWARD]
    ends = (*module.user_outputs, *(v.name for v in forward))
    release = Value(RELEASE, Role.FORWARD, "loss_fn returns; del out", ends, pinned=True)
    held = tuple(PREFIX + g for g in loss.grads.values())
    hold = [Value(HOLD, Role.BACKWARD, "autograd engine holds the output gradients", held)]
    values = (
        *(head + external + forward),
        release,
        *(backward + tail),
        *(hold if held else ()),
    )
    clash = {v.name for v in module.values} & {v.name for v in spliced}
    if clash:
        raise ValueError(f"the module's graph already names {sorted(clash)[:3]}")
    own_grads = {PREFIX + g for g in loss.grads.values()}
    return dataclasses.replace(
        module,
        values=values,
        storage_bytes={
            **{s: b for s, b in module.storage_bytes.items() if s not in storage_of},
            **{PREFIX + s: b for s, b in lp.storage_bytes.items() if s not in storage},
        },
        user_outputs=tuple(value(n) for n in lp.user_outputs),
        mutation_outputs=(*module.mutation_outputs, *(value(n) for n in lp.mutation_outputs)),
        grad_outputs=(
            *module.grad_outputs,
            *(g for g in (value(n) for n in lp.grad_outputs) if g not in own_grads),
        ),
        metadata={**module.metadata, "loss": "loss_fn, run eagerly after the module"},
    )


def module_schedule(step: Schedule, module: Problem) -> Schedule:
    """The module's part of the step's schedule: what its executor runs (the loss's values
    and the engine's hold are not its graphs')."""
    names = module.by_name
    outside = [o.value for o in step.offloaded if not {o.value, o.wait, o.prefetch} <= names.keys()]
    if outside:
        raise ValueError(
            f"offloads whose copies wait or start outside the module's graphs: {outside[:3]} "
            "(copy points must be the module's ops: remat.solver.offload.place's copy_ops)"
        )
    backward = tuple(n for n in step.backward if n in names)
    read = {i for n in backward for i in names[n].inputs}
    return Schedule(
        forward=tuple(n for n in step.forward if n in names),
        saved=tuple(n for n in step.saved if n in read),
        external_reads=tuple(n for n in step.external_reads if n in read),
        backward=backward,
        recomputed=tuple(n for n in step.recomputed if n in names),
        offloaded=step.offloaded,
    )


def module_ops(step: Problem) -> frozenset[str] | None:
    """The ops of ``step`` the module's executor runs, where a copy can be waited on or
    started: all but the loss's and the engine's stand-ins (named under :data:`PREFIX`). None
    for a step without a loss: every op is the module's."""
    if "loss" not in step.metadata:
        return None
    return frozenset(v.name for v in step.values if not v.name.startswith(PREFIX))


def loss_at(
    loss: Loss | None,
    example: tuple[tuple[Any, ...], Mapping[str, Any]],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Loss | None:
    """``loss`` with its target at ``args``' batch and sequence sizes: the example's target
    tiled and cropped as the example inputs are (:func:`remat.fit.graph_shapes.inputs_at`)."""
    if loss is None:
        return None
    dims, now = Dims.of(*example), Dims.of(args, kwargs)
    if (now.batch, now.seq) == (dims.batch, dims.seq):
        return loss
    (target,), _ = inputs_at((loss.target,), {}, dims, now.batch, now.seq)
    return dataclasses.replace(loss, target=target)
