"""The native executor's exact memory: PyTorch's own checkpoint run on FakeTensors.

Selective activation checkpointing (SAC) runs the backward its own way: a region holds its
positional inputs and its ``MUST_SAVE`` outputs through the forward; at the first unpack in
its backward it replays its forward, returning cached outputs and recomputing the rest, and
stops once it has re-saved as many tensors as the forward packed; cached entries past that
point live until the frame dies; recomputed tensors die as their autograd node drops them.
Rather than re-implement those rules (they change between releases), remat *runs* the step --
the very same wrappers, policies and autograd engine -- on a FakeTensor copy of the model,
under the same live-storage meter that measures real runs. Shapes of any size cost no memory
(a 70B layer plans on a laptop), and the predicted peak is the measured one by construction:
the tests check it against real runs.

Every op of that run is recorded with where it ran (which block, forward or backward, whether
it is a recomputation), its bytes and its estimated time, which is what the planner needs:
the op stream each region's policy sees, and per-block costs in context for the chain DP.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from remat import _torch_compat as tc
from remat.executors.host_store import HostStore
from remat.executors.sac import regions
from remat.executors.sac.events import OpEvent, StepTrace, TraceError
from remat.executors.sac.hf import real_packing_check
from remat.executors.sac.offload import CopyMark, CountingStore, Offloads, exposed_copy_s
from remat.executors.sac.recorder import (
    Recorder,
    explain_failure,
    label_blocks,
    module_stack,
)
from remat.executors.sac.regions import Policy
from remat.measure.autocast import policy_of
from remat.measure.meter import Loss, LossError, output_tensors, training_step
from remat.measure.profiles import DeviceProfile
from remat.measure.scratch import device_of, where_measured_on
from remat.parallel.pipelining import Action, Pipeline, ScheduleTrace

__all__ = ["FSDP_PARAM_DTYPES", "FakeModel", "OpEvent", "StepTrace", "TraceError"]


FSDP_PARAM_DTYPES: Mapping[str, torch.dtype] = {"bf16-fsdp": torch.bfloat16}
"""Precisions that are FSDP2's own mixed precision: the dtype its parameters are gathered in."""


def _pipeline_group(world: tc.FakeWorld, pipeline: Pipeline) -> Any:
    """The ``"pp"`` process group of a tensor-parallel fake world a pipeline stage was
    parallelized on; a clear error unless the world places it where ``pipeline`` says."""
    pp = world.dim("pp")
    if pp is None or pp.size() != pipeline.ranks or world.coordinate("pp") != pipeline.stage:
        raise TraceError(
            f"this tensor-parallel model was not parallelized as pipeline rank "
            f"{pipeline.stage} of {pipeline.ranks}: parallelize it with "
            "remat.parallel.tensor.tensor_parallel(model, tp_size, "
            f"pp_size={pipeline.ranks}, pp_rank={pipeline.stage})"
        )
    with world.active():
        return pp.get_group()


