"""Per-node costs of the joint graph: FLOPs, bytes moved, estimated time.

FLOPs come from PyTorch's FLOP registry (matmuls, convolutions, fused attention), evaluated on
the FakeTensor shapes in ``meta["val"]`` without running anything, plus formulas the registry
lacks (CPU fused attention). Ops outside the registry count 0 FLOPs: they are memory-bound and
the roofline charges them for the bytes they move.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from remat import _torch_compat as tc
from remat.measure.profiles import DeviceProfile

aten = torch.ops.aten


def _cpu_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return int(tc.sdpa_flop_count(q.shape, k.shape, v.shape))


def _cpu_sdpa_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> int:
    return int(tc.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape))


EXTRA_FLOPS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def _vals(args: Any) -> Any:
    return tc.tree_map(lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a, args)


def node_flops(node: torch.fx.Node) -> int:
    if node.op != "call_function" or not isinstance(node.target, tc.OpOverload):
        return 0
    return op_flops(node.target, _vals(node.args), _vals(node.kwargs), node.meta.get("val"))


def op_flops(op: tc.OpOverload, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one call of ``op`` (tensors or FakeTensors as arguments and output)."""
    packet = op.overloadpacket
    if packet in EXTRA_FLOPS:
        return EXTRA_FLOPS[packet](*args, **kwargs)
    if packet in tc.flop_registry:
        return int(tc.flop_registry[packet](*args, out_val=out, **kwargs))
    return 0


def op_cost(
    op: tc.OpOverload,
    args: Any,
    kwargs: Any,
    out: Any,
    tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[int, int, str]:
    """(FLOPs, bytes moved, output dtype) of one call of ``op``: what the roofline times.
    ``tensors``: the tensor leaves of the arguments and of the output, when already at hand."""
    flops = op_flops(op, args, kwargs, out)
    ins, outs = tensors if tensors is not None else (_tensors((args, kwargs)), _tensors(out))
    moved = sum(t.numel() * t.element_size() for t in (*ins, *outs))
    dtype = str(outs[0].dtype).removeprefix("torch.") if outs else "float32"
    return flops, moved, dtype


def op_time(
    op: tc.OpOverload,
    args: Any,
    kwargs: Any,
    out: Any,
    profile: DeviceProfile,
    tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[int, float]:
    """(FLOPs, estimated seconds) of one call of ``op`` on ``profile``'s device."""
    flops, moved, dtype = op_cost(op, args, kwargs, out, tensors)
    return flops, profile.op_time(flops, moved, dtype)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tc.tree_leaves(x) if isinstance(t, torch.Tensor)]


def node_bytes_moved(node: torch.fx.Node, is_view: bool) -> int:
    """Bytes read plus bytes written; a view moves nothing."""
    if is_view or node.op != "call_function":
        return 0
    ins = _tensors(_vals((node.args, node.kwargs)))
    outs = _tensors(node.meta.get("val"))
    return sum(t.numel() * t.element_size() for t in (*ins, *outs))


def node_dtype(node: torch.fx.Node) -> str:
    outs = _tensors(node.meta.get("val"))
    return str(outs[0].dtype).removeprefix("torch.") if outs else "float32"


def view_like(node: torch.fx.Node, allocates: bool) -> bool:
    """Whether an op launches no kernel: it returns tensors, allocates none of their storages
    (``allocates``) and writes none (an in-place op, such as a gradient sum run as ``add_``,
    allocates nothing but runs a kernel)."""
    if node.op != "call_function" or allocates:
        return False
    if isinstance(node.target, tc.OpOverload) and tc.is_mutable_op(node.target):
        return False
    return any(isinstance(t, torch.Tensor) for t in tc.tree_leaves(node.meta.get("val")))


def node_time(node: torch.fx.Node, flops: int, is_view: bool, profile: DeviceProfile) -> float:
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    if is_view:
        # A view launches no kernel: its dispatch cost is below what a profile resolves, and
        # counting it would make "save the view" differ from "save its base" (see
        # remat.solver.compress, which relies on views being free).
        return 0.0
    return profile.op_time(flops, node_bytes_moved(node, is_view), node_dtype(node))
