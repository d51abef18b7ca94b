"""``remat.apply``: a plan run by PyTorch's own selective checkpointing, on the user's blocks.

Where :func:`remat.optimize` returns a module of its own, ``apply`` wraps the model's blocks *in
place* (as ``fully_shard`` and torchtitan's ``apply_ac`` do) and returns the same object, so the
stack a user trains with -- FSDP2, DDP, ``torch.compile``, the Hugging Face Trainer, PEFT --
wraps it as usual. The recipe: ``remat.apply`` first, then ``fully_shard`` (or DDP), then
``torch.compile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from typing_extensions import Unpack

from remat import _torch_compat as tc
from remat.budget import PRECISIONS, Options, autocast_cache_hint
from remat.executors.host_store import HostStore
from remat.executors.sac import agree, planner, regions
from remat.executors.sac.files import file_regions, save_plan
from remat.executors.sac.hf import disable_kv_cache, restore_kv_cache
from remat.executors.sac.offload import Offloads
from remat.executors.sac.passes import Stage, analyze, plan_step
from remat.executors.sac.regions import BlockError
from remat.executors.sac.state import _STATE, Applied, _find_state, applied
from remat.executors.sac.trace import FSDP_PARAM_DTYPES, StepTrace, TraceError
from remat.fit.graph_shapes import inputs_at, sequence_dims
from remat.measure.autocast import AUTOCAST
from remat.measure.meter import Loss
from remat.measure.profiles import DeviceProfile, get_profile
from remat.measure.scratch import device_of
from remat.parallel.pipelining import Pipeline
from remat.plan.files import (
    read_plan,
)
from remat.request import (
    Request,
    RequestArgs,
    as_args,
    device_errors,
    request_of,
    resolve_profile,
)
from remat.solver.config import BudgetError
from remat.solver.offload import SAME_MEMORY
from remat.solver.plan import STEP_WITH_LOSS, STEP_WITHOUT_LOSS, Plan
from remat.solver.registry import solvers_for

__all__ = ["NATIVE_SOLVERS", "apply", "save_plan", "unapply"]

NATIVE_SOLVERS = tuple(name for name in solvers_for("sac") if name != "auto")
"""Solvers ``remat.apply(..., solver=)`` takes besides ``auto`` (its own: the chain DP and the
MILP, every plan traced): those of :data:`remat.solver.registry.SOLVER_TABLE` for the ``sac``
executor."""


def apply(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    request: Request | None = None,
    pipeline: Pipeline | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    group: ProcessGroup | None = None,
    **flat: Unpack[RequestArgs],
) -> nn.Module:
    """Plan a selective-checkpoint policy per block of ``model`` and wrap the blocks **in
    place**; returns ``model`` itself.

    Each block's ``forward`` then runs through ``torch.utils.checkpoint`` (non-reentrant) with
    a policy that keeps some ops' outputs and recomputes the rest in the backward (dropout
    replays its random state: gradients are bitwise those of the unwrapped model). Parameters,
    buffers and ``state_dict`` keys are untouched; :func:`unapply` restores the blocks.
    Where the blocks' plan recomputes, ``auto`` also plans with each block's sub-modules as
    the regions (:func:`remat.executors.sac.regions.split_blocks`) and keeps the cheaper plan that
    fits. The solvers also plan the modules outside the blocks that hold parameters (the
    embeddings, the final norm, the head: :func:`remat.executors.sac.regions.outside_blocks`);
    code that is no module's (a loss computed in the model's forward) runs eagerly. The KV cache of every
    Hugging Face model inside ``model`` (itself, or one a training wrapper calls) is turned off
    (``config.use_cache = False``, as ``gradient_checkpointing_enable()`` does; ``unapply``
    restores it).

    ``request``: the whole request as one :class:`remat.Request`, or, as sugar, its fields as
    flat keyword arguments (not both). Budget options are those of :func:`remat.optimize` (``budget_gb`` / ``budget_bytes`` for
    the whole device with ``optimizer``, ``precision``, ``zero_stage``, ``world_size``,
    ``reserve_fraction``; or ``activation_budget_bytes`` for the step alone). ``plan``: a
    fixed plan, ``keep_all`` (no checkpoint), ``keep_matmuls`` (each block keeps its matmul
    and attention outputs), ``torchtitan_op`` (torchtitan's op-SAC policy) or ``block`` (each
    block recomputed whole); or a plan file from
    :func:`save_plan`, re-applied without solving (one solved for other blocks or shapes
    raises :class:`remat.PlanFileError`). ``solver``: ``auto`` (the chain DP over per-block menus,
    each option traced on every block -- on two shallow copies of a stack of 12 regions or
    more, :mod:`remat.executors.sac.shallow` -- and the exact MILP on the step's dataflow; the
    cheapest plan traced on the model that fits), or one of remat's solvers planning for
    PyTorch's checkpoint executor (``exact``, ``lp_round``, ``keep_all``, ``keep_matmuls``,
    ``chen_greedy``, ...: see
    :mod:`remat.solver.executor`), its plan traced and re-solved for less while over budget.
    ``block_types``: class names (a base class names its subclasses) or path patterns of the
    blocks (default: the repeated children of ModuleLists and ModuleDicts; where they nest,
    the level whose every block recomputed traces the least peak:
    :func:`remat.executors.sac.regions.block_candidates`).

    Every plan's peak is measured by running the step, wrapped as it will train, on a
    FakeTensor copy of the model (no memory, any size), under the live-storage meter that
    measures real steps: ``remat.plan_of(model).predicted_peak_bytes``. With
    ``zero_stage=3, world_size=N`` the copy is sharded with FSDP2 over N ranks of a fake
    process group (``fully_shard`` on each block, then the root, as the recipe does) and the
    peak is one rank's: gathered parameters of the running and prefetched blocks, gradients
    before and after reduce-scatter. A model tensor-parallel over one dimension of a 2-D
    mesh (TP x FSDP2) is sharded over the mesh's other dimension instead, the job's own
    (whose size ``world_size`` must be): FSDP2's collectives on FakeTensors communicate
    nothing.

    ``precision="bf16-fsdp"`` (with ``zero_stage=3, world_size=N``) plans the step FSDP2's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` runs:
    bf16 parameters gathered per block, fp32 sharded master weights, gradients reduced in fp32.
    Shard with that policy (on each block, then the root) after ``apply``.

    ``max_seq``: for inputs whose length varies (dim 1 of the first input, token ids), the
    longest. The policies do not depend on shapes, so one plan runs every length; it is planned
    and its peak traced at ``max_seq`` (the example inputs tiled to that length), the longest
    and so the highest-peaked of them.

    ``pipeline``: ``model`` is one stage of a ``torch.distributed.pipelining`` pipeline
    (:class:`remat.parallel.pipelining.Pipeline`: the schedule, this stage's index, the number
    of stages and of microbatches). ``example_inputs`` are then one microbatch's inputs of
    this stage (for a later stage, the activations it receives), and ``target`` one
    microbatch's target (last stage). The budget is this stage's, and the peak planned is
    that of a whole ``schedule.step()``: every microbatch in flight at each action of the
    schedule, as it runs (traced through PyTorch's own schedule on a fake process group).
    Under a multi-stage schedule (``Interleaved1F1B``, ``LoopedBFS``: ``Pipeline(...,
    stages_per_rank=V)``) ``model`` is the rank's V stage modules as one ``nn.ModuleList``
    (stage order), ``example_inputs`` one microbatch's input per stage, and the blocks by
    default each stage's own; the stages are planned together, for the rank's device.

    ``loss_fn``: the loss the training loop computes from the model's output, ``loss =
    loss_fn(output, target)`` (``target``: the example batch's labels, shaped as the inputs
    are). The plan and its predicted peak are then those of the step the loop runs: ``out =
    model(*inputs); loss = loss_fn(out, target); del out; loss.backward()`` (the output dies
    when the loss no longer needs it; the loss's own buffers count). The model is still
    called as before and returns its output. Without ``loss_fn`` the step planned is the
    forward and a backward from a dense output gradient, the output alive until the backward
    ends (``plan.step`` says which). With ``pipeline``, the loss is the pipeline's
    (``Pipeline(loss_fn=...)``) and ``target`` one microbatch's target of the last stage.

    ``group``: under ``torch.distributed``, the process group whose ranks train one plan
    (default: the default group; under a pipeline, none unless given: pass the stage's
    data-parallel group). Every rank of it calls ``apply``; its first rank solves and
    broadcasts the plan, and each other rank applies it after checking that it traced the
    same step (:mod:`remat.executors.sac.agree`; a rank that differs raises
    :class:`remat.PlanFileError`).

    Order matters: apply remat before ``fully_shard``, DDP and ``torch.compile`` (it is
    refused after them), and only once (:func:`unapply` first to re-plan).
    """
    req = request_of(request, flat)
    _check_request(req)
    _check_pipeline(req, pipeline, target, loss_fn)
    _check_unwrapped(model)
    shared = agree.group_of(group, pipeline)
    if shared is None or req.plan is not None:  # a fixed plan or a file: nothing to solve
        return _apply(model, example_inputs, example_kwargs, req, pipeline, loss_fn, target)

    def solve(path: Path) -> None:
        _apply(model, example_inputs, example_kwargs, req, pipeline, loss_fn, target)
        save_plan(model, path)

    def load(path: Path, first: int) -> None:
        loaded = replace(req, plan=path, solver=None, activation_budget_bytes=None)
        _apply(model, example_inputs, example_kwargs, loaded, pipeline, loss_fn, target)
        state = applied(model)
        plan = replace(state.plan, reason=agree.broadcast_reason(state.plan.reason, first))
        model.__dict__[_STATE] = replace(state, plan=plan)

    agree.agreed(shared, solve, load)
    return model


def _apply(
    model: nn.Module,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    req: Request,
    pipeline: Pipeline | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
) -> nn.Module:
    """:func:`apply` on this rank alone, the request checked."""
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    if req.max_seq is not None:
        args, kwargs, target = _at_longest(args, kwargs, target, req.max_seq)
    loss = Loss.of(loss_fn, target)
    device = req.device(model)
    profile = get_profile(resolve_profile(model, req.device_profile))
    if req.host_budget_bytes and profile.link is None:
        raise ValueError(
            f"host_budget: device profile {profile.name} has no copy link to host memory "
            "(DeviceProfile.link), which offload's timing needs: give it one, or plan "
            "without a host budget"
        )
    where = device_of(model)
    if req.host_budget_bytes and where is not None and where.type != "cpu":
        raise ValueError(_OFFLOAD_ON_CPU_ONLY.format(where.type))
    options = req.training

    t0 = time.perf_counter()
    use_cache = disable_kv_cache(model)
    try:
        blocks, chose = _find_blocks(model, req, pipeline, args, kwargs, profile, loss)
        with device_errors(device):
            problem, solution = plan_step(
                model,
                blocks,
                args,
                kwargs,
                req,
                req.step_budget(device),
                profile,
                Stage(pipeline, target) if pipeline is not None else None,
                loss,
            )
    except BudgetError as e:
        restore_kv_cache(model, use_cache)
        if pipeline is None:
            hint = autocast_cache_hint(options)
            if hint is not None:
                e.add_hint(hint)
            raise
        raise BudgetError(
            e.budget_bytes,
            e.least_peak_bytes,
            f"pipeline {pipeline.describe()}: its least peak over a schedule step",
            achievable=e.achievable,
        ) from e
    except BaseException:
        restore_kv_cache(model, use_cache)  # a failed apply leaves the model as it was
        raise
    t1 = time.perf_counter()
    chosen = _chosen(problem, solution, chose, options, step_planned(loss, pipeline))
    if solution.trace.offloaded and profile.link is not None and profile.link.synchronous:
        chosen = replace(chosen, reason=f"{chosen.reason}; offload on {SAME_MEMORY}")
    if device is not None:
        chosen = replace(chosen, device_memory=device.breakdown(chosen))

    offloads = _wrap(model, problem, solution, use_cache)
    model.__dict__[_STATE] = Applied(
        plan=chosen,
        blocks=problem.blocks,
        policies=solution.policies,
        timings={"plan": t1 - t0},
        use_cache=use_cache,
        fingerprint=planner.fingerprint(problem),
        describe={
            "model": type(model).__name__,
            "precision": options.precision,
            "device_profile": profile.name,
        },
        options=solution.options,
        eager_peak_bytes=problem.baseline.peak_bytes,
        block_recompute_s=tuple(planner.costs(solution.trace).time_s),
        scratch=solution.trace.scratch,
        schedule=solution.trace.schedule,
        eager_times_s=_times(problem.baseline),
        eager_schedule=problem.baseline.schedule,
        offloads=offloads,
    )
    return model


_OFFLOAD_ON_CPU_ONLY = (
    "host_budget: offload runs on a CPU device so far, not {} (copies on side streams and a "
    "pinned pool are not built yet); plan for it on FakeTensors (remat plan), or without a "
    "host budget"
)


def _wrap(
    model: nn.Module,
    problem: planner.NativeProblem,
    solution: planner.Solution,
    use_cache: tuple[str, ...],
) -> Offloads | None:
    """Wrap the regions with the solution's policies, and its offload: their host store
    (None without offload), which runs on a CPU device so far."""
    modules = dict(model.named_modules())
    offloaded = solution.trace.offloaded
    where = device_of(model)  # a plan file's offload, which no host budget asked for
    if offloaded and where is not None and where.type != "cpu":
        restore_kv_cache(model, use_cache)
        raise ValueError(_OFFLOAD_ON_CPU_ONLY.format(where.type))
    offloads = Offloads(HostStore()) if offloaded else None
    for k, (path, policy) in enumerate(zip(problem.blocks, solution.policies, strict=True)):
        regions.wrap(modules[path], path, policy, offloads, k in offloaded)
    return offloads


def _chosen(
    problem: planner.NativeProblem,
    solution: planner.Solution,
    chose: str,
    options: Options,
    step: str,
) -> Plan:
    """The plan ``remat.plan_of`` returns, its reason saying how the blocks were chosen and
    that autocast's cast cache is off inside checkpointed regions, where that holds."""
    chosen = replace(planner.to_plan(problem, solution), step=step)
    if chose:
        chosen = replace(chosen, reason=f"{chose}; {chosen.reason}")
    if AUTOCAST.get(options.precision) is not None and any(
        p is not None for p in solution.policies
    ):
        chosen = replace(
            chosen,
            reason=f"{chosen.reason}; autocast's cast cache is off inside the checkpointed "
            "regions (the same values; each 16-bit weight copy dies with its region, not at "
            "the forward's end)",
        )
    return chosen


def _times(trace: StepTrace) -> tuple[float, float]:
    """The estimated forward and backward (recompute included) time of ``trace``'s step."""
    forward = sum(e.time_s for e in trace.events if e.phase == "forward")
    return forward, sum(e.time_s for e in trace.events if e.phase != "forward")


def _find_blocks(
    model: nn.Module,
    req: Request,
    pipeline: Pipeline | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    profile: DeviceProfile,
    loss: Loss | None,
) -> tuple[tuple[str, ...], str]:
    """The blocks, and how they were chosen where several sets compete ("" otherwise). For
    a rank of a multi-stage schedule (an ``nn.ModuleList`` of its stages), by default each
    stage's own."""
    if pipeline is not None:
        pipeline.check_modules(model)
        if pipeline.stages_per_rank > 1 and not req.block_types:
            return tuple(
                f"{k}.{path}"
                for k, stage in enumerate(model.children())
                for path in regions.find_blocks(stage, ())
            ), ""
    if req.block_types:
        return regions.find_blocks(model, req.block_types), ""
    candidates = regions.block_candidates(model)
    if len(candidates) == 1:
        return candidates[0], ""
    if req.is_plan_file():
        assert isinstance(req.plan, (str, Path))
        f = read_plan(req.plan)
        saved = set(f.record.get("graph", {}).get("blocks", ()))
        for blocks in candidates:  # the set the file was solved on
            if set(file_regions(f, model, blocks)) == saved:
                return blocks, ""
        return candidates[-1], ""  # its fingerprint then says it is for other blocks
    return _least_peak_blocks(model, candidates, args, kwargs, req, profile, loss)


def _least_peak_blocks(
    model: nn.Module,
    candidates: tuple[tuple[str, ...], ...],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    req: Request,
    profile: DeviceProfile,
    loss: Loss | None,
) -> tuple[tuple[str, ...], str]:
    """Of several sets of blocks (:func:`remat.executors.sac.regions.block_candidates`), the one
    whose every block recomputed traces the least peak, ties to the finest: which level of a
    nested stack (Swin's stages or their layers) lets a plan go lowest depends on the model,
    so each is traced once, as it would be planned."""
    progress = req.progress or (lambda _: None)
    peaks: list[int] = []
    failed: list[TraceError] = []
    for blocks in candidates:
        where = f"{len(blocks)} blocks from {regions.describe_blocks(blocks)}"
        try:
            traced, problem = analyze(model, blocks, args, kwargs, req, profile, loss=loss)
            policies = planner.fixed_policies(problem, "block")
            peaks.append(traced.trace(args, kwargs, policies).peak_bytes)
        except TraceError as e:  # e.g. experts the example's routing never calls
            progress(f"native: {where} cannot be the regions ({e})")
            failed.append(e)
            peaks.append(-1)
            continue
        progress(f"native: {where}: least peak {peaks[-1]:,} B (every block recomputed)")
    if len(failed) == len(candidates):
        raise failed[0]
    best = min((k for k in range(len(candidates)) if peaks[k] >= 0), key=lambda k: (peaks[k], -k))
    others = ", ".join(
        f"{len(c)} from {regions.describe_blocks(c)}: "
        + (f"{p:,} B" if p >= 0 else "not all called")
        for k, (c, p) in enumerate(zip(candidates, peaks, strict=True))
        if k != best
    )
    blocks = candidates[best]
    return blocks, (
        f"blocks: the {len(blocks)} in {regions.describe_blocks(blocks)}, whose every block "
        f"recomputed traces the least peak ({peaks[best]:,} B; {others})"
    )


def step_planned(loss: Loss | None, pipeline: Pipeline | None = None) -> str:
    """What a plan's peak covers (:attr:`remat.Plan.step`)."""
    if pipeline is not None:
        return f"one schedule step of {pipeline.describe()}, the pipeline's loss included"
    if loss is not None:
        return STEP_WITH_LOSS
    return STEP_WITHOUT_LOSS


def _check_pipeline(
    req: Request, pipeline: Pipeline | None, target: Any, loss_fn: Any = None
) -> None:
    if pipeline is None:
        if target is not None and loss_fn is None:
            raise ValueError(
                "target is the loss's: pass loss_fn= too (loss = loss_fn(output, target))"
            )
        return
    if req.host_budget_bytes:
        raise ValueError(
            "host_budget: a pipeline stage offloads nothing yet (its microbatches in flight "
            "would each hold copies); plan the stage without a host budget"
        )
    if loss_fn is not None:
        raise ValueError(
            "a pipeline stage's loss is the pipeline's: remat.Pipeline(..., loss_fn=...), "
            "not remat.apply(..., loss_fn=...)"
        )
    if AUTOCAST.get(req.training.precision) is not None:
        raise ValueError(
            f"a pipeline stage is planned without autocast for now, not {req.training.precision}"
        )
    if pipeline.last and target is None:
        raise ValueError(
            f"stage {pipeline.n_stages - 1} is the last: pass one microbatch's target "
            "(remat.apply(..., target=...)) for its loss"
        )
    if not pipeline.last and target is not None:
        raise ValueError(f"only the last stage takes a target, not stage {pipeline.stage}")


def _check_request(req: Request) -> None:
    if req.solver not in (None, "auto", *NATIVE_SOLVERS):
        raise ValueError(
            f"unknown native solver {req.solver!r}; valid: auto, {', '.join(sorted(NATIVE_SOLVERS))}"
        )
    if req.training.precision not in (*AUTOCAST, *FSDP_PARAM_DTYPES):
        raise ValueError(
            f"unknown precision {req.training.precision!r}; valid: {', '.join(PRECISIONS)}"
        )
    if req.seq_buckets:
        raise ValueError(
            "seq_buckets is for remat.optimize: remat.apply's policies run every length "
            "(pass max_seq alone)"
        )
    if isinstance(req.plan, Plan):
        raise ValueError(
            "remat.apply takes a fixed plan's name or a plan file from remat.save_plan, not a "
            "Plan object of remat.optimize's executor"
        )


def _at_longest(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, max_seq: int
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """The example inputs and the loss's target tiled to ``max_seq`` along their sequence
    dimension (the target as the inputs: where its dimensions have their sizes)."""
    dims = sequence_dims(args, kwargs, max_seq)
    a, kw = inputs_at((*args, target), kwargs, dims, dims.batch, max_seq)
    return a[:-1], dict(kw), a[-1]


def unapply(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every block runs its own forward again. Returns ``model``."""
    if _STATE not in model.__dict__:
        raise ValueError(f"{type(model).__name__} has no remat plan to remove")
    for m, _ in list(regions.iter_regions(model)):
        regions.unwrap(m)
    state = model.__dict__.pop(_STATE)
    restore_kv_cache(model, state.use_cache)
    return model


def _check_unwrapped(model: nn.Module) -> None:
    name = type(model).__name__
    if _find_state(model) is not None or any(True for _ in regions.iter_regions(model)):
        raise BlockError(
            f"{name} already has a remat plan: call remat.unapply(model) before applying again"
        )
    if isinstance(model, tc.OptimizedModule):
        raise BlockError(
            f"{name} is compiled: apply remat to the model first, then torch.compile it"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise BlockError(
            f"{name} is already wrapped by DistributedDataParallel: apply remat to the model "
            "first (remat.apply(model, ...)), then wrap it with DDP"
        )
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise BlockError(
            f"{name} is already sharded with fully_shard: apply remat first "
            "(remat.apply(model, ...)), then fully_shard each block and the root, then compile"
        )
