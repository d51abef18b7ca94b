"""PyTorch's own memory-budget partitioner and Inductor, the peer remat's experiments measure
against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


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
