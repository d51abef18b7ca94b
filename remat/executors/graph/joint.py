"""The joint forward+backward graph of a captured model, with every placeholder's role known.

AOTAutograd traces forward and backward into one functional FX graph whose placeholders are the
parameters, buffers, user inputs and output gradients (tangents), and whose outputs are the
user outputs, the new values of mutated buffers, and the gradients. Descriptors on the
placeholders and outputs say which is which; this module reads them into plain names.

Tied parameters (one tensor under several names, e.g. GPT-2's ``wte``/``lm_head``) arrive as
separate placeholders; they are merged into one, and their gradients summed in the graph, as
autograd's input buffer sums them in eager mode.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from remat import _torch_compat as tc
from remat.executors.graph.buffers import drop_copies, sum_in_place
from remat.executors.graph.capture import PREFIX, Captured
from remat.problem import Role


@dataclass(frozen=True)
class Placeholder:
    name: str
    role: Role
    key: str | int
    """Parameter/buffer FQN in the user's model, or the flat input / user output index."""


@dataclass(frozen=True)
class JointGraph:
    graph_module: torch.fx.GraphModule
    placeholders: tuple[Placeholder, ...]
    """Graph order: parameters, buffers and inputs (the primals), then tangents."""
    user_outputs: tuple[str, ...]
    """Node names, in the order of the captured graph's flat outputs."""
    mutations: tuple[tuple[str, Placeholder], ...]
    """(node holding the new value, the mutated buffer or input)."""
    grads: tuple[tuple[str, Placeholder], ...]
    """(gradient node, the parameter or input it is the gradient of)."""
    param_aliases: tuple[tuple[str, ...], ...]
    """Groups of FQNs naming one tied parameter; the first is the one kept."""

    @property
    def primals(self) -> tuple[Placeholder, ...]:
        return tuple(p for p in self.placeholders if p.role is not Role.TANGENT)

    @property
    def tangents(self) -> tuple[Placeholder, ...]:
        return tuple(p for p in self.placeholders if p.role is Role.TANGENT)


def _fqn(target: str) -> str:
    return target[len(PREFIX) :] if target.startswith(PREFIX) else target


def build_joint(captured: Captured) -> JointGraph:
    """Trace the joint graph of a captured model (FakeTensor shapes on every node)."""
    gm = tc.export_joint(captured.graph_module, captured.example_inputs)
    graph = gm.graph
    tensors: dict[str, Any] = dict(captured.graph_module.named_parameters(remove_duplicate=False))
    tensors |= dict(captured.graph_module.named_buffers(remove_duplicate=False))
    placeholders, by_desc, aliases = _placeholders(graph, tensors)
    output = graph.output_node()
    user, mutations, grads, grad_of = _outputs(output, by_desc)
    grad_pairs = _summed_grads(graph, grads, grad_of)

    names = {n.name: n for n in graph.nodes}
    kept = (*user, *(m for m, _ in mutations), *(g for g, _ in grad_pairs))
    output.args = (tuple(names[n] for n in kept),)
    output.meta.pop("desc", None)
    # The rewrites below replace nodes, a user output or a gradient among them (a model that
    # returns a dropout's result): they redirect the output node's uses, which are read back.
    _dropout_backward_as_eager(graph)
    _split_dropout(graph)
    _dropout_backward_vectorised(graph)
    final_nodes: tuple[torch.fx.Node, ...] = output.args[0]  # type: ignore[assignment]
    final = [n.name for n in final_nodes]
    nu, nm = len(user), len(mutations)
    user = final[:nu]
    mutations = [(n, m) for n, (_, m) in zip(final[nu : nu + nm], mutations, strict=True)]
    grad_pairs = [(n, g) for n, (_, g) in zip(final[nu + nm :], grad_pairs, strict=True)]
    drop_copies(graph)
    tangents = {p.name for p in placeholders if p.role is Role.TANGENT}
    sum_in_place(graph, backward_nodes(graph, tangents))
    graph.lint()
    gm.recompile()
    return JointGraph(
        graph_module=gm,
        placeholders=tuple(placeholders),
        user_outputs=tuple(user),
        mutations=tuple(mutations),
        grads=tuple(grad_pairs),
        param_aliases=tuple((k, *v) for k, v in aliases.items()),
    )


