"""Every private PyTorch API remat touches, in one place.

remat leans on AOTAutograd internals (the joint graph with descriptors), FX's boxed code
generator, FakeTensor and storage identity. They are private and move between releases, so a
torch upgrade should only ever have to touch this file. Tested against torch 2.13.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.graph import _BoxedCodeGen
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "DATA_DEPENDENT_ERRORS",
    "BufferAOTInput",
    "FakeTensor",
    "FakeWorld",
    "FakeTensorMode",
    "GradAOTOutput",
    "InputMutationAOTOutput",
    "OpOverload",
    "OptimizedModule",
    "ParamAOTInput",
    "PlainAOTInput",
    "PlainAOTOutput",
    "TangentAOTInput",
    "TorchDispatchMode",
    "RETURNS_ITS_INPUT",
    "TreeSpec",
    "activation_memory_budget",
    "allocator_events",
    "allocator_events_by_label",
    "autograd_functions_applied",
    "compute_intensive_ops",
    "boxed_codegen",
    "child_modules",
    "current_graph_task_id",
    "compile_caches_off",
    "dynamo_reset",
    "export_joint",
    "inductor_config",
    "inductor_recording",
    "fake_copy",
    "fake_mode_of",
    "fake_world_of",
    "local_tensor",
    "local_tensors",
    "tensor_parallel_fake",
    "fsdp_storage_resizes",
    "fully_shard_blocks",
    "flop_registry",
    "is_batchnorm",
    "is_dtensor",
    "is_fake",
    "is_mutable_op",
    "local_buffers",
    "local_parameters",
    "min_cut_backend",
    "no_dispatch_modes",
    "p2p_works_hold_tensors",
    "pipeline_schedule_class",
    "sac_cache_hits",
    "skip_p2p_warmup",
    "static_pipeline_stage",
    "non_persistent_buffer_names",
    "op_arguments",
    "op_schema",
    "sdpa_backward_flop_count",
    "sdpa_flop_count",
    "rng_states_saved",
    "storage_key",
    "storage_tensors",
    "tensor_leaves",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

# Re-exported names, private where torch defines them:
# - ``OpOverload`` (``torch._ops``): the type of ``torch.ops.aten.mm.default``, an ATen overload.
# - ``OptimizedModule`` (``torch._dynamo.eval_frame``): what ``torch.compile(module)`` returns.
# - ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the base of dispatch modes.
# - ``TreeSpec``, ``tree_flatten``, ``tree_leaves``, ``tree_map``, ``tree_unflatten``
#   (``torch.utils._pytree``): PyTorch's pytree utilities, which know its containers.


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


def allocator_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """(time ns, bytes, address) of every allocation (+) and free (-) the profiler recorded,
    in order. The address matters: the profiler also records the free of a block allocated
    outside the profiled region when an earlier profiled region allocated that address."""
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    out = []
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == torch._C._profiler._EventType.Allocation:
            out.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
    return sorted(out, key=lambda t: t[0])


def allocator_events_by_label(
    prof: torch.profiler.profile, prefix: str
) -> dict[str, list[tuple[int, int, int]]]:
    """:func:`allocator_events` grouped by the innermost enclosing
    ``torch.profiler.record_function`` whose name starts with ``prefix``."""
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    out: dict[str, list[tuple[int, int, int]]] = {}
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag != torch._C._profiler._EventType.Allocation:
            continue
        parent = e.parent
        while parent is not None and not parent.name.startswith(prefix):
            parent = parent.parent
        if parent is not None:
            out.setdefault(parent.name, []).append(
                (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr)
            )
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}


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


def storage_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors that own storages in ``tree`` (any pytree): its tensor leaves, with each
    tensor subclass that wraps others (a DTensor, its local shard; a functional collective's
    pending result) replaced by the tensors it wraps, recursively. Why: a wrapper's own
    storage is empty, and the tensors it wraps are made inside its dispatch, where no mode
    sees them; a live-storage meter that stopped at the wrapper would miss every
    tensor-parallel activation, and the allocator would not."""
    out: list[torch.Tensor] = []
    stack = tensor_leaves(tree)[::-1]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = (getattr(t, n) for n in reversed(names))
            stack.extend(x for x in inner if isinstance(x, torch.Tensor))
        else:
            out.append(t)
    return out


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree``, in pytree order: what ``tree_leaves`` gives, kept to
    tensors, for the containers an op's arguments and results are made of (lists, tuples and
    their subclasses, dicts). Why not ``tree_leaves``: this runs for every op a traced step
    dispatches, and traces ran 8% faster without pytree's generic walk (``apply(plan=
    "block")`` of a 12-layer Llama on FakeTensors: 1.50 s -> 1.38 s, best of 3, one process).
    A loop, not a recursive closure: that would be a reference cycle holding the tensors
    until the cyclic garbage collector ran, and a traced step's frees would move with it
    (seen: the length formula's fit then found different ops at different lengths).
    """
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def is_dtensor(tensor: torch.Tensor) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (without importing torch.distributed where it
    was never used)."""
    return any_dtensor((tensor,))


def any_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether one of ``tensors`` is a DTensor (:func:`is_dtensor`): one import check for
    all of them (the trace recorder asks for every op's tensors)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def storage_key(tensor: torch.Tensor) -> int:
    """A key equal for two tensors iff they share a storage (valid while the storage lives)."""
    return int(tensor.untyped_storage()._cdata)


def is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor)


def fake_mode_of(module: torch.nn.Module) -> FakeTensorMode | None:
    """The FakeTensorMode ``module``'s parameters were made under, if they are fake."""
    for p in module.parameters():
        t = local_tensor(p)  # a tensor-parallel weight's shard
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


@contextlib.contextmanager
def fake_mode() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode under which models of any size can be built and planned."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


DATA_DEPENDENT_ERRORS: tuple[type[Exception], ...] = (
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
)
"""What FakeTensorMode raises on an op whose output depends on tensor values."""


class FakeWorld:
    """A c10d "world" of its own holding one fake process group of ``world_size`` ranks.

    c10d keeps its process groups in one module-level registry; a training job has its
    real default group there already. This world is swapped in only while remat traces a
    step under FSDP2 or tensor parallelism on FakeTensors (:meth:`active`), so the job's groups are untouched and
    no collective leaves the process (the fake group's collectives return at once).
    """

    _worlds = 0
    _of: weakref.WeakKeyDictionary[torch.nn.Module, FakeWorld] = weakref.WeakKeyDictionary()
    """Modules parallelized on a fake world (:func:`tensor_parallel_fake`) -> that world."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.testing._internal.distributed.multi_threaded_pg import WorldData

        self.world_size = world_size
        self.mesh: Any = None
        """The named mesh of a tensor-parallel model with other dimensions besides ``"tp"``
        (:func:`tensor_parallel_fake`): ``"pp"`` for its pipeline stages, ``"dp"`` for FSDP2
        to shard over; else None."""
        # Group names come from the world's group count and are registered process-wide:
        # start far from the job's own (which count from 0).
        FakeWorld._worlds += 1
        first = 1_000_000 * FakeWorld._worlds
        self._data = WorldData(None, {}, {}, {}, {}, first, {}, {}, {}, [])  # type: ignore[arg-type]
        self._world = _OwnWorld(self._data)
        hook = sys.excepthook  # which init_process_group wraps to prefix "[rank<r>]:"
        try:
            with self.active():
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        finally:
            sys.excepthook = hook

    def dim(self, name: str) -> Any:
        """The 1-D mesh of :attr:`mesh`'s dimension ``name``, or None where it has none."""
        if self.mesh is None or name not in (self.mesh.mesh_dim_names or ()):
            return None
        with self.active():
            return self.mesh[name]

    def coordinate(self, name: str) -> int:
        """This world's rank's index along dimension ``name`` of :attr:`mesh` (0 without)."""
        if self.mesh is None or name not in (self.mesh.mesh_dim_names or ()):
            return 0
        with self.active():
            coordinate = self.mesh.get_coordinate()
        return int(coordinate[self.mesh.mesh_dim_names.index(name)])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This world's process groups are c10d's until exit. DTensor's caches are cleared
        on the way in and out: they key on meshes, and meshes of equal shape compare equal
        across worlds, so a cached result would hand another world's mesh (whose groups
        this world cannot resolve) to this world's tensors, or a fake one to the job's."""
        c10d = torch.distributed.distributed_c10d
        previous = c10d._world
        switching = previous is not self._world  # not a nested entry of this world
        if switching:
            clear_dtensor_caches()
        c10d._world = self._world  # type: ignore[assignment]
        try:
            yield
        finally:
            c10d._world = previous
            if switching:
                clear_dtensor_caches()


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches (C++ and Python) and its redistribution
    caches (:meth:`FakeWorld.active`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _collective_utils as collective
    from torch.distributed.tensor import _redistribute as redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    collective.MeshTopoInfo.build_from_mesh.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    redistribute._gen_transform_infos.cache_clear()
    redistribute.clear_redistribute_planner_cache()


class _OwnWorld:
    """``distributed_c10d._World``'s interface over one WorldData (as PyTorch's threaded
    process groups do for their thread-local worlds)."""

    def __init__(self, data: Any) -> None:
        self._data = data

    @property
    def default_pg(self) -> Any:
        return self._data.default_pg

    @default_pg.setter
    def default_pg(self, value: Any) -> None:
        self._data.default_pg = value

    @property
    def group_count(self) -> int:
        return int(self._data.group_count)

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._data.group_count = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)  # pg_map, pg_names, pg_group_ranks, ...


def fake_mesh_world(dims: list[tuple[str, int]], rank: int, device: str = "cpu") -> FakeWorld:
    """A fake world of the product of ``dims``'s sizes, laid out on one mesh with those
    named dimensions (outermost first, as torchtitan's ``("pp", "dp", "tp")``), as its
    ``rank``."""
    from torch.distributed.device_mesh import init_device_mesh

    size = 1
    for _, k in dims:
        size *= k
    world = FakeWorld(size, rank=rank)
    with world.active():
        world.mesh = init_device_mesh(
            device, tuple(k for _, k in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )
    return world


def tensor_parallel_fake(
    model: torch.nn.Module,
    tp_size: int,
    plan: Callable[[torch.nn.Module], dict[str, Any]],
    dp_size: int = 1,
    pp_size: int = 1,
    pp_rank: int = 0,
) -> FakeWorld:
    """``parallelize_module(model, mesh, plan(model))`` over ``tp_size`` ranks of a fresh
    fake world (the first rank's shard of every weight; collectives return at once).
    ``model`` is a FakeTensor model (:func:`remat.fake_mode`); :func:`fake_world_of` finds
    the world again from its parameters, so its step can be traced with the mesh's process
    groups registered. Other dimensions, as torchtitan lays them out, outermost first:
    ``pp_size > 1``, the model is pipeline stage (or rank) ``pp_rank`` of ``pp_size``,
    whose p2p runs over the mesh's ``"pp"`` dimension; ``dp_size > 1``, FSDP2 later shards
    over ``"dp"`` (:func:`fully_shard_blocks` with the world's ``"dp"`` mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mode = fake_mode_of(model)
    if mode is None:
        raise ValueError("tensor_parallel_fake needs a FakeTensor model (remat.fake_mode())")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is not one of {pp_size}")
    dims = [(n, k) for n, k in (("pp", pp_size), ("dp", dp_size)) if k > 1]
    device = next((t.device.type for t in model.parameters()), "cpu")
    rank = pp_rank * dp_size * tp_size
    world = fake_mesh_world([*dims, ("tp", tp_size)], rank, device) if dims else FakeWorld(tp_size)
    with world.active():
        mesh = world.mesh["tp"] if dims else init_device_mesh(device, (tp_size,))
        with mode:
            parallelize_module(model, mesh, plan(model))
    # The model and the modules it sharded: not every module, as modules without weights
    # can be shared between stages parallelized on different worlds (rotary embeddings).
    for m in model.modules():
        if m is model or any(is_dtensor(p) for p in m.parameters(recurse=False)):
            FakeWorld._of[m] = world
    return world


def tensor_parallel_mesh(model: torch.nn.Module) -> Any:
    """The device mesh ``model``'s DTensor parameters live on (tensor parallelism), or None."""
    return next((p.device_mesh for p in model.parameters() if is_dtensor(p)), None)  # type: ignore[attr-defined]


def data_parallel_mesh(tp_mesh: Any) -> Any:
    """The data-parallel dimension of the 2-D mesh ``tp_mesh`` was taken from (the root's
    other dimension: torchtitan's ``mesh["dp_shard"]`` beside ``mesh["tp"]``); None where
    ``tp_mesh`` is a whole mesh or its root has more dimensions than two."""
    root = tp_mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    if root is tp_mesh or root.ndim != 2 or tp_mesh.ndim != 1 or len(names) != 2:
        return None
    (other,) = (n for n in names if n not in (tp_mesh.mesh_dim_names or ()))
    return root[other]


def fake_world_of(model: torch.nn.Module) -> FakeWorld | None:
    """The fake world ``model`` was parallelized on (:func:`tensor_parallel_fake`), if any:
    that of any of its modules, so a module list of stages parallelized together finds it
    too. (Not from the parameters' mesh: meshes of equal shape compare equal across
    worlds, and DTensor's sharding caches hand one world's mesh to another's tensors.)
    Modules of different fake worlds: a ValueError."""
    worlds = {id(w): w for m in model.modules() if (w := FakeWorld._of.get(m)) is not None}
    if len(worlds) > 1:
        raise ValueError(
            "the model's modules were parallelized on different fake process groups: "
            "parallelize a rank's modules together, in one tensor_parallel call"
        )
    return next(iter(worlds.values()), None)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, any other tensor itself."""
    # The attribute, not ``to_local()``: no op dispatched (this runs inside dispatch modes).
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def local_tensors(tree: Any) -> Any:
    """``tree`` with each DTensor replaced by its local shard (what this rank computes)."""
    return tree_map(lambda x: local_tensor(x) if isinstance(x, torch.Tensor) else x, tree)


def fully_shard_blocks(
    model: torch.nn.Module,
    blocks: list[torch.nn.Module],
    world_size: int,
    mode: FakeTensorMode,
    param_dtype: torch.dtype | None = None,
    mesh: Any = None,
    roots: list[torch.nn.Module] | None = None,
) -> None:
    """FSDP2 as the recipe applies it: ``fully_shard`` each block, then the root (``roots``:
    each of them instead, as a rank's pipeline stages are sharded one by one); the device
    mesh is made outside ``mode`` (its rank table is read as data). ``param_dtype``: FSDP2's
    own mixed precision, ``MixedPrecisionPolicy(param_dtype=param_dtype,
    reduce_dtype=torch.float32)`` (torchtitan's default); None: FSDP2's defaults. ``mesh``:
    the data-parallel dimension of a tensor-parallel model's 2-D mesh; then ``fully_shard``
    runs outside ``mode`` too, since it builds the 2-D sharding's mesh from the rank table
    (the parameters are FakeTensors already)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next((t.device.type for t in model.parameters()), "cpu")
    over = init_device_mesh(device, (world_size,)) if mesh is None else mesh
    within: contextlib.AbstractContextManager[Any] = (
        mode if mesh is None else contextlib.nullcontext()
    )
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mp: dict[str, Any] = {} if param_dtype is None else {"mp_policy": policy}
    with within:
        for block in blocks:
            fully_shard(block, mesh=over, **mp)
        for root in [model] if roots is None else roots:
            fully_shard(root, mesh=over, **mp)


@contextlib.contextmanager
def fsdp_storage_resizes(callback: Callable[[int], None]) -> Iterator[None]:
    """Call ``callback`` with the change in bytes each time FSDP2 resizes an unsharded
    parameter's storage in place (allocated before an all-gather, freed to 0 at reshard).
    Why: after the first step FSDP2 reuses those storages through ``storage.resize_``,
    which no dispatch mode sees, but the allocator does (2.13: ``alloc_storage`` and
    ``free_storage`` of ``torch.distributed.fsdp._fully_shard._fsdp_param``)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def observed(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def resize(tensor: torch.Tensor) -> None:
            before = tensor.untyped_storage().nbytes()
            original(tensor)
            delta = tensor.untyped_storage().nbytes() - before
            if delta:
                callback(delta)

        return resize

    patched = [(_fsdp_param, "alloc_storage", alloc), (_fsdp_param, "free_storage", free)]
    patched.append((_fsdp_param_group, "alloc_storage", _fsdp_param_group.alloc_storage))
    for module, name, original in patched:
        setattr(module, name, observed(original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


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


def module_shell(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with its own dictionary of children (``copy.copy`` shares
    ``_modules``): replacing a child of the copy leaves ``module`` as it was. Parameters,
    buffers and hooks stay shared."""
    import copy

    shell = copy.copy(module)
    shell._modules = dict(module._modules)
    return shell


def fake_copy(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are FakeTensors of ``mode``
    (shapes, dtypes and aliasing kept; no data copied)."""
    import copy

    from torch._subclasses.fake_tensor import FakeCopyMode

    with FakeCopyMode(mode):
        return copy.deepcopy(module)


wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast
"""The higher-order op ``torch.export`` records an autocast region as."""


# PyTorch's own memory-budget partitioner, the peer remat's experiments measure against.


def dynamo_reset() -> None:
    """Forget every compiled graph (the partitioner's budget is not part of Dynamo's guards)."""
    torch._dynamo.reset()


def activation_memory_budget(fraction: float) -> contextlib.AbstractContextManager[None]:
    """``torch._functorch.config.activation_memory_budget`` set within the context."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=fraction)  # type: ignore[no-any-return]


def min_cut_backend(on_forward: Any, on_backward: Any) -> Any:
    """``aot_eager`` as torch 2.13 builds it (AOTAutograd, the min-cut rematerialization
    partitioner, aten ops run eagerly), calling ``on_forward(gm)`` / ``on_backward(gm)`` with
    each partitioned graph first."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def fw(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        on_forward(gm)
        return boxed_nop(gm, example_inputs)

    def bw(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        on_backward(gm)
        return boxed_nop(gm, example_inputs)

    return aot_autograd(
        fw_compiler=fw,
        bw_compiler=bw,
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


def inductor_recording(on_graph: Any) -> Any:
    """A ``torch.compile`` backend that is Inductor, calling ``on_graph(gm, is_backward)``
    with each partitioned graph before Inductor compiles it (what the compiled backward
    recomputes can be read from its graph). A graph found in AOTAutograd's cache is not
    partitioned again, so nothing is reported: see :func:`compile_caches_off`."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        on_graph(gm, bool(kwargs.get("is_backward")))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


@contextlib.contextmanager
def compile_caches_off() -> Iterator[None]:
    """No compiled graph is taken from AOTAutograd's or Inductor's on-disk caches."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor

    with (
        functorch_config.patch(enable_autograd_cache=False),
        inductor.patch(fx_graph_cache=False),
    ):
        yield


def inductor_config(**settings: Any) -> contextlib.AbstractContextManager[None]:
    """``torch._inductor.config`` patched within the context."""
    import torch._inductor.config as inductor

    return inductor.patch(**settings)  # type: ignore[no-any-return]


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


def is_batchnorm(module: torch.nn.Module) -> bool:
    """A BatchNorm of any dimension or flavour (``torch.nn.modules.batchnorm._BatchNorm``:
    BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones), the layers with running statistics."""
    return isinstance(module, _BatchNorm)


def local_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module``'s own parameters by name (``None`` for a registered empty one), the live
    mapping itself: assigning to it swaps a parameter without a ``register_parameter``."""
    return module._parameters  # type: ignore[return-value]


def local_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name (``None`` for a registered empty one), the live
    mapping itself: assigning to it swaps a buffer in place of the original."""
    return module._buffers


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False``."""
    return module._non_persistent_buffers_set


def child_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module``'s direct children by name, the live mapping itself."""
    return module._modules


def pipeline_schedule_class(name: str) -> type[Any]:
    """``torch.distributed.pipelining``'s schedule class of that name (``"1F1B"``,
    ``"GPipe"``, ...; case-insensitive, as PyTorch's own lookup)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(name)  # type: ignore[no-any-return]


def static_pipeline_stage(
    module: torch.nn.Module,
    stage_index: int,
    n_stages: int,
    device: torch.device,
    inputs: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    group: Any = None,
) -> Any:
    """A ``PipelineStage`` told every shape it sends and receives (one microbatch's inputs
    and outputs, and their gradients), so it never exchanges metadata with its neighbours:
    on a fake process group, whose object collectives do not work, that is how a stage runs
    at all. Integer inputs (token ids) have no gradient. ``group``: the pipeline's (None:
    the default)."""
    from torch.distributed.pipelining import PipelineStage

    last = stage_index == n_stages - 1
    return PipelineStage(
        module,
        stage_index,
        n_stages,
        device,
        input_args=inputs,
        output_args=outputs,
        output_grads=tuple(None if last else t for t in outputs),
        input_grads=tuple(
            None if stage_index == 0 or not t.is_floating_point() else t for t in inputs
        ),
        group=group,
    )


def reshard_fsdp(module: torch.nn.Module) -> None:
    """Every FSDP2 module in ``module`` resharded (its unsharded parameters freed)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def skip_p2p_warmup(schedule: Any) -> None:
    """``schedule``'s stages run in static mode without the warm-up vote its first step
    takes with the neighbouring ranks (a fake process group has none to vote): every shape
    is known already (:func:`static_pipeline_stage`)."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


class _HoldingWork:
    """A p2p ``Work`` that holds its tensors while it lives, as gloo's and NCCL's do (the
    fake group's lets go of them at once): a schedule that keeps a finished send's work in a
    variable (1F1B keeps the last one) keeps the sent activation alive until then."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self.work = work
        self.tensors = tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)


@contextlib.contextmanager
def p2p_works_hold_tensors() -> Iterator[None]:
    """While active, the pipeline schedules' p2p works hold their tensors
    (:class:`_HoldingWork`)."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(ops: list[Any], desc: str | None = None) -> list[Any]:
        tensors = [op.tensor for op in ops]
        return [_HoldingWork(w, tensors) for w in original(ops, desc=desc)]

    schedules._batch_p2p = batch_p2p  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = original
