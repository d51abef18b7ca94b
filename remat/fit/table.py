"""Will it fit? The longest sequence and the largest batch each plan fits in a device budget.

    report = remat.fit.fit(model, example_inputs, budget_gb=80)  # at the inputs' shape
    report.plans["every block"].max_seq

The request is checked here; the executor answers (:meth:`remat.executors.Executor.fit`), on
the search of :mod:`remat.fit.search`, whose docstring lists the plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from remat.executors import Executor, executor_named
from remat.fit.graph_shapes import Dims
from remat.fit.questions import FitQuestion
from remat.fit.sac_formula import Copies
from remat.fit.search import FitReport
from remat.measure.meter import Loss
from remat.request import Request, RequestArgs, as_args, request_of

__all__ = ["fit"]


def fit(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    request: Request | None = None,
    max_batch: int = 1 << 16,
    shallow: tuple[nn.Module, int, int] | None = None,
    executor: str | Executor = "graph",
    copies: Copies | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    **flat: Unpack[RequestArgs],
) -> FitReport:
    """For each plan, the longest sequence at the example's batch and the largest batch at
    its length that fit the device budget (see :mod:`remat.fit.search` for the plans).

    The request (:class:`remat.Request`, or its fields as flat keyword arguments) needs a
    device budget; its ``time_limit_s`` (10 s by default here) is the chain solver's time for
    its per-block menus. ``max_seq``: the longest length searched (default: the model's
    ``config.max_position_embeddings`` or ``n_positions``, else 8x the example's).

    ``executor`` (an :class:`~remat.executors.Executor` or its name): ``"graph"``, remat's
    whole-graph executor, the step captured at a few shapes; ``shallow``: ``(copy with fewer
    layers, its layers, the model's layers)`` of a deep stack, to fit on the copy
    (:func:`remat.fit.graph_shapes.capture_dynamic_deep`). ``"sac"``: the plans of
    ``remat.apply`` (PyTorch's selective checkpointing on the blocks; FSDP2 over
    ``world_size`` ranks with ``zero_stage=3``): no checkpointing, the matmul outputs kept,
    every block recomputed, and the chain DP's menu applied to every block, each traced at
    the fit's shapes (:mod:`remat.fit.sac_shapes`); ``copies``: a builder of the model with
    ``n`` blocks, to trace a deep stack's shapes on copies with 4 and 5 blocks, or 5 and 6
    where the block before the last differs too (:mod:`remat.fit.deep`), checked against the
    model.

    ``loss_fn``/``target``: the loop's loss (as :func:`remat.optimize` and
    :func:`remat.apply` take it), its target tiled and cropped as the inputs are at every
    shape searched.
    """
    runner = executor_named(executor)
    if request is None:
        flat.setdefault("time_limit_s", 10.0)
    req = request_of(request, flat)
    if req.host_budget_bytes:
        raise ValueError("host_budget: remat fit plans without offload so far")
    budget = req.device(model)
    if budget is None:
        raise ValueError("pass budget_gb or budget_bytes")
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    max_seq = req.max_seq
    if max_seq is None and (seq := Dims.of(args, kwargs).seq) is not None:
        cfg = getattr(model, "config", None)
        max_seq = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        max_seq = int(max_seq) if max_seq else 8 * seq
    return runner.fit(
        FitQuestion(
            model=model, args=args, kwargs=kwargs, request=dataclasses.replace(req, max_seq=max_seq),
            budget=budget, max_batch=max_batch, loss=Loss.of(loss_fn, target), shallow=shallow,
            copies=copies,
        )
    )  # fmt: skip
