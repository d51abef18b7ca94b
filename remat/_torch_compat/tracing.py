"""Hooks into how PyTorch traces and runs a step: AOTAutograd's joint graph, FX's boxed code
generator, an op's schema, the RNG states and autograd Functions a step takes, SAC's cache
and the c10d ops a step dispatches.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._ops import OpOverload
from torch.fx.graph import _BoxedCodeGen


def export_joint(module: torch.nn.Module, args: tuple[Any, ...]) -> torch.fx.GraphModule:
    """AOTAutograd's joint forward+backward graph of ``module(*args)``.

    Placeholders and the output node carry ``meta["desc"]`` descriptors (param, buffer, user
    input, tangent; user output, input mutation, gradient). The exit stack is closed before
    returning: we only keep the graph and its FakeTensor metadata, never AOT's runtime.
    """
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, module, args)
        return joint.graph_module


def boxed_codegen() -> torch.fx.graph.CodeGen:
    """FX code generator whose function takes one list and clears it after unpacking.

    Without it, the caller's argument list keeps every saved activation alive for the whole
    backward; with it, each one is freed after its last use.
    """
    return _BoxedCodeGen()


ALLGATHER_BASE = torch.ops.c10d._allgather_base_.default
"""The c10d op ``all_gather_into_tensor`` runs (FSDP2's all-gather)."""


REDUCE_SCATTER_BASE = torch.ops.c10d._reduce_scatter_base_.default
"""The c10d op ``reduce_scatter_tensor`` runs (FSDP2's gradient reduce-scatter)."""


@contextlib.contextmanager
def rng_states_saved(callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback`` with each CPU RNG state taken while active. Why: a non-reentrant
    checkpoint frame saves ``torch.get_rng_state()`` (5,056 bytes on CPU) when its region
    starts and holds it until the frame dies; it is made outside the dispatcher, so no
    dispatch mode sees it, but the allocator does. Relies on ``torch.utils.checkpoint``
    calling ``torch.get_rng_state`` through the ``torch`` module (2.13)."""
    original = torch.get_rng_state

    def observed() -> torch.Tensor:
        state = original()
        callback(state)
        return state

    torch.get_rng_state = observed
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextlib.contextmanager
def autograd_functions_applied(callback: Callable[[type, Any], None]) -> Iterator[None]:
    """Call ``callback(function_class, outputs)`` each time a ``torch.autograd.Function``
    subclass is applied while active. Why: non-strict ``torch.export`` runs a Function's
    forward and records its ops inline, with no higher-order op or marker for the Function
    (only Dynamo's strict tracing makes ``autograd_function_apply``); the joint graph then
    differentiates those ops and the Function's own backward is lost. Relies on subclasses
    inheriting ``Function.apply``, a classmethod (2.13)."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        out = original.__func__(cls, *args, **kwargs)
        callback(cls, out)
        return out

    function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        function.apply = original  # type: ignore[method-assign]


RETURNS_ITS_INPUT: frozenset[Any] = frozenset(
    (
        torch.ops._c10d_functional.wait_tensor.default,
        torch.ops._c10d_functional._wrap_tensor_autograd.default,
    )
)
"""Functional-collective ops (tensor parallelism's all-reduces, all-gathers) that return
their argument's storage when they run (the wait; the wrapper of a pending result) and a
copy on FakeTensors."""


@functools.cache
def compute_intensive_ops() -> frozenset[str]:
    """The ATen overloads (``aten.mm.default``, ...) PyTorch's partitioner deems compute
    intensive (``get_default_op_list().compute_intensive_ops``), which torchtitan's op-SAC
    policy saves. Worked out once: a plan asks it for every region."""
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list().compute_intensive_ops
    return frozenset(str(op.default) for op in ops)  # type: ignore[attr-defined]


def sac_cache_hits(contexts: tuple[Any, Any]) -> Callable[[], int]:
    """A count of the cached outputs the replay of one selective-checkpoint call has
    returned so far, from its two contexts (``create_selective_checkpoint_contexts``). 2.13:
    the replay's dispatch mode holds ``storage`` (op -> call index -> entry) and marks an
    entry it returned ``torch.utils.checkpoint._CONSUMED``; a hit reaches no other dispatch
    mode, so this is the only place it shows (elsewhere: counted 0). Holds the mode weakly:
    the cached outputs must die with the checkpoint's frame, as they do in training."""
    from torch.utils import checkpoint as ckpt

    consumed = getattr(ckpt, "_CONSUMED", None)
    if consumed is None or not hasattr(contexts[1], "storage"):
        return lambda: 0
    mode = weakref.ref(contexts[1])

    def hits() -> int:
        alive = mode()
        if alive is None:
            return 0
        return sum(e is consumed for entries in alive.storage.values() for e in entries.values())

    return hits


def no_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """No TorchDispatchMode (SAC's, a meter's, FakeTensorMode) sees the ops run within."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()  # type: ignore[no-any-return]


wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast
"""The higher-order op ``torch.export`` records an autocast region as."""


def op_arguments(op: OpOverload) -> list[Any]:
    """The schema's arguments of an ATen overload (each with ``.name``, ``.default_value``)."""
    return list(op._schema.arguments)


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The ``torch.FunctionSchema`` of an ATen overload (arguments, returns, alias info)."""
    return op._schema


def is_mutable_op(op: OpOverload) -> bool:
    """Whether the overload's schema declares that it writes one of its arguments."""
    return bool(op._schema.is_mutable)


def current_graph_task_id() -> int:
    """The id of the autograd graph task running on this thread: -1 outside a backward."""
    return int(torch._C._current_graph_task_id())