def _placeholders(
    graph: torch.fx.Graph, tensors: Mapping[str, Any]
) -> tuple[list[Placeholder], dict[Any, Placeholder], dict[str, list[str]]]:
    """The joint graph's inputs by their descriptors (parameter, buffer, user input,
    tangent), each descriptor's placeholder, and each tied parameter's other names. A
    parameter reached under several names (tied weights) is one placeholder: the later ones
    are erased and their uses redirected to the first."""
    placeholders: list[Placeholder] = []
    by_desc: dict[Any, Placeholder] = {}
    canonical: dict[int, torch.fx.Node] = {}  # id(parameter tensor) -> first placeholder
    aliases: dict[str, list[str]] = {}
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        desc = node.meta["desc"]
        ph: Placeholder
        if isinstance(desc, tc.ParamAOTInput):
            ph = Placeholder(node.name, Role.PARAM, _fqn(desc.target))
            first = canonical.setdefault(id(tensors[desc.target]), node)
            if first is not node:
                aliases.setdefault(_fqn(str(first.meta["desc"].target)), []).append(ph.key)  # type: ignore[arg-type]
                by_desc[desc] = by_desc[first.meta["desc"]]
                node.replace_all_uses_with(first)
                graph.erase_node(node)
                continue
        elif isinstance(desc, tc.BufferAOTInput):
            ph = Placeholder(node.name, Role.BUFFER, _fqn(desc.target))
        elif isinstance(desc, tc.PlainAOTInput):
            ph = Placeholder(node.name, Role.INPUT, desc.idx)
        elif isinstance(desc, tc.TangentAOTInput) and isinstance(desc.output, tc.PlainAOTOutput):
            ph = Placeholder(node.name, Role.TANGENT, desc.output.idx)
        else:
            raise NotImplementedError(f"unsupported joint-graph input {desc} ({node.name})")
        by_desc[desc] = ph
        placeholders.append(ph)
    return placeholders, by_desc, aliases


def _outputs(
    output: torch.fx.Node, by_desc: Mapping[Any, Placeholder]
) -> tuple[
    list[str],
    list[tuple[str, Placeholder]],
    dict[str, list[torch.fx.Node]],
    dict[str, Placeholder],
]:
    """The joint graph's outputs by their descriptors: the user outputs, the input mutations
    (with the input each writes), and the gradients per input (a tied parameter's come once
    per name) with the input each is for."""
    user: list[str] = []
    mutations: list[tuple[str, Placeholder]] = []
    grads: dict[str, list[torch.fx.Node]] = {}
    grad_of: dict[str, Placeholder] = {}
    returned: Any = output.args[0]
    for value, desc in zip(returned, output.meta["desc"], strict=True):
        if value is None:
            continue  # no gradient (an integer input, a buffer)
        if isinstance(desc, tc.PlainAOTOutput):
            if not isinstance(value, torch.fx.Node):
                raise NotImplementedError(
                    f"output {desc.idx} is not a tensor computed by the graph"
                )
            user.append(value.name)
        elif isinstance(desc, tc.InputMutationAOTOutput):
            mutations.append((value.name, by_desc[desc.mutated_input]))
        elif isinstance(desc, tc.GradAOTOutput):
            target = by_desc[desc.grad_of]
            grads.setdefault(target.name, []).append(value)
            grad_of[target.name] = target
        else:
            raise NotImplementedError(
                f"unsupported joint-graph output {desc}: remat does not handle this model yet "
                "(outputs aliasing each other or their inputs)"
            )
    return user, mutations, grads, grad_of


def _summed_grads(
    graph: torch.fx.Graph,
    grads: Mapping[str, list[torch.fx.Node]],
    grad_of: Mapping[str, Placeholder],
) -> list[tuple[str, Placeholder]]:
    """One gradient node per input: a tied parameter's several gradients summed, each sum
    after the later of its two terms, tagged as backward."""
    grad_pairs: list[tuple[str, Placeholder]] = []
    for target_name, nodes in grads.items():
        total = nodes[0]
        for extra in nodes[1:]:
            later = max(total, extra, key=_position(graph))
            with graph.inserting_after(later):
                total = graph.call_function(torch.ops.aten.add.Tensor, (total, extra))
            total.meta["val"] = _fake_add(total.args[0].meta["val"], extra.meta["val"])  # type: ignore[union-attr]
            total.meta["partitioner_tag"] = "is_backward"
        grad_pairs.append((total.name, grad_of[target_name]))
    return grad_pairs


