"""Kernel scratch memory: the bytes an op allocates and frees inside itself.

A live-storage meter (and the simulator, which counts the same storages) sees an op's inputs and
outputs, never what its kernel allocates internally and frees before returning: an internal
``contiguous()`` copy, ``native_dropout_backward``'s ``grad * mask`` before the scale, a CPU
convolution's workspace, the per-thread buffers of CPU flash attention. The allocator sees them,
and that is where a step runs out of memory (on a GPT-NeoX toy, keep-matmuls ran 4 MiB, 10%,
above its live peak inside the attention dropout's backward).

They cannot be derived from shapes, so they are measured: each distinct op signature (the op,
its tensor arguments' shapes, strides, offsets and dtypes, its other arguments, the thread
count) runs once on tensors of the captured layout, on the device the graph was captured on,
under the allocator's own accounting; the result is cached for the process. An op's scratch is
``peak - outputs``: the most its own allocations held at once, less what it returned, so the
simulator's live bytes at that op plus its scratch are the allocator's peak inside it.

Graphs of FakeTensor models (shapes that cannot run here) are not measured: their scratch is
0 and the problem says so (``metadata["scratch"]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remat import _torch_compat as tc
from remat.measure.meter import allocator_profile
from remat.measure.profiles import GPU_PROFILES

__all__ = [
    "Call",
    "call_of",
    "device_of",
    "measure_calls",
    "measure_graph",
    "measure_scratch",
    "where_measured",
    "where_measured_on",
]

_LABEL = "remat::scratch::"
_CACHE: dict[tuple[Any, ...], tuple[int, int]] = {}
"""(scratch, output bytes) by call signature."""


@dataclass(frozen=True)
class TensorLayout:
    """A tensor argument as the kernel sees it; ``group`` numbers the call's distinct
    storages (arguments sharing a storage share one when the call is re-created)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_bytes: int
    dtype: torch.dtype
    device: torch.device
    group: int


@dataclass(frozen=True)
class Call:
    """An op call described by its arguments' layouts: it holds no tensor, so recording one
    keeps no storage alive (a tracer records a call per op of a step and measures after)."""

    op: Any
    spec: Any
    """The pytree spec of ``(args, kwargs)``."""
    leaves: tuple[Any, ...]
    """:class:`TensorLayout` where a tensor goes, the value itself elsewhere."""

    @property
    def key(self) -> tuple[Any, ...]:
        """The signature scratch is cached by (the thread count changes CPU kernels' buffers)."""
        leaves = tuple(x if isinstance(x, TensorLayout) else repr(x) for x in self.leaves)
        return (str(self.op), str(self.spec), torch.get_num_threads(), leaves)


