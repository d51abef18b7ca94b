"""A module's own dictionaries (parameters, buffers, children) and its copies: shallow, or
with FakeTensors.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.batchnorm import _BatchNorm


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
