"""Run a plan: an autograd.Function around the forward and backward GraphModules.

The Function takes the flat primals (parameters, buffers, user inputs) and returns the user
outputs. Its forward runs the forward graph, copies buffer updates into the buffers, and keeps
the saved values in a plain list on the context; its backward hands that list to the boxed
backward graph, which frees each saved value after its last use. Saved values are never stored
with ``save_for_backward``: autograd would keep them alive until the backward returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remat.executors.graph.joint import JointGraph
from remat.executors.graph.loss import same_layout
from remat.executors.graph.partition import SplitGraphs, split
from remat.executors.host_store import HostStore
from remat.problem import Problem, Role
from remat.solver.plan import Plan
from remat.solver.schedule import Schedule


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Executor:
    """Everything needed to run one plan of one captured graph."""

    graphs: SplitGraphs
    plan: Plan
    primal_keys: tuple[tuple[Role, str | int], ...]
    """For each flat primal: (PARAM|BUFFER, fqn) or (INPUT, flat input index)."""
    num_user_outputs: int
    mutated: tuple[int, ...]
    """Index into the primals of each buffer/input the forward updates."""
    backward_external: tuple[int, ...]
    """Indices into the primals of the parameters/inputs the backward reads."""
    tangent_outputs: tuple[int, ...]
    """User output index of each tangent the backward takes."""
    tangent_specs: tuple[TensorSpec, ...]
    grad_targets: tuple[int, ...]
    """Index into the primals of each gradient the backward returns."""
    store: HostStore | None = None
    """Where the plan's offloaded values wait for the backward (None: it offloads none)."""

    def run(self, primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """User outputs of one call, differentiable through the plan."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in primals):
            return _RematFunction.apply(self, *primals)  # type: ignore[no-any-return]
        with torch.no_grad():
            outs = self.graphs.inference(*primals)
            self._apply_mutations(primals, outs[self.num_user_outputs :])
        return tuple(outs[: self.num_user_outputs])

    def _apply_mutations(self, primals: list[torch.Tensor], new: Any) -> None:
        for index, value in zip(self.mutated, new, strict=True):
            primals[index].copy_(value)


class _RematFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: Executor, *primals: torch.Tensor) -> Any:  # type: ignore[override]
        outs = ex.graphs.forward(*primals)
        n_user, n_mut = ex.num_user_outputs, len(ex.mutated)
        user = outs[:n_user]
        ex._apply_mutations(list(primals), outs[n_user : n_user + n_mut])
        user_ids = {id(t) for t in user}
        # A saved value that is also an output must not be held as the same object: the output
        # gets a grad_fn pointing at this context, which would make a reference cycle.
        ctx.remat_saved = [t.detach() if id(t) in user_ids else t for t in outs[n_user + n_mut :]]
        ctx.remat_external = [primals[i] for i in ex.backward_external]
        ctx.remat_executor = ex
        ctx.remat_devices = [t.device for t in user]  # a missing output gradient's device
        del outs
        ctx.set_materialize_grads(False)
        non_diff = [t for t in user if not (t.is_floating_point() or t.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(user)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        ex: Executor = ctx.remat_executor
        if ctx.remat_saved is None:
            raise RuntimeError(
                "remat: backward through the same forward twice (retain_graph=True) is not "
                "supported: saved values are freed as the backward consumes them"
            )
        args: list[torch.Tensor] = ctx.remat_saved
        ctx.remat_saved = None
        args.extend(ctx.remat_external)
        for out_index, spec in zip(ex.tangent_outputs, ex.tangent_specs, strict=True):
            args.append(_as_traced(grad_outputs[out_index], spec, ctx.remat_devices[out_index]))
        grads = ex.graphs.backward(args)
        result: list[torch.Tensor | None] = [None] * (1 + len(ex.primal_keys))
        for index, g in zip(ex.grad_targets, grads, strict=True):
            result[1 + index] = g
        return tuple(result)


def _as_traced(grad: torch.Tensor | None, spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """The output gradient in the layout the backward graph was traced with; zeros on the
    output's device where autograd passes none (never on the default device)."""
    if grad is None:
        out = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
        return out.zero_()
    if tuple(grad.shape) != spec.shape:
        raise RuntimeError(
            f"remat: output gradient of shape {tuple(grad.shape)}, expected {spec.shape}"
        )
    if not same_layout(spec.shape, grad.stride(), spec.stride):
        out = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=grad.device)
        out.copy_(grad)
        return out
    return grad


def build_executor(
    joint: JointGraph, problem: Problem, plan: Plan, schedule: Schedule | None = None
) -> Executor:
    """The executor of ``plan`` over ``joint``; ``schedule``: the part of the plan's schedule
    the module runs, where the plan covers more (the loss, :mod:`remat.executors.graph.loss`)."""
    schedule = schedule or plan.schedule
    store = HostStore() if schedule.offloaded else None
    graphs = split(joint, schedule, frozenset(v.name for v in problem.values if v.random), store)
    primals = joint.primals
    position = {p.name: i for i, p in enumerate(primals)}
    keys = tuple((p.role, p.key) for p in primals)
    nodes = {n.name: n for n in joint.graph_module.graph.nodes}
    tangent_specs = []
    for ph in joint.tangents:
        val = nodes[ph.name].meta["val"]
        tangent_specs.append(TensorSpec(tuple(val.shape), tuple(val.stride()), val.dtype))
    return Executor(
        graphs=graphs,
        plan=plan,
        primal_keys=keys,
        num_user_outputs=len(joint.user_outputs),
        mutated=tuple(position[ph.name] for _, ph in joint.mutations),
        backward_external=tuple(position[n] for n in schedule.external_reads if n in position),
        tangent_outputs=tuple(int(ph.key) for ph in joint.tangents),
        tangent_specs=tuple(tangent_specs),
        grad_targets=tuple(position[ph.name] for _, ph in joint.grads),
        store=store,
    )
