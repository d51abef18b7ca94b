"""Every private PyTorch API remat touches, in one place.

remat leans on AOTAutograd internals (the joint graph with descriptors), FX's boxed code
generator, FakeTensor and storage identity. They are private and move between releases, so a
torch upgrade should only ever have to touch this package. Tested against torch 2.13.

Its modules: :mod:`.tracing` (how a step is traced and run), :mod:`.tensors` (storages,
wrappers, FakeTensors), :mod:`.modules` (a module's own dictionaries and copies),
:mod:`.distributed` (a fake c10d world, FSDP2's hooks, pipeline schedules),
:mod:`.profiler` (the allocator's events) and :mod:`.compile` (the partitioner remat is
measured against). Import the names from here (``from remat import _torch_compat as tc``).
"""

from __future__ import annotations

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
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from remat._torch_compat.compile import (
    activation_memory_budget,
    compile_caches_off,
    dynamo_reset,
    inductor_config,
    inductor_recording,
    min_cut_backend,
)
from remat._torch_compat.distributed import (
    FakeWorld,
    clear_dtensor_caches,
    data_parallel_mesh,
    fake_mesh_world,
    fake_world_of,
    fsdp_storage_resizes,
    fully_shard_blocks,
    p2p_works_hold_tensors,
    pipeline_schedule_class,
    reshard_fsdp,
    skip_p2p_warmup,
    static_pipeline_stage,
    tensor_parallel_fake,
    tensor_parallel_mesh,
)
from remat._torch_compat.modules import (
    child_modules,
    fake_copy,
    is_batchnorm,
    local_buffers,
    local_parameters,
    module_shell,
    non_persistent_buffer_names,
)
from remat._torch_compat.profiler import (
    allocator_events,
    allocator_events_by_label,
)
from remat._torch_compat.tensors import (
    DATA_DEPENDENT_ERRORS,
    any_dtensor,
    fake_mode,
    fake_mode_of,
    is_dtensor,
    is_fake,
    local_tensor,
    local_tensors,
    storage_key,
    storage_tensors,
    tensor_leaves,
)
from remat._torch_compat.tracing import (
    ALLGATHER_BASE,
    REDUCE_SCATTER_BASE,
    RETURNS_ITS_INPUT,
    autograd_functions_applied,
    boxed_codegen,
    compute_intensive_ops,
    current_graph_task_id,
    export_joint,
    is_mutable_op,
    no_dispatch_modes,
    op_arguments,
    op_schema,
    rng_states_saved,
    sac_cache_hits,
    wrap_with_autocast,
)

# Re-exported names, private where torch defines them:
# - ``OpOverload`` (``torch._ops``): the type of ``torch.ops.aten.mm.default``, an ATen overload.
# - ``OptimizedModule`` (``torch._dynamo.eval_frame``): what ``torch.compile(module)`` returns.
# - ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the base of dispatch modes.
# - ``TreeSpec``, ``tree_flatten``, ``tree_leaves``, ``tree_map``, ``tree_unflatten``
#   (``torch.utils._pytree``): PyTorch's pytree utilities, which know its containers.

__all__ = [
    "ALLGATHER_BASE",
    "BufferAOTInput",
    "DATA_DEPENDENT_ERRORS",
    "FakeTensor",
    "FakeTensorMode",
    "FakeWorld",
    "GradAOTOutput",
    "InputMutationAOTOutput",
    "OpOverload",
    "OptimizedModule",
    "ParamAOTInput",
    "PlainAOTInput",
    "PlainAOTOutput",
    "REDUCE_SCATTER_BASE",
    "RETURNS_ITS_INPUT",
    "TangentAOTInput",
    "TorchDispatchMode",
    "TreeSpec",
    "activation_memory_budget",
    "allocator_events",
    "allocator_events_by_label",
    "any_dtensor",
    "autograd_functions_applied",
    "boxed_codegen",
    "child_modules",
    "clear_dtensor_caches",
    "compile_caches_off",
    "compute_intensive_ops",
    "current_graph_task_id",
    "data_parallel_mesh",
    "dynamo_reset",
    "export_joint",
    "fake_copy",
    "fake_mesh_world",
    "fake_mode",
    "fake_mode_of",
    "fake_world_of",
    "flop_registry",
    "fsdp_storage_resizes",
    "fully_shard_blocks",
    "inductor_config",
    "inductor_recording",
    "is_batchnorm",
    "is_dtensor",
    "is_fake",
    "is_mutable_op",
    "local_buffers",
    "local_parameters",
    "local_tensor",
    "local_tensors",
    "min_cut_backend",
    "module_shell",
    "no_dispatch_modes",
    "non_persistent_buffer_names",
    "op_arguments",
    "op_schema",
    "p2p_works_hold_tensors",
    "pipeline_schedule_class",
    "reshard_fsdp",
    "rng_states_saved",
    "sac_cache_hits",
    "sdpa_backward_flop_count",
    "sdpa_flop_count",
    "skip_p2p_warmup",
    "static_pipeline_stage",
    "storage_key",
    "storage_tensors",
    "tensor_leaves",
    "tensor_parallel_fake",
    "tensor_parallel_mesh",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "wrap_with_autocast",
]
