"""What a user would run instead of remat, measured on one CPU training step.

Every peer runs on a deep copy of the model (same parameters) and one training step as
:func:`remat.measure.meter.training_step` defines it (forward, backward with dense random output
gradients from their own generator, global RNG seeded the same), so its outputs and gradients
can be compared bitwise with eager's and its peak with remat's. A :class:`Row` reports the
peak of live tensor storages (:class:`remat.measure.meter.LiveMemoryMeter`), the allocator-level peak
(:func:`remat.measure.meter.allocator_peak_bytes`, which also sees kernel scratch memory), the FLOPs it
recomputes, and whether outputs and gradients equal eager's.

Peers:

- :func:`memory_budget_peer`: ``torch.compile`` with AOTAutograd's min-cut partitioner (the
  ``aot_eager`` recipe) under ``torch._functorch.config.activation_memory_budget``;
- :func:`hf_checkpoint_peer`: Hugging Face's per-layer checkpointing (``use_reentrant=False``);
- :func:`block_checkpoint_peer`: ``torch.utils.checkpoint`` around every block of the model's
  ``ModuleList``, or around groups of ceil(sqrt(L)) blocks (Chen et al.'s segments).

Pitfalls found while building this: the partitioner's budget is not part
of Dynamo's guards, so Dynamo is reset for every budget; compilation (forward and, lazily, the
backward) happens in a warm-up step outside the meter; the meter itself must tell Dynamo to
ignore it (:meth:`remat.measure.meter.LiveMemoryMeter.ignore_compile_internals`), or the "compiled"
step silently runs eagerly.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from remat import _torch_compat as tc
from remat.measure.costs import node_flops
from remat.measure.meter import LiveMemoryMeter, allocator_peak_bytes, training_step


@dataclass(frozen=True)
class Row:
    peer: str
    setting: str
    peak_bytes: int
    allocator_peak_bytes: int
    recompute_flops: int | None
    equal: bool
    """Outputs and every parameter gradient ``torch.equal`` to eager's."""
    differing: int
    """Outputs and gradients that differ."""


@dataclass(frozen=True)
class Reference:
    outputs: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor | None, ...]
    peak_bytes: int
    flops: int


def step(module: nn.Module, args: tuple[Any, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One training step from cleared gradients, the global RNG seeded."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(1000 + seed)
    return training_step(module, args, seed=seed)


def step_flops(module: nn.Module, args: tuple[Any, ...]) -> int:
    """FLOPs of one step, recomputation included (SDPA's CPU kernels counted by shape)."""
    with FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flops()) as counter:
        step(module, args)
    return int(counter.get_total_flops())


def _cpu_sdpa_flops() -> dict[Any, Any]:
    aten = torch.ops.aten

    # FlopCounterMode hands custom formulas the shapes of tensor arguments.
    def fwd(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
        return int(tc.sdpa_flop_count(q, k, v))

    def bwd(g: Any, q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
        return int(tc.sdpa_backward_flop_count(g, q, k, v))

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd,
    }


def measure(
    module: nn.Module, params_of: nn.Module, args: tuple[Any, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...], int, int]:
    """(outputs, gradients, live peak, allocator peak) of one metered step after a warm-up."""
    step(module, args)  # warm-up: compilation, lazy initialisation
    with LiveMemoryMeter() as meter:
        outputs = step(module, args)
    grads = tuple(
        None if p.grad is None else p.grad.detach().clone() for p in params_of.parameters()
    )
    alloc = allocator_peak_bytes(lambda: step(module, args))
    return outputs, grads, meter.peak_bytes, alloc


def eager_reference(model: nn.Module, args: tuple[Any, ...]) -> Reference:
    m = copy.deepcopy(model)
    outputs, grads, peak, _ = measure(m, m, args)
    return Reference(outputs, grads, peak, step_flops(m, args))


def differing(ref: Reference, outputs: tuple[torch.Tensor, ...], grads: tuple[Any, ...]) -> int:
    pairs = list(zip(ref.outputs, outputs, strict=True)) + list(zip(ref.grads, grads, strict=True))
    return sum(
        1
        for a, b in pairs
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))
    )


def _row(
    peer: str,
    setting: str,
    module: nn.Module,
    params_of: nn.Module,
    args: tuple[Any, ...],
    ref: Reference,
    recompute_flops: int | None,
) -> Row:
    outputs, grads, peak, alloc = measure(module, params_of, args)
    n = differing(ref, outputs, grads)
    return Row(peer, setting, peak, alloc, recompute_flops, n == 0, n)


def eager_row(model: nn.Module, args: tuple[Any, ...], ref: Reference) -> Row:
    m = copy.deepcopy(model)
    return _row("eager", "", m, m, args, ref, 0)


# ----------------------------------------------------------------- torch's memory budget


def _compiled(
    model: nn.Module, args: tuple[Any, ...], budget: float
) -> tuple[nn.Module, nn.Module, int]:
    """A deep copy compiled under ``budget`` and warmed up, its copy, and the FLOPs of forward
    ops its backward graph runs again (-1 when graph breaks make them unattributable)."""
    tc.dynamo_reset()
    graphs: dict[str, list[torch.fx.GraphModule]] = {"fw": [], "bw": []}
    backend = tc.min_cut_backend(graphs["fw"].append, graphs["bw"].append)
    m = copy.deepcopy(model)
    compiled = cast(nn.Module, torch.compile(m, backend=backend))
    with tc.activation_memory_budget(budget):
        step(compiled, args)  # compiles the forward, and the backward at its first call
    flops = -1
    if len(graphs["fw"]) == len(graphs["bw"]) == 1:
        fw_names = {n.name for n in graphs["fw"][0].graph.nodes if n.op == "call_function"}
        flops = sum(
            node_flops(n)
            for n in graphs["bw"][0].graph.nodes
            if n.op == "call_function" and n.name in fw_names
        )
    return compiled, m, flops