def backward_nodes(graph: torch.fx.Graph, tangents: set[str]) -> set[str]:
    """The backward's nodes: tagged so by AOTAutograd, or reading an output gradient
    (``tangents``: their placeholders) or another backward node."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        tagged = node.meta.get("partitioner_tag") == "is_backward"
        if tagged or any(i.name in out or i.name in tangents for i in node.all_input_nodes):
            out.add(node.name)
    return out


def _split_dropout(graph: torch.fx.Graph) -> None:
    """Rewrite ``native_dropout(x, p, True)`` as a random bool mask and a deterministic product.

    The fused op makes its *output* random too, so a plan would have to save it (4 bytes per
    element) besides the mask. Split, only the mask (1 byte per element) must be saved and the
    output can be recomputed as ``x * mask * (1 / (1 - p))``, the mask converted to float by
    :func:`_mask_as_float`. On CPU this draws the same random numbers in the same order and
    gives bitwise-identical values for float32 inputs (checked by the zoo tests), the mask
    drawn in the input's memory order as eager's noise is (:func:`_memory_order`; drawn
    contiguous, the mask of Whisper's ``conv1d -> permute -> dropout`` got other elements'
    draws, outputs off by up to 2.19). For 16-bit inputs (autocast) the fused kernel draws its
    mask in the input's dtype and the split would not match it bit for bit: those stay fused. So do inputs on
    another device: eager CUDA runs the fused kernel (``is_fused_kernel_acceptable``), whose
    Philox draws a split ``bernoulli`` does not reproduce (seen on an H200: outputs off by up to
    29 with the split, bitwise without it).
    """
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.target is not aten.native_dropout.default:
            continue
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if not train or not isinstance(p, float) or not 0.0 < p < 1.0:
            continue
        if x.meta["val"].dtype != torch.float32 or x.meta["val"].device.type != "cpu":
            continue
        parts = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(parts) != len(node.users):
            continue
        mode = getattr(x.meta["val"], "fake_mode", None)
        xv = x.meta["val"]
        with mode or contextlib.nullcontext():
            # Reuse the fused op's fake outputs: downstream views share their fake storages,
            # which is how the problem knows those views allocate nothing.
            like = parts[1].meta["val"] if 1 in parts else torch.empty_like(xv, dtype=torch.bool)
            order = _memory_order(torch.empty_like(xv))
            if order is not None and not like.permute(order).is_contiguous():
                continue  # eager's noise and the fused mask disagree on the layout: keep fused
        new: list[torch.fx.Node] = []
        with graph.inserting_before(node):
            if order is None:
                empty = graph.call_function(aten.empty_like.default, (x,), {"dtype": torch.bool})
                mask = graph.call_function(aten.bernoulli.p, (empty, 1.0 - p))
                new += [empty, mask]
            else:
                shape = [xv.shape[d] for d in order]
                empty = graph.call_function(
                    aten.new_empty.default, (x, shape), {"dtype": torch.bool}
                )
                drawn = graph.call_function(aten.bernoulli.p, (empty, 1.0 - p))
                mask = graph.call_function(aten.permute.default, (drawn, _inverse(order)))
                new += [empty, drawn, mask]
        with mode or contextlib.nullcontext():
            if order is None:
                empty.meta["val"] = torch.empty_like(xv, dtype=torch.bool)
            else:
                empty.meta["val"] = like.new_empty(shape)
                drawn.meta["val"] = like.permute(order)  # the mask's storage, in memory order
            mask.meta["val"] = like
        with graph.inserting_before(node):
            as_bytes, as_float = _mask_as_float(graph, mask)
            masked = graph.call_function(aten.mul.Tensor, (x, as_float))
            out = graph.call_function(aten.mul.Tensor, (masked, 1.0 / (1.0 - p)))
        with mode or contextlib.nullcontext():
            masked.meta["val"] = torch.empty_like(xv)
            out.meta["val"] = parts[0].meta["val"] if 0 in parts else torch.empty_like(xv)
        for added in (*new, as_bytes, as_float, masked, out):
            added.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
            added.meta["seq_nr"] = node.meta.get("seq_nr")
            added.meta["partitioner_tag"] = node.meta.get("partitioner_tag")
        for index, replacement in ((0, out), (1, mask)):
            if index in parts:
                parts[index].replace_all_uses_with(replacement)
                graph.erase_node(parts[index])
        graph.erase_node(node)


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The dimensions of a dense ``t`` from outermost to innermost in memory, or None where
    that is their logical order (``t`` contiguous).

    Why: CPU ``bernoulli_`` fills its tensor in memory order, and eager dropout draws into
    ``empty_like(input)``, which keeps the input's layout; the functional ``bernoulli.p`` the
    split uses always returns a contiguous tensor. Drawn contiguous in this order and permuted
    back, the split's mask gets each element's draw at the same place in the sequence."""
    if t.is_contiguous() or t.numel() == 0:
        return None
    strides = t.stride()
    return sorted(range(t.dim()), key=lambda d: (t.shape[d] != 1, -strides[d]))


def _inverse(order: list[int]) -> list[int]:
    out = [0] * len(order)
    for position, dim in enumerate(order):
        out[dim] = position
    return out


