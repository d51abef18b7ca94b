"""Buffers the traced graph allocates where eager PyTorch does not: copies that copy nothing,
and gradient sums eager autograd runs in place.

**Copies.** Decompositions turn some identities into copies: ``F.dropout(x, 0.0)`` returns
``x`` itself in eager mode, but its decomposition is ``x.clone()``. A clone that keeps the
layout of a value the step computed (dense, the whole storage) is replaced by that value: the
graph is functional, so nothing can tell them apart, and it allocates a buffer less.

**Sums.** Where a value feeds several ops, its gradient is the sum of their contributions, and
eager autograd's input buffer adds each new contribution into the first one's buffer
(``old.add_(new)``) when it holds the last reference to a dense tensor; the functional graph
has ``add(old, new)``, a new buffer. Run as traced, each sum allocates and writes cold memory
and holds a buffer more than eager at that moment. So each such ``add`` runs as ``add_`` on its
first operand where eager's would: a backward value whose storage it alone covers (same size,
layout and dtype as the sum) and that nothing reads after the sum.

Both give the same bits (no copy changes a value; the sum is the same kernel on the same
operands), and the problem sees each buffer the run holds (the sum holds its first operand's
storage, a replaced clone's users hold its input's), so every memory figure follows the run.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from remat import _torch_compat as tc

__all__ = ["drop_copies", "sum_in_place"]


def _tensor(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


class _Storages:
    """Which nodes hold each fake storage (by key), and where it is last read (the output
    node reads at the end), kept as sums are moved onto their first operand's storage."""

    def __init__(self, graph: fx.Graph) -> None:
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.holders: dict[int, list[fx.Node]] = {}
        self.last: dict[int, int] = {}
        self.opaque: set[int] = set()
        """Storages some node holds through a value other than one tensor (a list of views)."""
        for node in graph.nodes:
            val = node.meta.get("val")
            for t in tc.tree_leaves(val):
                if not isinstance(t, torch.Tensor):
                    continue
                key = tc.storage_key(t)
                self.holders.setdefault(key, []).append(node)
                end = max((self.order[u] for u in node.users), default=self.order[node])
                self.last[key] = max(self.last.get(key, -1), end)
                if not isinstance(val, torch.Tensor):
                    self.opaque.add(key)

    def move(self, src: int, dst: torch.Tensor) -> None:
        """Every holder of storage ``src`` now views ``dst``'s storage, at the same shape,
        strides and offset."""
        key = tc.storage_key(dst)
        mode = getattr(dst, "fake_mode", None)
        for node in self.holders.pop(src):
            val = node.meta["val"]
            with mode or contextlib.nullcontext():
                node.meta["val"] = torch.as_strided(
                    dst, val.shape, val.stride(), val.storage_offset()
                )
            self.holders[key].append(node)
        self.last[key] = max(self.last[key], self.last.pop(src))


def _dense(t: torch.Tensor) -> bool:
    """Covers its whole storage, contiguously."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _operand(node: fx.Node, storages: _Storages) -> tuple[fx.Node, torch.Tensor, int, int] | None:
    """``node``'s first argument, its value, and the keys of its storage and of ``node``'s,
    where the two values are single tensors on distinct storages of the same dtype, shape and
    strides, each dense over its whole storage (so either can stand for the other)."""
    first, out = node.args[0] if node.args else None, _tensor(node)
    val = _tensor(first)
    if out is None or val is None or not isinstance(first, fx.Node):
        return None
    key, out_key = tc.storage_key(val), tc.storage_key(out)
    if key == out_key or {key, out_key} & storages.opaque or not (_dense(val) and _dense(out)):
        return None
    if val.dtype != out.dtype or val.shape != out.shape or val.stride() != out.stride():
        return None
    return first, val, key, out_key


def sum_in_place(graph: fx.Graph, backward: set[str]) -> int:
    """Make every gradient sum of the backward (``backward``: its node names) that eager
    would run in place an ``add_`` on its first operand (module docstring). Returns how many."""
    add = torch.ops.aten.add.Tensor
    storages = _Storages(graph)
    order = storages.order
    done = 0
    for node in list(graph.nodes):
        if node.target is not add or node.name not in backward or len(node.args) != 2:
            continue
        if node.kwargs.get("alpha", 1) != 1:
            continue
        found = _operand(node, storages)
        if found is None:
            continue
        old, val, key, out_key = found
        owner = storages.holders[key][0]
        if owner.name not in backward or owner.op != "call_function":
            continue  # a parameter's, an input's, an output gradient's or a forward value's
        if storages.last[key] != order[node]:
            continue  # read after the sum
        node.target = torch.ops.aten.add_.Tensor
        storages.move(out_key, val)
        done += 1
    return done


def drop_copies(graph: fx.Graph) -> int:
    """Replace every ``clone`` that copies nothing (module docstring) by its input: a dense
    value of a node of the step (not a parameter's, buffer's, input's or output gradient's
    storage), cloned to the same layout, where neither the clone nor a view of it is an output
    of the graph. Returns how many."""
    storages = _Storages(graph)
    output = graph.output_node()
    done = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.clone.default or node.kwargs.get(
            "memory_format", torch.preserve_format
        ) not in (torch.preserve_format, torch.contiguous_format):
            continue
        found = _operand(node, storages)
        if found is None:
            continue
        src, val, key, out_key = found
        if storages.holders[key][0].op != "call_function":
            continue  # a parameter's, a buffer's, an input's or an output gradient's
        if any(output in h.users for h in storages.holders[out_key]):
            continue
        storages.move(out_key, val)
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        done += 1
    return done
