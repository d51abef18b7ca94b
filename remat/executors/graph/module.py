"""The nn.Module users train: the user's own parameters and buffers, run through a plan.

It mirrors the user's module tree with plain containers holding the *same* parameter and
buffer objects under the same names, so ``state_dict()`` keys are identical, optimizers see the
user's parameters, and the user's module object itself is never modified (its forward, hooks
and training flags stay as they were).

Graphs are specialised to the training flag and the input shapes they were captured with; a
call with another flag or other shapes plans again (once per new signature, with a warning),
except a length that ``remat.optimize(..., max_seq=N)`` planned for: captured, no solve
(:mod:`remat.executors.graph.lengths`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat import _torch_compat as tc
from remat._torch_compat import is_fake
from remat.executors.graph.capture import Captured
from remat.executors.graph.export import export_graphs
from remat.executors.graph.run import Executor
from remat.executors.host_store import HostStore
from remat.plan.files import save_plan
from remat.plan.report import explain_plan
from remat.problem import Problem, Role
from remat.solver.plan import Plan

if TYPE_CHECKING:
    from remat.executors.graph.lengths import LengthPlans


@dataclass(frozen=True)
class Compiled:
    """One capture of the model and its executor."""

    captured: Captured
    executor: Executor
    problem: Problem
    timings: Mapping[str, float] = field(default_factory=dict)
    """Seconds spent per planning stage: capture, joint, annotate, solve, rewrite."""


Planner = Callable[[nn.Module, tuple[Any, ...], Mapping[str, Any]], Compiled]
"""Builds a :class:`Compiled` for the model in its current training mode."""


def signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Hashable:
    """What a captured graph is specialised to: tensor shapes, dtypes, devices, constants."""

    def one(x: Any) -> Hashable:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
        try:
            hash(x)
        except TypeError:
            return ("C", repr(x))
        return ("C", x)

    return (tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items())))


def _mirror(source: nn.Module, target: nn.Module) -> None:
    """Register ``source``'s parameters and buffers on ``target`` under the same names."""

    def container(path: str) -> nn.Module:
        mod = target
        for part in path.split(".") if path else []:
            if part not in tc.child_modules(mod):
                mod.add_module(part, nn.Module())
            mod = tc.child_modules(mod)[part]  # type: ignore[assignment]
        return mod

    for prefix, mod in source.named_modules(remove_duplicate=False):
        for name, p in tc.local_parameters(mod).items():
            if p is not None:
                container(prefix).register_parameter(name, p)
        for name, b in tc.local_buffers(mod).items():
            if b is not None:
                persistent = name not in tc.non_persistent_buffer_names(mod)
                container(prefix).register_buffer(name, b, persistent=persistent)


