"""CUDA's autocast policy on a CPU trace: plans for a GPU, traced here, cast as the GPU casts.

``torch.autocast`` keeps one op list per device, and the lists differ where memory is at
stake: CUDA runs ``layer_norm``, ``softmax``, ``log_softmax``, ``exp``, ``sum``, the losses and
a few dozen more in float32 (their outputs are float32, twice a bfloat16 one), the CPU list
casts almost none of these. A plan traced on this CPU for an ``a100``/``h100``/``h200`` profile
under the CPU policy would size a GPT-2 block's layer-norm outputs at half their bytes. CUDA
cannot be faked on the CPU wheel (FakeTensorMode with ``device="cuda"`` aborts), so the CUDA
list is applied here by hand: :class:`CudaFloat32Ops`, a TorchFunctionMode active inside the
traced autocast region, casts the 16-bit floating arguments of CUDA's float32-listed functions
to float32 before they run. It works above autograd (so the backward sees the casts as
ordinary ops) and only while autocast is on, and it skips calls given an explicit ``dtype=``,
as autocast does. Both lists cast matmuls, convolutions and attention to 16 bits alike; CPU
autocast does that part.

The list is the float32 list of PyTorch's automatic mixed precision documentation ("CUDA ops
that can autocast to float32", 2.13), by the Python name a call reaches ``__torch_function__``
with (``torch.nn.functional.layer_norm``, ``Tensor.softmax``, ``torch.exp``, ...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from remat import _torch_compat as tc
from remat.measure.profiles import GPU_PROFILES

__all__ = ["AUTOCAST", "CUDA_FLOAT32", "CudaFloat32Ops", "autocast_for", "policy_of"]

AUTOCAST: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
}
"""The ``torch.autocast`` dtype of each precision a step is traced and run in (None: off)."""

CUDA_FLOAT32 = frozenset(
    {
        "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
        "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
        "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp",
        "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
        "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
        "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
        "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
        "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
        "triplet_margin_loss", "huber_loss", "logsumexp",
    }
)  # fmt: skip
"""Python names of the functions CUDA autocast runs in float32."""

_LOW = (torch.float16, torch.bfloat16)


def _to_float32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.float()
    return x


class CudaFloat32Ops(TorchFunctionMode):
    """Casts the 16-bit arguments of :data:`CUDA_FLOAT32` functions to float32 while autocast
    is enabled on ``device_type`` (see the module docstring)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if (
            getattr(func, "__name__", "") in CUDA_FLOAT32
            and kwargs.get("dtype") is None
            and torch.is_autocast_enabled(self.device_type)
        ):
            args, kwargs = tc.tree_map(_to_float32, (args, kwargs))
        return func(*args, **kwargs)


def policy_of(profile_name: str) -> str:
    """``cuda`` for a GPU profile (its autocast lists are CUDA's), else ``native``: the
    lists of the device the tensors are on."""
    return "cuda" if profile_name in GPU_PROFILES else "native"


@contextlib.contextmanager
def autocast_for(device_type: str, dtype: torch.dtype | None, policy: str) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)`` (nothing if ``dtype`` is None), with CUDA's
    float32 list on top when ``policy`` is ``cuda`` and the tensors are not on CUDA."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        if policy == "cuda" and device_type != "cuda":
            with CudaFloat32Ops(device_type):
                yield
        else:
            yield
