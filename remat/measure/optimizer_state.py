"""The bytes an optimizer of the user's own keeps per device, measured on FakeTensors.

Why measured: the named optimizers (``adamw``, ``sgd``, ...) keep a fixed number of fp32
tensors per parameter, but the ones practitioners pair with checkpointing do not: Adafactor
factors its second moment into a row and a column per matrix, low-memory and 8-bit optimizers
keep other dtypes and shapes. So ``optimizer=`` also takes a ``torch.optim.Optimizer`` class or
a factory, and its state is whatever one step makes for parameters of the model's shapes,
made on FakeTensor stand-ins (no memory, any model size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat import _torch_compat as tc
from remat.budget import optimizer_name

OptimizerFactory = Callable[[list[nn.Parameter]], Any]
"""A ``torch.optim.Optimizer`` class, or a callable making one from a list of parameters
(``lambda params: torch.optim.Adafactor(params, lr=1e-2)``)."""


def optimizer_state_bytes(params: Sequence[torch.Tensor], factory: OptimizerFactory) -> int:
    """Bytes of the device state ``factory``'s optimizer holds for ``params`` after one step,
    on FakeTensor stand-ins of their shapes, dtypes and devices (each state tensor that lives
    on its parameter's device, a storage counted once). Optimizers whose step reads tensor
    values (Adafactor's reads its step count) stop there under FakeTensors; their state is
    made before, so it counts once every parameter has its entry."""
    name = optimizer_name(factory)
    with tc.fake_mode():
        fakes = [
            nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device))
            for p in params
        ]
        for f in fakes:
            f.grad = torch.zeros_like(f)
        try:
            optimizer = factory(fakes)
        except Exception as e:
            raise ValueError(
                f"optimizer={name}: calling it with the parameters raised {type(e).__name__}: "
                f"{e}; pass a factory such as lambda params: {name}(params, lr=...)"
            ) from e
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer={name} made a {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        try:
            optimizer.step()
        except tc.DATA_DEPENDENT_ERRORS as e:
            missing = [f for f in fakes if f not in optimizer.state]
            if missing:
                raise ValueError(
                    f"optimizer={name}: its step reads tensor values ({type(e).__name__}) "
                    f"before it makes state for {len(missing)} of {len(fakes)} parameters, so "
                    "its state cannot be measured on FakeTensors; pass the named optimizer "
                    "closest to it"
                ) from e
        except Exception as e:
            raise ValueError(
                f"optimizer={name}: one step on FakeTensor copies of the parameters raised "
                f"{type(e).__name__}: {e} (remat measures the state that step makes)"
            ) from e
        seen: dict[int, int] = {}
        for f in fakes:
            for t in tc.tensor_leaves(list(optimizer.state.get(f, {}).values())):
                if t.device == f.device:
                    seen[tc.storage_key(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())


__all__ = ["OptimizerFactory", "optimizer_state_bytes"]
