"""Capture ``model(*args, **kwargs)`` as an FX graph of ATen ops with FakeTensor shapes.

``torch.export.export(..., strict=False)`` is the primary path: it handles Hugging Face models,
which ``torch.fx.symbolic_trace`` cannot. ``symbolic_trace`` remains as a fallback for plain
modules that export rejects. Either way the model is wrapped so the graph takes a flat tuple of
tensors and returns a flat tuple of tensors; the output structure (tuple, dict, ``ModelOutput``,
non-tensor leaves) is recorded and rebuilt at run time.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import os
import sys
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat import _torch_compat as tc
from remat.measure.autocast import autocast_for

PREFIX = "model."
"""Names of parameters and buffers inside the captured wrapper start with this."""


class CaptureError(RuntimeError):
    """The model could not be captured as a graph; the message says where and what to try."""


@dataclass(frozen=True)
class OutputLayout:
    """How to rebuild the model's output from the graph's flat tensor outputs."""

    spec: tc.TreeSpec
    tensor_positions: tuple[int, ...]
    """Positions, among the output leaves, of the tensors the graph returns."""
    constants: Mapping[int, Any]
    """Non-tensor leaves, by position."""

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves: list[Any] = [None] * self.spec.num_leaves
        for pos, value in self.constants.items():
            leaves[pos] = value
        for pos, t in zip(self.tensor_positions, tensors, strict=True):
            leaves[pos] = t
        return tc.tree_unflatten(leaves, self.spec)


@dataclass(frozen=True)
class InputLayout:
    """How a call's arguments map to the graph's flat tensor inputs."""

    num_args: int
    tensor_kwargs: tuple[str, ...]
    constant_kwargs: Mapping[str, Any]

    def flatten(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        return [*args, *(kwargs[k] for k in self.tensor_kwargs)]


@dataclass(frozen=True)
class Captured:
    graph_module: nn.Module
    """Takes the flat input tensors, returns the flat output tensors; parameters are attributes
    named ``model.<fqn>``. A GraphModule of ATen ops when exported; the traced module wrapped
    when captured by ``symbolic_trace``."""
    method: str
    """``export`` or ``symbolic_trace``."""
    inputs: InputLayout
    outputs: OutputLayout
    example_inputs: tuple[torch.Tensor, ...]
    branches: tuple[Branch, ...] = ()
    """Data-dependent tests of Hugging Face's mask code the graph was traced on (see
    :func:`_eager_mask_branch`); a call must pass them all to run this graph."""

    def takes_branches_of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        if not self.branches:
            return True
        flat = self.inputs.flatten(args, kwargs)
        return all(b.holds(flat) for b in self.branches)


class _FlatModel(nn.Module):
    """Calls the model with flat tensor inputs and returns its tensor leaves as a flat tuple."""

    def __init__(
        self,
        model: nn.Module,
        inputs: InputLayout,
        record: list[OutputLayout],
        autocast: torch.dtype | None = None,
        autocast_policy: str = "native",
    ) -> None:
        super().__init__()
        self.model = model
        self.layout = inputs
        # A list we append to, not an attribute we set: tracers may restore module attributes.
        self.record = record
        self.autocast = autocast
        self.autocast_policy = autocast_policy

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.layout.num_args
        kwargs = dict(zip(self.layout.tensor_kwargs, flat[n:], strict=True))
        if self.autocast is None:
            out = self.model(*flat[:n], **kwargs, **self.layout.constant_kwargs)
        else:
            device = flat[0].device.type if flat else "cpu"
            with autocast_for(device, self.autocast, self.autocast_policy):
                out = self.model(*flat[:n], **kwargs, **self.layout.constant_kwargs)
        leaves, spec = tc.tree_flatten(out)
        positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        self.record.append(OutputLayout(spec, positions, constants))
        return tuple(leaves[i] for i in positions)


def under_autocast(
    device_type: str,
    dtype: torch.dtype | None,
    enabled: bool,
    cache_enabled: bool | None,
    target: Any,
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run one op of an autocast region under that region's autocast settings."""
    with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        return target(*args, **kwargs)


