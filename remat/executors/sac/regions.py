"""Checkpoint regions on the user's own modules: which blocks, and how a policy runs them.

A *region* is one block of the model (a decoder layer, say) whose ``forward`` runs through
PyTorch's non-reentrant checkpoint with a selective-checkpoint (SAC) policy. The policy is data:
the set of ``(op, k)`` keys -- the k-th call of an ATen overload inside the region's forward, as
the SAC dispatch mode counts them -- whose outputs are kept (``MUST_SAVE``); every other op is
recomputed in the backward. ``None`` runs the block as plain eager code (no checkpoint: autograd
keeps what it keeps).

The block is wrapped in place by giving the module object an instance ``forward`` (as
``fully_shard`` changes a module's class in place): its parameters, buffers, hooks and
``state_dict`` keys stay exactly as they were, and FSDP2, DDP, ``torch.compile`` and Hugging
Face wrap it as usual. The checkpoint runs *inside* whatever wraps the block later, which is
the order torchtitan uses (checkpoint, then compile, then shard).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat import _torch_compat as tc
from remat.solver.blocks import matches

if TYPE_CHECKING:
    from remat.executors.sac.offload import Held, Offloads

OpKey = tuple[str, int]
"""``(ATen overload name, call index within the region's forward)``."""

Policy = frozenset[OpKey] | None
"""The ops a region keeps; ``None``: the block runs eagerly, without a checkpoint."""


class FullReplay(frozenset[OpKey]):
    """A policy whose region replays its whole forward in the backward (the checkpoint's
    ``early_stop=False``), as torchtitan runs its own policies. Why it matters: with early
    stop (PyTorch's default, and remat's) a replay stops once it has re-saved what the
    forward saved, and cache entries past that point live until the region's last saved
    tensor is released; replayed whole, they are consumed by then. The peaks differ
    (torchtitan's op-SAC on its Llama 3 debugmodel: 298 KB lower without early stop)."""


class BlockError(ValueError):
    """No blocks to checkpoint, or blocks that cannot be wrapped."""


STACKS = (nn.ModuleList, nn.ModuleDict)
"""Containers whose children can be blocks: a ModuleList (``model.layers[3]``) or a
ModuleDict (torchtitan's ``model.layers["3"]``)."""


def find_blocks(model: nn.Module, block_types: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Paths of the blocks to wrap, in module order.

    With ``block_types`` (class names such as ``LlamaDecoderLayer``, a base class's name
    matching its subclasses too, or path patterns such as ``layers.*``): the outermost
    modules that match. Without: the only candidate of :func:`block_candidates` (where
    several compete, :func:`remat.executors.sac.apply.apply` picks by their traced least peaks).
    """
    if block_types:
        return _named_blocks(model, block_types)
    candidates = block_candidates(model)
    if len(candidates) > 1:
        raise BlockError(
            f"{type(model).__name__} has {len(candidates)} levels of repeated blocks ("
            + "; ".join(f"{len(c)} from {describe_blocks(c)}" for c in candidates)
            + "): name one with block_types=(class names or path patterns)"
        )
    return candidates[0]


def block_candidates(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The sets of blocks a model could be checkpointed by, coarsest first: at each nesting
    level, the children of every repeated stack there (a ModuleList or ModuleDict with two
    or more children of one class) not inside another at that level. Why every stack of a
    level together: an encoder-decoder's two layer lists (Whisper) are both the model's
    blocks; why levels apart: Swin's stages each hold a list of layers, and which of the two
    reaches the lower peak depends on the model, so both are traced."""
    modules = dict(model.named_modules())
    stacks = [
        path for path, m in modules.items() if path and isinstance(m, STACKS) and _repeated(m)
    ]
    if not stacks:
        raise BlockError(
            f"{type(model).__name__} has no repeated blocks (no ModuleList or ModuleDict with "
            "two or more children of one class): name the modules to checkpoint with "
            "block_types=(class names or path patterns, e.g. block_types=('DecoderLayer',) "
            "or ('layers.*',))"
        )
    levels: dict[int, list[str]] = {}
    for path in stacks:
        depth = sum(path.startswith(other + ".") for other in stacks)
        levels.setdefault(depth, []).append(path)
    out = []
    for depth in sorted(levels):
        parents = set(levels[depth])
        out.append(tuple(p for p in modules if p.rpartition(".")[0] in parents))
    return tuple(out)


def _repeated(stack: nn.Module) -> bool:
    kinds = Counter(type(m) for m in stack.children())
    return bool(kinds) and max(kinds.values()) >= 2


def describe_blocks(blocks: tuple[str, ...]) -> str:
    """Where ``blocks`` are: their containers' paths."""
    return ", ".join(dict.fromkeys(b.rpartition(".")[0] for b in blocks))


def _named_blocks(model: nn.Module, block_types: tuple[str, ...]) -> tuple[str, ...]:
    modules = dict(model.named_modules())
    chosen = [
        path
        for path, m in modules.items()
        if path and any(matches(path, cls.__name__, block_types) for cls in _classes(m))
    ]
    outermost = [p for p in chosen if not any(p.startswith(q + ".") for q in chosen)]
    if not outermost:
        raise BlockError(
            f"no module of {type(model).__name__} matches block_types={block_types!r} "
            "(class names such as 'LlamaDecoderLayer' or path patterns such as 'layers.*')"
        )
    return tuple(outermost)


def _classes(module: nn.Module) -> list[type]:
    """The module's class and its bases up to ``nn.Module`` (excluded): a class name in
    ``block_types`` names its subclasses too."""
    return [c for c in type(module).__mro__ if issubclass(c, nn.Module) and c is not nn.Module]


def split_blocks(model: nn.Module, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """Each block's direct children that hold parameters (attention, MLP, norms): regions
    a step finer than the blocks, in module order. Why: SAC recomputes a region's forward
    whole at its first unpack in the backward, so a block recomputed whole holds all its
    internals at once; its sub-modules recomputed one by one hold one's at a time, which is
    how a smaller peak is reached (the code between them, residual adds, runs eagerly)."""
    modules = dict(model.named_modules())
    out: list[str] = []
    for path in blocks:
        for name, child in modules[path].named_children():
            if any(True for _ in child.parameters()):
                out.append(f"{path}.{name}" if path else name)
    return tuple(out)


def outside_blocks(model: nn.Module, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """The outermost modules outside the blocks that hold parameters and contain no block:
    the embeddings, the final norm, the head (a CNN's stem and classifier), in module order.
    Why: as regions they let a plan recompute there too, which lowers the peak where those
    modules save much for their backward (a CNN's full-resolution stem, BERT's embeddings
    and prediction head: 4-7% on the zoo's). A loss computed in the model's own code (not a
    module) cannot be a region, and a checkpoint cannot lower the forward transient of a
    large-vocabulary loss anyway: it is made and consumed in the forward."""
    modules = dict(model.named_modules())
    holders = {".".join(b.split(".")[:i]) for b in blocks for i in range(len(b.split(".")))}
    out: list[str] = []
    for path, m in modules.items():
        if path in holders or any(path == b or path.startswith(b + ".") for b in blocks):
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent in holders and any(True for _ in m.parameters()):
            out.append(path)
    return tuple(out)


@dataclass
class Region:
    """What remat attached to one block: its path and the policy it runs with."""

    path: str
    policy: Policy
    tensor_parallel: bool = False
    """Its parameters were DTensors when it was planned (the model was parallelized first)."""
    checked: bool = False
    """Its first forward found the parameters as they were planned."""
    offloads: Offloads | None = None
    """The model's offload state, where its plan offloads (every region of the model shares
    it: each region's forward end releases and links the copies before it)."""
    offload: bool = False
    """This region's activation inputs wait in host memory (:mod:`remat.executors.sac.offload`)."""


_ATTR = "_remat_region"


def region_of(module: nn.Module) -> Region | None:
    region = module.__dict__.get(_ATTR)
    return region if isinstance(region, Region) else None


def wrap(
    module: nn.Module,
    path: str,
    policy: Policy,
    offloads: Offloads | None = None,
    offload: bool = False,
) -> Region:
    """Route ``module``'s forward through a checkpoint with ``policy`` (see the module doc);
    ``offload``: its activation inputs wait in ``offloads``' host store (a checkpointed
    region only)."""
    if offload and (policy is None or offloads is None):
        raise BlockError(f"{path}: only a checkpointed region offloads its inputs")
    if region_of(module) is not None:
        raise BlockError(f"{path} is already a remat region")
    if "forward" in module.__dict__:
        raise BlockError(
            f"{path} ({type(module).__name__}) already has an instance forward (another wrapper "
            "patched it); remat wraps the module's own forward: apply remat first"
        )
    region = Region(path, policy, _tensor_parallel(module), offloads=offloads, offload=offload)
    module.__dict__[_ATTR] = region
    module.forward = functools.partial(_region_forward, region, module)  # type: ignore[method-assign]
    return region


def unwrap(module: nn.Module) -> None:
    module.__dict__.pop(_ATTR, None)
    module.__dict__.pop("forward", None)


def _tensor_parallel(module: nn.Module) -> bool:
    """Some parameter is a DTensor while the forward runs: tensor parallelism (FSDP2 alone
    gathers its parameters into plain tensors before the forward)."""
    return any(tc.is_dtensor(p) for p in module.parameters())


def _region_forward(region: Region, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Not while Dynamo traces: reading the flag would guard on it, and setting it recompile.
    if not torch.compiler.is_compiling() and not region.checked:
        if _tensor_parallel(module) and not region.tensor_parallel:
            raise BlockError(
                f"{region.path} was planned unsharded, and its parameters are DTensors now: "
                "parallelize_module ran after remat.apply. Parallelize first, then call "
                "remat.apply on the parallel model (its plan is made per rank), then "
                "fully_shard, then compile"
            )
        region.checked = True
    policy = region.policy
    offloads = region.offloads
    if offloads is not None and torch.compiler.is_compiling():
        raise BlockError(
            f"{region.path}: a plan that offloads runs eagerly (its copies are Python code "
            "between ops): train without torch.compile, or plan without a host budget"
        )
    if policy is None:
        out = type(module).forward(module, *args, **kwargs)
        if offloads is not None:
            offloads.after_forward(None, out)
        return out
    run: Callable[..., Any] = functools.partial(_run, region, module)
    held = (
        offloads.held(region.path, args, kwargs)
        if offloads is not None and region.offload
        else None
    )
    if held is not None:  # the checkpoint holds no input: the region reads them from held
        run, args, kwargs = functools.partial(_run_held, region, module, held), (), {}
    with _cast_cache_off():
        out = checkpoint(
            run,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(policy_contexts, policy),
            early_stop=not isinstance(policy, FullReplay),
            **kwargs,
        )
    if offloads is not None:
        offloads.after_forward(held, out)
    return out


@contextlib.contextmanager
def _cast_cache_off() -> Iterator[None]:
    """autocast's weight-cast cache off inside a checkpointed region (the checkpoint records
    the setting and its replay runs with it too). Why: with the cache on (autocast's
    default) the 16-bit copy of every weight the region casts stays alive until the autocast
    region exits, at the end of the forward, whatever the policy keeps; under FSDP2 those are
    copies of the gathered weights, 2 bytes per parameter of the model at the forward's end
    (13.5 GB on Llama 2 7B). Off, each copy dies when the region no longer needs it, and a
    cast gives the same values every time: the step is bitwise the same. Not while Dynamo
    traces (the compiled graph casts as it compiles them)."""
    if torch.compiler.is_compiling() or not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


_observers: list[Callable[[Region, bool], Any]] = []
"""Context-manager factories entered around every run of a region's forward (the forward
itself with ``False``, a recomputation with ``True``): how :mod:`remat.executors.sac.trace`
labels ops. Empty in training: the check costs one list lookup."""


_policy_calls: list[Callable[[bool], None]] = []
"""Called with ``kept`` on every forward call of a region's policy, and
:data:`_contexts_made` with each region's SAC contexts: how :mod:`remat.executors.sac.trace`
counts what selective checkpointing's own dispatch costs. Empty in training."""

_contexts_made: list[Callable[[tuple[Any, Any]], None]] = []


_made_outside: list[Callable[[torch.Tensor], None]] = []
"""Called with each tensor remat makes outside the dispatch modes (the BatchNorm scratch
statistics below): :mod:`remat.executors.sac.trace` counts them at the allocator level."""


def _run(region: Region, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling():
        # The compiled backward graph holds the recomputation (AOTAutograd's partitioner
        # reads the policy's tags); nothing here runs again in the backward.
        return type(module).forward(module, *args, **kwargs)
    recompute = _in_backward()
    with contextlib.ExitStack() as stack:
        if _observers:
            stack.enter_context(_observers[-1](region, recompute))
        if recompute:
            stack.enter_context(running_stats_frozen(module))
        return type(module).forward(module, *args, **kwargs)


def _run_held(region: Region, module: nn.Module, held: Held) -> Any:
    args, kwargs = held.inputs()
    return _run(region, module, *args, **kwargs)


def _in_backward() -> bool:
    return bool(tc.current_graph_task_id() != -1)


@contextlib.contextmanager
def running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers inside ``module`` update scratch statistics, not their own.

    A recomputation runs BatchNorm again in training mode, which would update
    ``running_mean``, ``running_var`` and ``num_batches_tracked`` a second time. For the
    re-run, those buffers are swapped for scratch tensors of the same shape: BatchNorm
    normalises by the batch's statistics exactly as before (in training its output does not
    depend on the running ones), saves as many tensors for its backward, and the real buffers
    end the step as in eager. No policy has to keep BatchNorm's output for that reason. The
    scratch tensors are made outside the dispatch modes (SAC's replay would reject an op the
    forward did not run); they are a few bytes per channel and freed with the re-run.
    """
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    for m in module.modules():
        if not (tc.is_batchnorm(m) and m.training):
            continue
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            buffer = tc.local_buffers(m).get(name)
            if buffer is not None:
                swapped.append((m, name, buffer))
    with tc.no_dispatch_modes():
        scratch = [torch.zeros_like(b) for _, _, b in swapped]
    for observe in _made_outside:
        for t in scratch:
            observe(t)
    for (m, name, _), s in zip(swapped, scratch, strict=True):
        tc.local_buffers(m)[name] = s
    try:
        yield
    finally:
        for m, name, buffer in swapped:
            tc.local_buffers(m)[name] = buffer


COLLECTIVES = ("_c10d_functional", "c10d_functional", "c10d")
"""Op namespaces of collectives: always kept. Recomputing one would run the collective a
second time in the backward (another all-reduce across the tensor-parallel group, and every
rank must then replay it in the same order); PyTorch's partitioner never recomputes them
either."""


class KeyPolicy:
    """A SAC policy function: ``MUST_SAVE`` for the listed ``(op, k)`` keys and for every
    collective (:data:`COLLECTIVES`). A fresh one per checkpoint context, so its counters
    start at zero for every forward (under ``torch.compile`` the policy runs once per trace
    as well)."""

    def __init__(self, saved: frozenset[OpKey]) -> None:
        self.saved = saved
        self.counts: Counter[Any] = Counter()

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        k = self.counts[op]
        self.counts[op] = k + 1
        name, collective = _op_facts(op)
        keep = collective or (name, k) in self.saved
        if _policy_calls and not ctx.is_recompute:
            _policy_calls[-1](keep)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _op_facts(op: Any) -> tuple[str, bool]:
    """An op's key name and whether it is a collective, worked out once per op: the policy
    runs on every op of every region's forward, and ``str(op)`` builds its name anew each
    time."""
    return str(op), getattr(op, "namespace", None) in COLLECTIVES


def policy_contexts(saved: frozenset[OpKey]) -> tuple[Any, Any]:
    """``context_fn`` of a region (module level, so Dynamo can trace the partial of it).

    ``allow_cache_entry_mutation``: policies keep in-place writes to state the block does not
    own (BatchNorm's ``num_batches_tracked.add_``) so the recomputation does not apply them a
    second time, and SAC's mutation check rejects the output of every in-place op (it reads
    the version counter before autograd bumps it). remat's planner never keeps an output that
    the region mutates later (:attr:`remat.executors.sac.trace.OpEvent.savable`).
    """
    contexts: tuple[Any, Any] = create_selective_checkpoint_contexts(
        KeyPolicy(saved), allow_cache_entry_mutation=True
    )
    if _contexts_made:
        _contexts_made[-1](contexts)
    return contexts


def iter_regions(model: nn.Module) -> Iterator[tuple[nn.Module, Region]]:
    for m in model.modules():
        region = region_of(m)
        if region is not None:
            yield m, region
