"""Distributed training traced on one process: a fake c10d world for FSDP2 and tensor
parallelism, FSDP2's storage hooks, and pipeline schedules.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat._torch_compat.tensors import fake_mode_of, is_dtensor


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