class RematModule(nn.Module):
    """Trains exactly like the wrapped model, with the memory and time of its plan."""

    _source: nn.Module
    _planner: Planner
    _compiled: dict[Hashable, Compiled]
    _first: Compiled
    _source_name: str
    _fake: bool
    _lengths: LengthPlans | None

    def __init__(
        self,
        source: nn.Module,
        first: Compiled,
        first_signature: Hashable,
        planner: Planner,
        lengths: LengthPlans | None = None,
    ) -> None:
        super().__init__()
        _mirror(source, self)
        self.train(source.training)
        # Held outside the module tree: not a submodule, so it adds no state_dict keys and
        # .train()/.to() on this module never reach it.
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_planner", planner)
        object.__setattr__(self, "_compiled", {(source.training, first_signature): first})
        object.__setattr__(self, "_first", first)
        object.__setattr__(self, "_source_name", type(source).__name__)
        object.__setattr__(self, "_fake", any(is_fake(p) for p in source.parameters()))
        object.__setattr__(self, "_lengths", lengths)

    @property
    def plan(self) -> Plan:
        """The plan of the graph captured by :func:`remat.optimize`."""
        return self._first.executor.plan

    @property
    def host_store(self) -> HostStore | None:
        """Where the plan's offloaded values wait for the backward, with the host bytes it
        has held (``peak_bytes``); None when the plan offloads nothing."""
        return self._first.executor.store

    @property
    def plans(self) -> dict[Hashable, Plan]:
        """Every plan made so far, by (training flag, input signature)."""
        return {k: c.executor.plan for k, c in self._compiled.items()}

    @property
    def lengths(self) -> LengthPlans | None:
        """With ``remat.optimize(..., max_seq=N)``: the plan of each bucket of lengths, its
        exact peak formula, and what each new length cost (``.events``, ``.summary()``)."""
        return self._lengths

    def report(self, width: int = 120) -> str:
        """Print and return the memory breakdown and the plan by module (``remat.explain``)."""
        text = self.explain_text(width)
        print(text, end="")
        return text

    def explain_text(self, width: int = 120) -> str:
        """The report of :meth:`report` as text, not printed."""
        return explain_plan(self.plan, self._first.problem, width=width)

    def export(self, folder: str | Path) -> Path:
        """Write the plan's forward, backward and inference graphs as readable Python plus
        ``plan.json`` to ``folder`` (see :mod:`remat.executors.graph.export`); load the graphs back
        with ``remat.executors.graph.export.load_graphs``. A plan that offloads is refused:
        its graphs call this process's host store."""
        if self.host_store is not None:
            raise ValueError(
                "export: this plan offloads, and its graphs call this process's host store; "
                "save the plan file instead (save_plan), which a later run applies"
            )
        folder = export_graphs(self._first.executor.graphs, folder)
        self.save_plan(folder / "plan.json")
        return folder

    def save_plan(self, path: str | Path) -> Path:
        """Write :attr:`plan` as JSON (re-apply with ``remat.optimize(..., plan=path)``)."""
        return save_plan(self.plan, self._first.problem, path)

    def extra_repr(self) -> str:
        p = self.plan
        return f"source={self._source_name}, plan={p.solver}, predicted_peak={p.predicted_peak_bytes:,} B"

    def _compiled_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Compiled:
        key: tuple[Any, ...] = (self.training, signature(args, kwargs))
        found = self._compiled.get(key)
        if found is not None and found.captured.takes_branches_of(args, kwargs):
            return found
        if found is not None:
            # Same shapes, but Hugging Face's mask code takes another branch on these inputs
            # (padding, packed positions): a graph traced on that branch.
            flat = found.captured.inputs.flatten(args, kwargs)
            key = (*key, tuple(b.holds(flat) for b in found.captured.branches))
            again = self._compiled.get(key)
            if again is not None and again.captured.takes_branches_of(args, kwargs):
                return again
        covered = self._lengths is not None and self._lengths.covers(self.training, args, kwargs)
        if not covered:
            warnings.warn(
                f"remat: planning again for {'training' if self.training else 'eval'} mode with "
                "new input shapes/options (graphs are specialised to the inputs they were traced "
                "with, and to the branches Hugging Face's mask code takes on them)",
                stacklevel=3,
            )
        source: nn.Module = self._source
        flags = {m: m.training for m in source.modules()}
        try:
            source.train(self.training)
            compiled = self._planner(source, args, kwargs)
        finally:
            for m, flag in flags.items():
                m.training = flag
        self._compiled[key] = compiled
        return compiled

    def _primal(self, role: Role, key: str | int, inputs: list[torch.Tensor]) -> torch.Tensor:
        if role is Role.PARAM:
            return self.get_parameter(str(key))
        if role is Role.BUFFER:
            return self.get_buffer(str(key))
        return inputs[int(key)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._fake:
            raise RuntimeError(
                f"this remat module of {self._source_name} was planned with fake tensors "
                "(remat.fake_mode()): it carries a plan (.plan) but has no data to run; build "
                "the model outside fake_mode to train it"
            )
        compiled = self._compiled_for(args, kwargs)
        inputs = compiled.captured.inputs.flatten(args, kwargs)
        ex = compiled.executor
        primals = [self._primal(role, key, inputs) for role, key in ex.primal_keys]
        del inputs
        outs = ex.run(primals)
        return compiled.captured.outputs.rebuild(outs)