def call_of(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Call | None:
    """The call ``op(*args, **kwargs)`` as layouts (FakeTensors or real ones), or None for a
    call that is not measured: not an ATen op (collectives and other namespaces must not run
    for real here), a view (no kernel), no tensor argument, or a tensor off CPU and CUDA."""
    if not isinstance(op, tc.OpOverload) or op.namespace != "aten" or op.is_view:
        return None
    leaves, spec = tc.tree_flatten((args, dict(kwargs)))
    groups: dict[int, int] = {}
    out: list[Any] = []
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if x.device.type not in ("cpu", "cuda") or x.layout != torch.strided:
            return None
        group = groups.setdefault(tc.storage_key(x), len(groups))
        out.append(
            TensorLayout(
                shape=tuple(x.shape),
                stride=tuple(x.stride()),
                offset=int(x.storage_offset()),
                storage_bytes=x.untyped_storage().nbytes(),
                dtype=x.dtype,
                device=x.device,
                group=group,
            )
        )
    if not groups:
        return None
    return Call(op, spec, tuple(out))


def where_measured(model: torch.nn.Module, profile_name: str) -> str | None:
    """Where kernel scratch of ``model``'s step is measured, or None if it is not: only on the
    device the plan is for, with real tensors (a FakeTensor model's shapes may not fit here;
    a CPU model planned for a GPU profile would measure CPU kernels)."""
    return where_measured_on(device_of(model), profile_name)


def device_of(model: torch.nn.Module) -> torch.device | None:
    """The device of ``model``'s tensors, or None for a FakeTensor model."""
    if tc.fake_mode_of(model) is not None:
        return None
    return next((t.device for t in model.parameters()), torch.device("cpu"))


def where_measured_on(device: torch.device | None, profile_name: str) -> str | None:
    """:func:`where_measured` for a model on ``device`` (None: FakeTensors)."""
    if device is None or (device.type == "cpu" and profile_name in GPU_PROFILES):
        return None
    where = f"measured on {device.type}"
    if device.type == "cpu":
        where += f" with {torch.get_num_threads()} threads"
    return where


def _realize(call: Call, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Real tensors of the call's layouts (size, stride, offset, storage size, dtype,
    device); arguments that shared a storage share one here too. Integers are 0 (a valid
    index), floating values uniform in [0, 1)."""
    bases: dict[int, torch.Tensor] = {}
    leaves = []
    for x in call.leaves:
        if not isinstance(x, TensorLayout):
            leaves.append(x)
            continue
        if x.group not in bases:
            raw = torch.zeros(x.storage_bytes, dtype=torch.uint8, device=x.device)
            if x.dtype.is_floating_point and x.storage_bytes:
                size = x.storage_bytes // x.dtype.itemsize
                values = torch.rand(size, generator=generator, device="cpu").to(x.dtype)
                raw[: size * x.dtype.itemsize].view(x.dtype).copy_(values)
            bases[x.group] = raw
        raw = bases[x.group]
        usable = raw.numel() - raw.numel() % x.dtype.itemsize
        typed = raw[:usable].view(x.dtype)
        leaves.append(typed.as_strided(x.shape, x.stride, x.offset))
    args, kwargs = tc.tree_unflatten(leaves, call.spec)
    return tuple(args), dict(kwargs)


def _in_op_extra(events: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Most bytes an op's own allocations held at once, less what it still holds at the end;
    and what it still holds (its outputs' storages as the kernel made them)."""
    live = peak = 0
    mine: set[int] = set()
    for _, nbytes, address in events:
        if nbytes >= 0:
            mine.add(address)
        elif address in mine:
            mine.discard(address)
        else:
            continue  # an input's block, resized or freed by the op: not scratch
        live += nbytes
        peak = max(peak, live)
    return max(0, peak - live), live


def _measure_cpu(
    runs: list[tuple[tuple[Any, ...], Callable[[], Any]]],
) -> dict[Any, tuple[int, int]]:
    kept: list[Any] = []  # outputs stay referenced until the op's label has closed
    with allocator_profile() as prof:
        for k, (_, call) in enumerate(runs):
            with torch.profiler.record_function(f"{_LABEL}{k}"):
                kept.append(call())
            kept.clear()
    events = tc.allocator_events_by_label(prof, _LABEL)
    return {sig: _in_op_extra(events.get(f"{_LABEL}{k}", [])) for k, (sig, _) in enumerate(runs)}


def _measure_cuda(
    runs: list[tuple[tuple[Any, ...], Callable[[], Any]]],
) -> dict[Any, tuple[int, int]]:
    out = {}
    for sig, call in runs:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        held = torch.cuda.memory_allocated() - before
        del result
        out[sig] = (max(0, peak - held), held)
    return out


def measure_scratch(calls: Sequence[Call]) -> list[int]:
    """Scratch bytes of each call run on real tensors of its layouts (cached per signature;
    global random state untouched). An op that fails on such made-up values (a
    data-dependent kernel) counts 0."""
    return [scratch for scratch, _ in measure_calls(calls)]


def measure_calls(calls: Sequence[Call]) -> list[tuple[int, int]]:
    """:func:`measure_scratch`, and the bytes each call's outputs hold on the device."""
    keys = [c.key for c in calls]
    todo: dict[tuple[Any, ...], Call] = {}
    for key, call in zip(keys, calls, strict=True):
        if key not in _CACHE:
            todo.setdefault(key, call)
    generator = torch.Generator().manual_seed(0)
    by_device: dict[str, list[tuple[tuple[Any, ...], Callable[[], Any]]]] = {}
    for key, call in todo.items():
        args, kwargs = _realize(call, generator)
        cuda = any(isinstance(x, TensorLayout) and x.device.type == "cuda" for x in call.leaves)

        def run(op: Any = call.op, a: Any = args, kw: Any = kwargs) -> Any:
            """Made-up values: an op may fail on them (see the docstring)."""
            try:
                return op(*a, **kw)
            except Exception:  # noqa: BLE001 - made-up values; see the docstring
                return None

        by_device.setdefault("cuda" if cuda else "cpu", []).append((key, run))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for device, runs in by_device.items():
            _CACHE.update(_measure_cuda(runs) if device == "cuda" else _measure_cpu(runs))
    return [_CACHE[k] for k in keys]


def measure_graph(graph_module: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """(scratch, output bytes) of every ATen op node of a captured graph, by node name
    (cached per signature). Output bytes are what the outputs hold as the device's kernel
    made them: a kernel may return a tensor viewing a larger buffer than its shape needs
    (CPU ``mse_loss`` and ``smooth_l1_loss`` return a scalar viewing the elementwise
    losses), which the FakeTensor's storage does not show."""
    names: list[str] = []
    calls: list[Call] = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        call = call_of(node.target, tuple(args), dict(kwargs))
        if call is not None:
            names.append(node.name)
            calls.append(call)
    return dict(zip(names, measure_calls(calls), strict=True))