class FakeModel:
    """A copy of the user's model that steps are traced on: FakeTensors (no memory, any
    size), or with ``real=True`` real tensors, for models whose step cannot run on
    FakeTensors (data-dependent shapes, as MoE routing has): exact for the example inputs.

    ``fsdp_world``: the copy is sharded with FSDP2 over that many ranks of a fake process
    group (:class:`remat._torch_compat.FakeWorld`), each block and then the root, and the
    step is traced as one rank runs it: gathered parameters of the running and prefetched
    blocks, gradients before and after reduce-scatter. ``fsdp_param_dtype``: FSDP2's own mixed
    precision (:func:`remat._torch_compat.fully_shard_blocks`): parameters gathered in that
    dtype, gradients reduced in fp32. ``fsdp_units``: the modules sharded, where they are not
    the regions (regions finer than the blocks, :func:`remat.executors.sac.regions.split_blocks`,
    run inside the blocks FSDP2 shards). ``pipeline``: the model is that stage of a pipeline
    (:mod:`remat.parallel.pipelining`); each trace also steps it through the schedule, as its
    rank on a fake process group of ``n_stages`` ranks, and its peak is that step's.
    ``target``: one microbatch's, for the last stage's loss. ``loss``: the user's loss
    (:class:`remat.measure.meter.Loss`, its target on the copy's tensors), part of every traced step
    (not with ``pipeline``, whose loss is the schedule's).

    The regions are traced in the order their forwards first run (:meth:`in_call_order`)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[str],
        *,
        real: bool = False,
        fsdp_world: int | None = None,
        fsdp_param_dtype: torch.dtype | None = None,
        fsdp_units: Sequence[str] | None = None,
        pipeline: Pipeline | None = None,
        target: Any = None,
        loss: Loss | None = None,
    ) -> None:
        self.real = real
        self.source_device = device_of(model)
        """Where the user's model lives (None: FakeTensors), for measuring kernel scratch."""
        self.mode: Any
        tp_world = None if real else tc.fake_world_of(model)
        if real:
            self.mode = contextlib.nullcontext()
            self.module = copy.deepcopy(model)
        else:
            # A model built under remat.fake_mode() keeps its mode (modes cannot mix).
            self.mode = tc.fake_mode_of(model) or tc.FakeTensorMode(allow_non_fake_inputs=False)
            with tp_world.active() if tp_world is not None else contextlib.nullcontext():
                self.module = tc.fake_copy(model, self.mode)
        self.blocks = tuple(blocks)
        self.units = tuple(fsdp_units) if fsdp_units is not None else self.blocks
        """The modules FSDP2 shards (with ``fsdp_world``)."""
        self._paths = {id(m): p for p, m in self.module.named_modules()}
        modules = dict(self.module.named_modules())
        self._blocks = [modules[p] for p in self.blocks]
        self._running_stats = frozenset(
            tc.storage_key(b)
            for m in self.module.modules()
            if tc.is_batchnorm(m)
            for b in m.buffers(recurse=False)
        )
        self.world: tc.FakeWorld | None = tp_world
        """The fake world the step's collectives are registered in: FSDP2's (``fsdp_world``)
        or the one a tensor-parallel plan was made on
        (:func:`remat.parallel.tensor.tensor_parallel`); None for a real process group, or
        none."""
        self._warm = False
        self.loss: Loss | None = None
        if loss is not None:
            with self.mode:
                self.loss = replace(loss, target=tc.tree_map(self._fake, loss.target))
        self.pipeline = pipeline
        self.target = target
        self._pp_group: Any = None
        """The pipeline's process group in a tensor-parallel fake world (None: the fake
        world's default group, of the pipeline's ranks alone)."""
        if pipeline is not None:
            self._join_pipeline(model, pipeline, fsdp_world or 1, target)
        self._sharded = fsdp_world is not None
        if fsdp_world is not None:
            if real:
                raise TraceError(
                    "FSDP2 can only be traced on FakeTensors, and this model's step cannot "
                    "run on them: plan without zero_stage=3 (the single-device step)"
                )
            units = self._blocks if fsdp_units is None else [modules[p] for p in fsdp_units]
            # A rank's pipeline stages each FSDP2's root: PipelineStage drives each one's
            # gradient sync and resharding itself.
            roots = (
                list(self.module.children())
                if pipeline is not None and pipeline.stages_per_rank > 1
                else None
            )
            self._shard(units, fsdp_world, fsdp_param_dtype, roots)

    def _join_pipeline(self, model: nn.Module, pipeline: Pipeline, dp: int, target: Any) -> None:
        """The fake world of a pipeline stage's ranks (with ``dp`` data-parallel ranks beside
        them, on one mesh), its process group, and the last stage's target on the copy."""
        if self.real:
            raise TraceError(
                "a pipeline stage is planned on FakeTensors, and this model's step "
                "cannot run on them"
            )
        pipeline.check_modules(model)
        if self.world is None and dp == 1:
            self.world = tc.FakeWorld(pipeline.ranks, rank=pipeline.stage)
        else:  # the pipeline and the data-parallel ranks on one mesh
            if self.world is None and tc.tensor_parallel_mesh(model) is not None:
                raise TraceError(
                    "a tensor-parallel pipeline stage with FSDP2 inside it is planned "
                    "ahead of the job, not in it yet: plan it on FakeTensors with "
                    "remat.parallel.tensor.tensor_parallel(stage, tp_size, dp_size=..., "
                    "pp_size=..., pp_rank=...) (remat plan --pp-size --tp-size "
                    "--zero-stage 3), save the plan and apply the file in the job"
                )
            if self.world is None:
                dims = [("pp", pipeline.ranks), ("dp", dp)]
                self.world = tc.fake_mesh_world(dims, pipeline.stage * dp)
            self._pp_group = _pipeline_group(self.world, pipeline)
        with self.mode:
            self.target = tc.tree_map(self._fake, target)

    def _shard(
        self,
        units: list[nn.Module],
        dp: int,
        param_dtype: torch.dtype | None,
        roots: list[nn.Module] | None = None,
    ) -> None:
        """FSDP2 on the copy over ``dp`` ranks: of a fake world of its own; of the 2-D fake
        mesh a tensor-parallel plan was made on (:func:`remat.parallel.tensor.tensor_parallel`
        with ``dp_size``); or, for a model the job parallelized on a real 2-D mesh, over that
        mesh's data-parallel dimension, where FSDP2's collectives on FakeTensors run no
        communication (the job's process groups take the step as it is traced)."""
        mesh = None
        if self.world is not None:  # tensor-parallel on FakeTensors
            mesh = self.world.dim("dp")
            size = mesh.size() if mesh is not None else 1
        elif (tp := tc.tensor_parallel_mesh(self.module)) is not None:
            mesh = tc.data_parallel_mesh(tp)
            size = mesh.size() if mesh is not None else 1
        else:
            self.world = tc.FakeWorld(dp)
            size = dp
        if size != dp:
            has = (
                f"has {size} data-parallel ranks" if size > 1 else "has no data-parallel dimension"
            )
            fix = (
                f"parallelize it with remat.parallel.tensor.tensor_parallel(model, tp_size, "
                f"dp_size={dp})"
                if self.world is not None
                else "lay the job's ranks out on a 2-D mesh (init_device_mesh with two named "
                "dimensions), parallelize_module over one and pass the other's size"
            )
            raise TraceError(
                f"this tensor-parallel model's mesh {has}, not zero_stage=3's "
                f"world_size={dp}: {fix}"
            )
        with self.world.active() if self.world is not None else contextlib.nullcontext():
            tc.fully_shard_blocks(self.module, units, dp, self.mode, param_dtype, mesh, roots)

    def with_regions(self, blocks: Sequence[str]) -> FakeModel:
        """This copy, sharded and warmed up, with other regions (the blocks' sub-modules,
        in the same FSDP2 units): a second pass without a second copy and warm-up step."""
        other = copy.copy(self)
        modules = dict(self.module.named_modules())
        other.blocks = tuple(blocks)
        other._blocks = [modules[p] for p in other.blocks]
        return other

    def in_call_order(self, trace: StepTrace) -> tuple[int, ...]:
        """The permutation that sorts the regions by where their forward first ran in
        ``trace``; the copy's regions are put in that order (a chain's order, which the
        planner's per-region costs read), and the permutation returned."""
        first: dict[int, int] = {}
        for k, e in enumerate(trace.events):
            if e.phase == "forward" and e.block >= 0:
                first.setdefault(e.block, k)
        order = tuple(sorted(range(len(self.blocks)), key=lambda b: first.get(b, len(first))))
        self.blocks = tuple(self.blocks[b] for b in order)
        self._blocks = [self._blocks[b] for b in order]
        return order

    def trace(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        policies: Sequence[Policy],
        *,
        profile: DeviceProfile,
        autocast: torch.dtype | None = None,
        schedule: bool = True,
        target: Any = None,
        schedule_events: bool = False,
        offload: Sequence[bool] | None = None,
    ) -> StepTrace:
        """Run one training step (as :func:`remat.measure.meter.training_step`) with ``policies[k]``
        on block ``k`` and record it; on a pipeline stage, then one ``schedule.step()``,
        which sets the peak, unless ``schedule`` is false: one microbatch's step alone then,
        whose per-block quantities are the same at a tenth of the cost (8 microbatches).
        ``target``: the last stage's microbatch target at these inputs' shape, or the loss's
        (default: the one given at construction). ``schedule_events``: keep the schedule step's events
        (:attr:`ScheduleTrace.events`, for fitting its peak over shapes; large at scale).
        ``offload[k]``: block ``k``'s activation inputs wait in host memory
        (:mod:`remat.executors.sac.offload`; a host store that counts bytes on FakeTensors)."""
        where = where_measured_on(self.source_device, profile.name)
        recorder = self._new_recorder(profile)
        for p in self.module.parameters():
            p.grad = None
        fake_args, fake_kwargs = tc.tree_map(self._fake, (args, dict(kwargs)))
        loss = self.loss
        if loss is not None and target is not None:
            loss = replace(loss, target=tc.tree_map(self._fake, target))
        if self.pipeline is not None:
            fake_args = self._stage_inputs(fake_args, fake_kwargs, autocast)
        if not self._warm and (self._sharded or (self.world is not None and self.pipeline is None)):
            self._warm_up(fake_args, fake_kwargs, autocast, policy_of(profile.name), loss)
        offloads = self._offloads(offload, profile)
        marks: list[CopyMark] = []
        if offloads is not None:
            offloads.observer = lambda kind, held: marks.append(
                CopyMark(kind, held.number, held.path, held.nbytes, len(recorder.rows))
            )
        with contextlib.ExitStack() as stack:
            self._recording(stack, recorder, policies, kwargs, offloads, offload)

            def backward_starts(outputs: Sequence[torch.Tensor]) -> None:
                recorder.phase, recorder.block = "backward", -1
                recorder.outputs = tuple(recorder.storage_names(outputs))

            with self._stepping(recorder):
                training_step(
                    self._stepped(),
                    fake_args,
                    fake_kwargs,
                    autocast=autocast,
                    on_backward=backward_starts,
                    autocast_policy=policy_of(profile.name),
                    loss=loss,
                )
                live_at_end = frozenset(recorder.names.values())
        missing = [self.blocks[k] for k in range(len(self.blocks)) if k not in recorder.fwd_live]
        if missing:
            raise TraceError(f"regions never called in the forward: {missing[:3]}")
        live = tuple(recorder.fwd_live[k] for k in range(len(self.blocks)))
        peak = recorder.allocator_peak()
        events = recorder.events()
        step = StepTrace(
            events=events,
            peak_bytes=peak,
            blocks=self.blocks,
            forward_live=live,
            storage_bytes=recorder.storage_bytes,
            outputs=recorder.outputs,
            live_at_end=live_at_end,
            deaths=dict(recorder.deaths),
            tensor_peak_bytes=recorder.peak_bytes,
            scratch=where or "not measured (FakeTensors, or another device): counts 0",
            unseen_peak_bytes=recorder.unseen_peak,
            dispatch_s=recorder.dispatch_s(events),
        )
        if offloads is not None:
            step = _with_copies(step, marks, offloads, profile)
        if self.pipeline is None or not schedule:
            return step
        if target is not None:
            with self.mode:
                target = tc.tree_map(self._fake, target)
        stepped = self._trace_schedule(
            fake_args, policies, profile, self.target if target is None else target, schedule_events
        )
        return replace(
            step,
            peak_bytes=stepped.peak_bytes,
            tensor_peak_bytes=stepped.tensor_peak_bytes,
            schedule=stepped,
        )

    @contextlib.contextmanager
    def _stepping(self, recorder: Recorder) -> Iterator[None]:
        """Around a recorded step: a failure says where in the step it happened
        (:func:`explain_failure`), and the copy's gradients are dropped after it (shared with the
        user's model when that is fake)."""
        try:
            yield
        except (TraceError, LossError):
            raise
        except Exception as e:
            raise explain_failure(e, recorder, self.real) from e
        finally:
            for p in self.module.parameters():
                p.grad = None

    def _new_recorder(self, profile: DeviceProfile) -> Recorder:
        where = where_measured_on(self.source_device, profile.name)
        host = self.source_device is not None and self.source_device.type == "cpu"
        return Recorder(profile, self.blocks, self._running_stats, allocator=bool(where), host=host)

    def _recording(
        self,
        stack: contextlib.ExitStack,
        recorder: Recorder,
        policies: Sequence[Policy],
        kwargs: Mapping[str, Any],
        offloads: Offloads | None = None,
        offload: Sequence[bool] | None = None,
    ) -> None:
        """Enter, on ``stack``, what a recorded step runs under: ``policies[k]`` on block
        ``k`` (offloading its inputs into ``offloads`` where ``offload[k]``), the labels and observers that tell the recorder where each op runs, the fake
        world, the FakeTensor mode and the recorder, and a forked random stream."""
        for k, (m, policy) in enumerate(zip(self._blocks, policies, strict=True)):
            regions.wrap(m, self.blocks[k], policy, offloads, bool(offload and offload[k]))
            stack.callback(regions.unwrap, m)
            stack.enter_context(label_blocks(m, k, self.blocks[k], recorder))
        regions._observers.append(recorder.region)
        stack.callback(regions._observers.pop)
        regions._made_outside.append(recorder.made_outside)
        stack.callback(regions._made_outside.pop)
        regions._policy_calls.append(recorder.policy_called)
        stack.callback(regions._policy_calls.pop)
        regions._contexts_made.append(recorder.sac_contexts)
        stack.callback(regions._contexts_made.pop)
        if self.world is not None:
            stack.enter_context(self.world.active())
        if self.world is not None or self._sharded:
            stack.enter_context(tc.fsdp_storage_resizes(recorder.resized))
        stack.enter_context(module_stack(self._paths, recorder.modules))
        if not self.real:
            stack.enter_context(real_packing_check(kwargs))
        stack.enter_context(self.mode)
        stack.enter_context(recorder)
        stack.enter_context(torch.random.fork_rng(devices=[]))
        if recorder.host:  # CPU RNG states are host memory: device memory only on the CPU
            # After fork_rng, whose own saved state the real step does not have.
            stack.enter_context(tc.rng_states_saved(recorder.made_outside))

    def _offloads(self, offload: Sequence[bool] | None, profile: DeviceProfile) -> Offloads | None:
        """The offload state of a traced step that offloads (None otherwise): a store that
        counts bytes on FakeTensors, a real one on a real copy (whose values must stay
        exact: they may decide shapes)."""
        if offload is None or not any(offload):
            return None
        if len(offload) != len(self.blocks):
            raise ValueError(
                f"offload: one flag per region ({len(self.blocks)}), not {len(offload)}"
            )
        if self.pipeline is not None:
            raise TraceError("a pipeline stage offloads nothing yet: plan it without a host budget")
        if profile.link is None:
            raise TraceError(f"profile {profile.name} has no copy link to host memory: no offload")
        return Offloads(HostStore() if self.real else CountingStore())

    def _stepped(self) -> nn.Module:
        """What one step runs: the model, or a rank's stages each on its own input."""
        if self.pipeline is not None and self.pipeline.stages_per_rank > 1:
            return _EachOnItsInput(self.module)
        return self.module

    def _stage_inputs(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], autocast: torch.dtype | None
    ) -> tuple[Any, ...]:
        """A stage's inputs as it receives them: a later stage's float activations require
        their gradient (the stage sends it back). A rank of a multi-stage schedule: one
        input per stage it holds."""
        if kwargs or autocast is not None:
            raise TraceError(
                "a pipeline stage is planned with positional tensor inputs and without "
                "autocast (keyword inputs and autocast are not supported yet)"
            )
        pipe = self.pipeline
        assert pipe is not None
        if pipe.stages_per_rank > 1 and len(args) != pipe.stages_per_rank:
            raise TraceError(
                f"a rank holding stages {', '.join(map(str, pipe.indices))} takes one "
                f"microbatch input per stage ({pipe.stages_per_rank}), not {len(args)}"
            )
        with self.mode:
            return tuple(
                a
                if (pipe.first and (k == 0 or pipe.stages_per_rank == 1))
                or not a.is_floating_point()
                else a.detach().requires_grad_()
                for k, a in enumerate(args)
            )

    def _trace_schedule(
        self,
        args: tuple[Any, ...],
        policies: Sequence[Policy],
        profile: DeviceProfile,
        target: Any,
        events: bool,
    ) -> ScheduleTrace:
        """One ``schedule.step()`` of the stage under ``policies``, recorded (the module
        docstring of :mod:`remat.parallel.pipelining`): a fresh ``PipelineStage`` each time,
        so its receive buffers, allocated by a stage's first step, count."""
        pipe, world = self.pipeline, self.world
        assert pipe is not None and world is not None
        recorder = self._new_recorder(profile)
        n = pipe.microbatches
        with world.active(), self.mode, torch.no_grad(), torch.random.fork_rng(devices=[]):
            inputs = tuple(a.detach() for a in args)
            several = pipe.stages_per_rank > 1
            modules = list(self.module.children()) if several else [self.module]
            per_stage = [(a,) for a in inputs] if several else [inputs]
            stages = []
            for module, index, ins in zip(modules, pipe.indices, per_stage, strict=True):
                outs = tuple(t.detach() for t in output_tensors(module(*ins)))
                stages.append(
                    tc.static_pipeline_stage(
                        module, index, pipe.n_stages, ins[0].device, ins, outs, self._pp_group
                    )
                )
            # The forward above left FSDP2's root unsharded (a root keeps its parameters
            # after forward); the schedule's first step reshards it before any action (its
            # metadata clean-up), which the recorder must not see as a free in the step.
            tc.reshard_fsdp(self.module)
            batch = tuple(torch.cat([a] * n) for a in per_stage[0])  # the user's, made before
            target = None if target is None else torch.cat([target] * n)
            # Every rank passes a loss function: without one a schedule runs no backward.
            schedule = tc.pipeline_schedule_class(pipe.schedule)(
                stages if several else stages[0],
                n_microbatches=n,
                loss_fn=pipe.loss_fn or _no_loss,
            )
        tc.skip_p2p_warmup(schedule)
        actions: list[Action] = []
        overall = [0]

        def recorded(kind: str, index: int, run: Any) -> Any:
            def action(mb: int, *a: Any, **k: Any) -> Any:
                recorder.phase, recorder.block = ("forward" if kind == "F" else "backward"), -1
                if kind == "F":
                    recorder.fwd_live.clear()  # each microbatch runs every region once
                overall[0] = max(overall[0], recorder.peak_bytes)
                recorder.peak_bytes = recorder.live_bytes
                before = sum(x.kind == "F" for x in actions) - sum(x.kind == "B" for x in actions)
                first = len(recorder.rows)
                try:
                    return run(mb, *a, **k)
                finally:
                    took = sum(r["time_s"] for r in recorder.rows[first:])
                    actions.append(Action(kind, mb, index, before, recorder.peak_bytes, took))
                    recorder.peak_bytes = max(overall[0], recorder.peak_bytes)

            return action

        for stage, index in zip(stages, pipe.indices, strict=True):
            stage.forward_one_chunk = recorded("F", index, stage.forward_one_chunk)
            stage.backward_one_chunk = recorded("B", index, stage.backward_one_chunk)
        with contextlib.ExitStack() as stack:
            self._recording(stack, recorder, policies, {})
            stack.enter_context(tc.p2p_works_hold_tensors())
            with self._stepping(recorder):
                if pipe.first:
                    schedule.step(*batch)
                elif pipe.last:
                    schedule.step(target=target, losses=[])
                else:
                    schedule.step()
        peak = recorder.allocator_peak()
        return ScheduleTrace(
            pipe,
            tuple(actions),
            peak,
            recorder.peak_bytes,
            recorder.events() if events else (),
            recorder.unseen_peak,
        )

    def _warm_up(
        self,
        args: Any,
        kwargs: Any,
        autocast: torch.dtype | None,
        policy: str,
        loss: Loss | None = None,
    ) -> None:
        """One unrecorded step: FSDP2 initialises lazily in its first forward (its unsharded
        parameter storages, kept and resized from then on), so the recorded steps are the
        steady ones a training run repeats."""
        with (
            self.world.active() if self.world is not None else contextlib.nullcontext(),
            real_packing_check(kwargs),
            self.mode,
            torch.random.fork_rng(devices=[]),
        ):
            training_step(
                self._stepped(),
                args,
                kwargs,
                autocast=autocast,
                autocast_policy=policy,
                loss=loss,
            )
        for p in self.module.parameters():
            p.grad = None
        self._warm = True

    def _fake(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or self.real:
            return x
        if not tc.is_fake(x):
            return self.mode.from_tensor(x)
        if getattr(x, "fake_mode", self.mode) is not self.mode:
            # A fake input of another model's mode (a shallow copy built on its own): the
            # same shape and dtype here, which is all a fake step reads of it.
            with self.mode:
                return torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return x


class _EachOnItsInput(nn.Module):
    """A rank's stages (an ``nn.ModuleList``) as one step: each on its own microbatch
    input, every output then given a gradient, as the schedule does stage by stage."""

    def __init__(self, stages: nn.Module) -> None:
        super().__init__()
        self.stages = stages

    def forward(self, *xs: Any) -> tuple[Any, ...]:
        return tuple(stage(x) for stage, x in zip(self.stages.children(), xs, strict=True))


def _no_loss(output: Any, target: Any) -> Any:
    raise AssertionError("only the last stage computes the loss")


def _with_copies(
    step: StepTrace, marks: list[CopyMark], offloads: Offloads, profile: DeviceProfile
) -> StepTrace:
    """``step`` with its copies' fixed points, the host store's peak and the copies' exposed
    time on the profile's link."""
    assert profile.link is not None
    index = {path: k for k, path in enumerate(step.blocks)}
    return replace(
        step,
        copies=tuple(marks),
        offloaded=tuple(sorted({index[m.region] for m in marks if m.kind == "out"})),
        host_peak_bytes=offloads.store.peak_bytes,
        copy_exposed_s=exposed_copy_s(marks, [e.time_s for e in step.events], profile.link),
    )