def _mask_as_float(
    graph: torch.fx.Graph, mask: torch.fx.Node
) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A bool mask as float32 through a uint8 view, inserted where the graph's cursor is:
    the CPU's bool-to-float conversion is not vectorised (0.60 ms per million elements on
    one thread), uint8-to-float is (0.22 ms), and the values are the same 0.0 and 1.0.
    Returns the view and the conversion."""
    aten = torch.ops.aten
    as_bytes = graph.call_function(aten.view.dtype, (mask, torch.uint8))
    as_float = graph.call_function(aten._to_copy.default, (as_bytes,), {"dtype": torch.float32})
    mv = mask.meta["val"]
    with getattr(mv, "fake_mode", None) or contextlib.nullcontext():
        as_bytes.meta["val"] = mv.view(torch.uint8)
        as_float.meta["val"] = torch.empty_like(mv, dtype=torch.float32)
    return as_bytes, as_float


def _dropout_backward_vectorised(graph: torch.fx.Graph) -> None:
    """Rewrite a float32 ``native_dropout_backward(g, mask, scale)`` on CPU as the same
    products, ``(g * float(mask)) * scale``, with the mask converted by
    :func:`_mask_as_float`: the fused op multiplies by the bool mask directly, converting
    it element by element (1.41 ms per million elements on one thread, against ~1.1 ms).
    The same bits: ``g * mask`` promotes the mask to the same 0.0 and 1.0."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.target is not aten.native_dropout_backward.default:
            continue
        grad, mask, scale = node.args[0], node.args[1], node.args[2]
        gv, mv = grad.meta["val"], mask.meta["val"]
        if gv.dtype != torch.float32 or gv.device.type != "cpu" or mv.dtype != torch.bool:
            continue
        with graph.inserting_before(node):
            as_bytes, as_float = _mask_as_float(graph, mask)
            masked = graph.call_function(aten.mul.Tensor, (grad, as_float))
            out = graph.call_function(aten.mul.Tensor, (masked, scale))
        with getattr(gv, "fake_mode", None) or contextlib.nullcontext():
            masked.meta["val"] = torch.empty_like(gv)
        out.meta["val"] = node.meta["val"]
        for new in (as_bytes, as_float, masked, out):
            for key in ("nn_module_stack", "seq_nr", "partitioner_tag", "stack_trace"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _dropout_backward_as_eager(graph: torch.fx.Graph) -> None:
    """Rewrite a 16-bit ``native_dropout_backward(g, mask, scale)`` on CPU as eager autograd
    computes it: ``g * (mask.to(g.dtype) / (1 - p))``.

    On CPU eager ``F.dropout`` does not call the fused op (``is_fused_kernel_acceptable`` is
    CUDA/XPU-only): it draws ``noise`` in the input's dtype, ``noise.div_(1 - p)``, returns
    ``input * noise``, and ``MulBackward`` gives ``g * noise``, the scale rounded to the 16-bit
    dtype. The traced graph's ``native_dropout_backward`` is ``g * mask * scale`` with the scale
    kept in float: different bits unless ``1 / (1 - p)`` is exact in 16 bits (p = 0.5, 0.2).
    The forward of the fused op already equals eager's and is left alone; float32 is left
    alone too (checked bitwise by the zoo tests). The new nodes are backward-only, so the
    saved values (the bool mask) do not change.
    """
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.target is not aten.native_dropout_backward.default:
            continue
        grad, mask, scale = node.args[0], node.args[1], node.args[2]
        gv = grad.meta["val"]
        if gv.dtype not in (torch.bfloat16, torch.float16) or gv.device.type != "cpu":
            continue
        if not isinstance(scale, float) or scale == 0.0:
            continue
        keep = 1.0 / scale  # 1 - p, taken from the forward op itself where it can be found
        source = mask.args[0] if mask.target is operator.getitem else None
        if source is not None and source.target is aten.native_dropout.default:
            keep = 1.0 - source.args[1]
        mode = getattr(gv, "fake_mode", None)
        with graph.inserting_before(node):
            as_float = graph.call_function(aten._to_copy.default, (mask,), {"dtype": gv.dtype})
            noise = graph.call_function(aten.div.Tensor, (as_float, keep))
            out = graph.call_function(aten.mul.Tensor, (grad, noise))
        with mode or contextlib.nullcontext():
            as_float.meta["val"] = torch.empty_like(mask.meta["val"], dtype=gv.dtype)
            noise.meta["val"] = torch.empty_like(as_float.meta["val"])
        out.meta["val"] = node.meta["val"]
        for new in (as_float, noise, out):
            for key in ("nn_module_stack", "seq_nr", "partitioner_tag", "stack_trace"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _position(graph: torch.fx.Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _fake_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mode = getattr(a, "fake_mode", None)
    if mode is None:
        return torch.add(a, b)
    with mode:
        return torch.add(a, b)