def inline_autocast(gm: torch.fx.GraphModule) -> None:
    """Replace export's ``wrap_with_autocast`` regions by their ops, each run under the region's
    autocast settings (:func:`under_autocast`).

    Same values (autocast acts op by op), but every op keeps its own node metadata: traced
    through the region as a whole, the joint graph's ops would all inherit the region's
    metadata and lose their module paths.
    """
    hop = tc.wrap_with_autocast
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        body = getattr(gm, node.args[4].target)
        outputs = _inline_region(gm, node.args[:4], body, node.args[5:], node)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise CaptureError("an autocast region's output is used other than by indexing")
        sub = node.args[4]
        graph.erase_node(node)
        if not sub.users:
            graph.erase_node(sub)
    graph.lint()
    gm.recompile()


def _inline_region(
    gm: torch.fx.GraphModule,
    settings: tuple[Any, ...],
    body: torch.fx.GraphModule,
    operands: tuple[Any, ...],
    anchor: torch.fx.Node,
) -> list[Any]:
    """Copy ``body``'s ops before ``anchor``, each wrapped in :func:`under_autocast`; nested
    regions recursively with their own settings (the innermost context wins, as in eager)."""
    hop = tc.wrap_with_autocast
    graph = gm.graph
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    for inner in body.graph.nodes:
        if inner.op == "placeholder":
            continue
        if inner.op == "output":
            return list(torch.fx.node.map_arg(inner.args[0], env.__getitem__))
        if inner.op == "get_attr":
            env[inner] = getattr(body, inner.target)  # a nested region's body
            continue
        if inner.op != "call_function":
            raise CaptureError(f"unexpected {inner.op} node in an autocast region")
        if inner.target is hop:
            env[inner] = _inline_region(
                gm,
                inner.args[:4],
                env[inner.args[4]],
                tuple(torch.fx.node.map_arg(inner.args[5:], env.__getitem__)),
                anchor,
            )
            continue
        if inner.target is operator.getitem and isinstance(env.get(inner.args[0]), list):
            env[inner] = env[inner.args[0]][inner.args[1]]
            continue
        args = torch.fx.node.map_arg(inner.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(inner.kwargs, env.__getitem__)
        with graph.inserting_before(anchor):
            if isinstance(inner.target, tc.OpOverload):
                new = graph.call_function(under_autocast, (*settings, inner.target, *args), kwargs)
            else:  # operator.getitem and the like: no dispatch, nothing to autocast
                new = graph.call_function(inner.target, args, kwargs)
        new.meta = dict(inner.meta)
        env[inner] = new
    raise CaptureError("an autocast region without an output")


def input_layout(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> InputLayout:
    """Validate example inputs and split kwargs into tensors and constants."""
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise ValueError(
                f"example input {i} is a {type(a).__name__}, not a tensor; pass non-tensor "
                "arguments as keyword arguments (they are treated as constants)"
            )
    named = [(f"example input {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword input {k!r}", v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    named += [(f"parameter {n!r}", p) for n, p in model.named_parameters()]
    named += [(f"buffer {n!r}", b) for n, b in model.named_buffers()]
    for what, t in named:
        _check_tensor(what, t)
    tensor_kwargs = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    if "use_cache" not in kwargs and _accepts(model, "use_cache"):
        # A KV cache is inference machinery: in training it is pure memory and graph noise.
        constants["use_cache"] = False
    return InputLayout(len(args), tensor_kwargs, constants)


def _check_tensor(what: str, t: torch.Tensor) -> None:
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        raise ValueError(
            f"{what} is a {t.layout} {'quantized ' if t.is_quantized else ''}tensor; remat plans "
            "dense (strided) tensors only"
        )
    if t.device.type == "meta":
        raise ValueError(
            f"{what} is on the meta device, whose backward traces as empty; to plan a model "
            "too large for this machine, build it and its inputs under remat.fake_mode()"
        )


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def capture(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "auto",
    autocast: torch.dtype | None = None,
    autocast_policy: str = "native",
) -> Captured:
    """Trace ``model(*args, **kwargs)``; ``method`` is ``auto``, ``export`` or ``symbolic_trace``.

    ``autocast``: trace under ``torch.autocast`` with this 16-bit dtype (mixed precision): the
    graph then holds the casts, and its activations have the sizes mixed precision gives them.
    ``autocast_policy``: ``cuda`` casts as CUDA autocast does although the tensors are on the
    CPU (:mod:`remat.measure.autocast`: plans for a GPU profile); ``native``: the tensors' own.

    The model is not modified: its parameters, buffers and training flags are as before.
    """
    if method not in ("auto", "export", "symbolic_trace"):
        raise ValueError(f"unknown capture method {method!r}; valid: auto, export, symbolic_trace")
    kwargs = dict(kwargs or {})
    layout = input_layout(model, args, kwargs)
    differentiable_input = any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in layout.flatten(args, kwargs)
    )
    if not differentiable_input and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): "
            "there is no backward pass to plan"
        )
    flat_inputs = tuple(layout.flatten(args, kwargs))
    record: list[OutputLayout] = []
    wrapper = _FlatModel(model, layout, record, autocast, autocast_policy)
    functions = _CustomFunctions()
    with tc.autograd_functions_applied(functions.on_apply):
        gm, used, branches = _trace(model, wrapper, layout, record, flat_inputs, method)
    if functions.seen:
        raise functions.error(model)
    assert record, "the traced forward did not run"
    outputs = record[-1]
    if not outputs.tensor_positions:
        raise ValueError(
            f"{type(model).__name__} returned no tensor (output: {outputs.spec}); remat needs a "
            "tensor output to differentiate"
        )
    if isinstance(gm, torch.fx.GraphModule):
        _strip_asserts(gm)
    return Captured(gm, used, layout, outputs, flat_inputs, tuple(branches))


def _trace(
    model: nn.Module,
    wrapper: _FlatModel,
    layout: InputLayout,
    record: list[OutputLayout],
    flat_inputs: tuple[torch.Tensor, ...],
    method: str,
) -> tuple[nn.Module, str, list[Branch]]:
    """Export ``wrapper``, or ``symbolic_trace`` ``model`` where export fails and ``method``
    allows: the graph, the method used and the mask branches taken."""
    autocast, autocast_policy = wrapper.autocast, wrapper.autocast_policy
    export_error: BaseException | None = None
    branches: list[Branch] = []
    gm: nn.Module | None = None
    used = method
    if method in ("auto", "export"):
        try:
            branches.clear()
            with _eager_mask_branch(wrapper, flat_inputs, branches):
                gm = torch.export.export(wrapper, flat_inputs, strict=False).module()
            if autocast is not None:
                inline_autocast(gm)  # type: ignore[arg-type]
            used = "export"
        except Exception as e:  # noqa: BLE001 - re-raised with context below
            export_error = e
            if method == "export":
                raise _capture_error(model, e) from e
    if gm is None:
        try:
            traced = torch.fx.symbolic_trace(model, concrete_args=dict(layout.constant_kwargs))
            gm = _FlatModel(traced, layout, record, autocast, autocast_policy)
            used = "symbolic_trace"
            branches.clear()
            with torch.no_grad():
                gm(*flat_inputs)  # records the output layout
        except Exception as e:  # noqa: BLE001 - re-raised with context below
            raise _capture_error(model, export_error or e) from (export_error or e)
    return gm, used, branches


class _CustomFunctions:
    """The user's ``torch.autograd.Function`` classes applied while tracing with gradients
    flowing through them, and where each was first applied.

    Why: the traced graph holds a Function's forward ops inline and nothing of its backward
    (:func:`remat._torch_compat.autograd_functions_applied`), so the joint graph would
    differentiate the forward instead (BLOOM's ``GeLUFunction``; a straight-through
    ``round`` got zero gradients) and train silently wrong. torch's own Functions are left
    out; so are applications whose outputs need no gradient (their backward never runs)."""

    def __init__(self) -> None:
        self.seen: dict[type, traceback.FrameSummary | None] = {}

    def on_apply(self, cls: type, out: Any) -> None:
        if cls in self.seen or cls.__module__.split(".")[0] == "torch":
            return
        leaves = tc.tree_leaves(out)
        # A tensor that needs no gradient is safe; anything else (a requires_grad tensor,
        # symbolic_trace's Proxy) may carry one.
        if all(isinstance(t, torch.Tensor) and not t.requires_grad for t in leaves):
            return
        self.seen[cls] = _innermost_user_frame(traceback.extract_stack())

    def error(self, model: nn.Module) -> CaptureError:
        lines = []
        for cls, frame in self.seen.items():
            where = (
                f" at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
                if frame
                else ""
            )
            lines.append(f"\n  {cls.__module__}.{cls.__qualname__} applied{where}")
        names = ", ".join(cls.__name__ for cls in self.seen)
        return CaptureError(
            f"could not capture {type(model).__name__} as a graph: it applies the custom "
            f"torch.autograd.Function {names}, whose own backward a captured graph cannot "
            f"run (the graph would differentiate its forward ops instead: wrong gradients)"
            f"{''.join(lines)}\n  what to try: remat.apply(model, example_inputs, ...), which "
            "runs eager autograd on the model's blocks and so the Function's backward"
        )


@dataclass(frozen=True)
class Branch:
    """A data-dependent test of Hugging Face's mask code, answered on an example input."""

    input_index: int
    """Position of the tested tensor among the flat inputs."""
    test: str
    """``unpacked`` (position ids: one sequence per row) or ``no_padding`` (all ones)."""
    answer: bool

    def holds(self, flat_inputs: list[torch.Tensor]) -> bool:
        """Whether a call's inputs take the branch this graph was traced on."""
        return _BRANCH_TESTS[self.test](flat_inputs[self.input_index]) == self.answer


def _unpacked(position_ids: torch.Tensor) -> bool:
    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None or position_ids.dim() != 2:
        return False
    return bool(find(position_ids) is None)


def _no_padding(attention_mask: torch.Tensor) -> bool:
    return bool(attention_mask.dim() == 2 and attention_mask.all())


_BRANCH_TESTS = {"unpacked": _unpacked, "no_padding": _no_padding}


@contextlib.contextmanager
def _eager_mask_branch(
    wrapper: nn.Module, examples: tuple[torch.Tensor, ...], branches: list[Branch]
) -> Iterator[None]:
    """Let Hugging Face's mask code take, while remat exports, the branch eager takes.

    Why: with no padding, equal query and key lengths and unpacked positions, eager
    transformers passes no mask to SDPA (``is_causal=True``), and a decoder with grouped-query
    attention lets SDPA handle the key/value heads (``enable_gqa=True``): the CPU flash kernel
    then sums each key/value head's gradient over its query heads inside its block loop. While
    exporting it materialises the causal mask instead, because it cannot read traced tensors
    ("not exporting", "positions not packed", "no padding"), and with a mask it repeats the
    key/value heads (``repeat_kv``) so that their gradients are summed after the kernel by the
    expand's backward (``sum.dim_IntList``): the same sums in another order once the sequence
    spans several of the kernel's query blocks (a GQA Qwen2 at sequence 256 differed in 30 of
    39 gradients, in every k/v projection first; the materialised mask itself rounds as
    ``is_causal`` does). So while remat exports:

    - "exporting" is answered no: the graph is specialised to the example shapes anyway;
    - "positions packed" is answered no inside any Hugging Face model called without
      ``position_ids``, at any depth (it counts them itself with ``arange``), so a training
      wrapper around the model takes eager's branch too;
    - position ids or an attention mask that are example inputs, passed to a Hugging Face model
      as they are, are tested on their real values; each answer is recorded in ``branches``,
      and :meth:`Branch.holds` lets the remat module plan again for a call whose inputs take the
      other branch (a batch with padding). Position ids or masks computed by the caller keep
      transformers' traced branch (the mask is built).
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not all(hasattr(masking, n) for n in _PATCHED):
        yield
        return
    from transformers import PreTrainedModel  # imported already: its masking_utils is

    state = _MaskBranches(masking, examples, branches)
    handles = [wrapper.register_forward_pre_hook(state.on_inputs)]
    for m in wrapper.modules():
        if isinstance(m, PreTrainedModel):
            handles.append(m.register_forward_pre_hook(state.enter, with_kwargs=True))
            handles.append(m.register_forward_hook(state.leave, with_kwargs=True, always_call=True))
    saved = {n: getattr(masking, n) for n in _PATCHED}
    try:
        for name, answer in zip(_PATCHED, (lambda: False, state.find, state.ignore), strict=True):
            setattr(masking, name, answer)
        yield
    finally:
        for n, f in saved.items():
            setattr(masking, n, f)
        for h in handles:
            h.remove()


_PATCHED = ("is_torchdynamo_exporting", "find_packed_sequence_indices", "_ignore_causal_mask_sdpa")
"""The functions of ``transformers.masking_utils`` :func:`_eager_mask_branch` answers."""


class _MaskBranches:
    """The answers :func:`_eager_mask_branch` gives transformers' mask code, per active call
    of a Hugging Face model: hooks keep a stack of (unpacked, no padding) per call."""

    def __init__(
        self, masking: Any, examples: tuple[torch.Tensor, ...], branches: list[Branch]
    ) -> None:
        self.find_packed = masking.find_packed_sequence_indices
        self.ignore_mask = masking._ignore_causal_mask_sdpa
        self.branches = branches
        # The tests on every example input that could be position ids or a mask, answered
        # before exporting: inside it, even ops on real tensors are traced.
        self.answers = {
            (i, test): f(t)
            for i, t in enumerate(examples)
            if not tc.is_fake(t) and t.dim() == 2 and not t.is_floating_point()
            for test, f in _BRANCH_TESTS.items()
        }
        self.traced_index: dict[int, int] = {}
        """id(traced input) -> its flat index."""
        self.calls: list[tuple[bool | None, bool | None]] = []
        """Per active Hugging Face call: positions unpacked, no padding (None: unknown)."""

    def known(self, value: Any, test: str) -> bool | None:
        """The example's answer for a traced input passed as it is; None for anything else."""
        index = self.traced_index.get(id(value)) if isinstance(value, torch.Tensor) else None
        if index is None or (index, test) not in self.answers:
            return None
        branch = Branch(index, test, self.answers[index, test])
        if branch not in self.branches:
            self.branches.append(branch)
        return branch.answer

    def on_inputs(self, module: nn.Module, flat: tuple[Any, ...]) -> None:
        self.traced_index = {id(t): i for i, t in enumerate(flat)}

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = _bind(module, args, kwargs)
        if bound is None:
            self.calls.append((None, None))
            return
        extra = bound.get("kwargs")
        extra = extra if isinstance(extra, Mapping) else {}
        positions = bound.get("position_ids", extra.get("position_ids"))
        mask = bound.get("attention_mask", extra.get("attention_mask"))
        unpacked = True if positions is None else self.known(positions, "unpacked")
        no_padding = None if mask is None else self.known(mask, "no_padding")
        self.calls.append((unpacked, no_padding))

    def leave(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        self.calls.pop()

    def find(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        if self.calls and self.calls[-1][0]:
            return None  # counted by the model itself, or unpacked in the example
        return self.find_packed(position_ids)  # type: ignore[no-any-return]

    def ignore(self, padding_mask: torch.Tensor | None, *rest: Any, **kw: Any) -> bool:
        if padding_mask is not None and self.calls and self.calls[-1][1]:
            padding_mask = None  # the example's mask is all ones: as no padding at all
        return self.ignore_mask(padding_mask, *rest, **kw)  # type: ignore[no-any-return]


def _bind(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any] | None:
    try:
        return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return None


def _strip_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove ``_assert_tensor_metadata`` nodes: impure checks AOTAutograd would keep alive."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and "assert_tensor_metadata" in str(node.target):
            gm.graph.erase_node(node)
    gm.recompile()


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The ``remat`` package: its frames are never the user's."""
_STDLIB_DIR = os.path.dirname(os.__file__)


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code (not torch's, not remat's) in ``err``'s chain."""
    best = None
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        best = _innermost_user_frame(traceback.extract_tb(e.__traceback__)) or best
        e = e.__cause__ or e.__context__
    return best


def _innermost_user_frame(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    best = None
    for frame in frames:
        f = os.path.abspath(frame.filename)
        if f.startswith((_TORCH_DIR, _OWN_DIR, _STDLIB_DIR)) or "<" in frame.filename:
            continue
        best = frame
    return best


def _capture_error(model: nn.Module, err: BaseException) -> CaptureError:
    msg = str(err).strip().splitlines()
    first = next((line for line in msg if line.strip()), type(err).__name__)
    frame = _user_frame(err)
    where = (
        f"\n  failing source: {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
        if frame
        else ""
    )
    text = str(err)
    if "data-dependent" in text or "DataDependent" in text or "GuardOnDataDependent" in text:
        hint = (
            "the forward branches on the value of a tensor (e.g. `if x.sum() > 0:` or "
            "`.item()`); make the branch depend on shapes or constants, or use torch.where / "
            "torch.cond"
        )
    else:
        hint = (
            "check that the model runs eagerly on these inputs; pass non-tensor options as "
            "keyword arguments; for Hugging Face models pass use_cache=False"
        )
    return CaptureError(
        f"could not capture {type(model).__name__} as a graph: {type(err).__name__}: {first}"
        f"{where}\n  what to try: {hint}"
    )