def memory_budget_peer(
    model: nn.Module, args: tuple[Any, ...], budget: float, ref: Reference
) -> Row:
    """PyTorch's partitioner at ``activation_memory_budget = budget``. Recompute FLOPs: remat's
    FLOP registry over the backward graph's nodes that share a name with a forward node (how
    the partitioner's debug log counts recomputed ops); None with graph breaks."""
    compiled, m, flops = _compiled(model, args, budget)
    row = _row("torch_budget", f"{budget:g}", compiled, m, args, ref, None if flops < 0 else flops)
    tc.dynamo_reset()
    return row


def memory_budget_step(model: nn.Module, args: tuple[Any, ...], budget: float) -> Callable[[], Any]:
    compiled, _, _ = _compiled(model, args, budget)
    return functools.partial(step, compiled, args)


# ----------------------------------------------------------------- eager checkpointing


def hf_checkpoint_peer(model: nn.Module, args: tuple[Any, ...], ref: Reference) -> Row:
    """``gradient_checkpointing_enable()``: every decoder layer checkpointed."""
    m = hf_checkpointed(model)
    return _row("hf_checkpointing", "every layer", m, m, args, ref, step_flops(m, args) - ref.flops)


def hf_checkpointed(model: nn.Module) -> nn.Module:
    m = copy.deepcopy(model)
    kwargs = {"use_reentrant": False}
    enable = getattr(m, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5: gradient_checkpointing_enable is deprecated
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    return m


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its longest ``nn.ModuleList``."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks")
    return max(lists, key=len)


def block_checkpointed(model: nn.Module, group: int | str = 1) -> nn.Module:
    """A deep copy with ``checkpoint(use_reentrant=False)`` around every ``group`` blocks
    (``"sqrt"``: ceil(sqrt(L))). Only the blocks' ``forward`` is replaced, so parameters and
    ``state_dict`` are unchanged. A group's first block runs the whole group; the others pass
    its output on, which needs block i+1 to read block i's output, as transformers do."""
    m = copy.deepcopy(model)
    blocks = find_blocks(m)
    k = math.ceil(math.sqrt(len(blocks))) if group == "sqrt" else int(group)
    if k == 1:  # each block on its own: no assumption on how blocks are chained
        for b in blocks:
            b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)  # type: ignore[method-assign]
        return m
    fwd = [b.forward for b in blocks]
    for start in range(0, len(blocks), k):
        members = list(range(start, min(start + k, len(blocks))))
        cell: dict[str, Any] = {}

        def run(x: Any, *a: Any, _m: list[int] = members, **kw: Any) -> Any:
            out = None
            for i in _m:
                out = fwd[i](x, *a, **kw)
                x = out if isinstance(out, torch.Tensor) else out[0]
            return out

        def first(*a: Any, _run: Any = run, _cell: dict[str, Any] = cell, **kw: Any) -> Any:
            out = checkpoint(_run, *a, use_reentrant=False, **kw)
            _cell["out"] = out
            return out

        def passthrough(*a: Any, _cell: dict[str, Any] = cell, **kw: Any) -> Any:
            return _cell["out"]

        blocks[members[0]].forward = first  # type: ignore[method-assign]
        for i in members[1:]:
            blocks[i].forward = passthrough  # type: ignore[method-assign]
        # The cell must not keep the group's output alive after its last block.
        blocks[members[-1]].register_forward_hook(lambda mod, a, o, _cell=cell: _cell.clear())
    return m


def block_checkpoint_peer(
    model: nn.Module, args: tuple[Any, ...], ref: Reference, group: int | str = 1
) -> Row:
    """Recompute FLOPs measured (checkpointed step's FLOPs minus eager's): non-reentrant
    checkpoint stops replaying once nothing later is needed, so it is less than a block's
    forward."""
    m = block_checkpointed(model, group)
    n = len(find_blocks(model))
    k = math.ceil(math.sqrt(n)) if group == "sqrt" else int(group)
    setting = (
        "every block"
        if k == 1
        else f"segments of {k} blocks" + (" (sqrt L)" if group == "sqrt" else "")
    )
    return _row("torch_checkpoint", setting, m, m, args, ref, step_flops(m, args) - ref.flops)


# ----------------------------------------------------------------- time


def step_times(steps: dict[str, Callable[[], Any]], reps: int = 5) -> dict[str, float]:
    """Median seconds of each function: one thread, one warm-up each, then ``reps``
    interleaved rounds (a, b, c, a, b, c, ...)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in steps.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(reps):
            for k, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {k: statistics.median(v) for k, v in times.items()}


def time_ratio(steps: dict[str, Callable[[], Any]], reps: int = 5) -> dict[str, float]:
    """Median step time of each function over eager's (``steps["eager"]``), as
    :func:`step_times` measures them."""
    medians = step_times(steps, reps)
    return {k: t / medians["eager"] for k, t in medians.items()}
