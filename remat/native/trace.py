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
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat import _torch_compat as tc
from remat.graph.autocast import policy_of
from remat.graph.costs import op_cost
from remat.graph.profiles import DeviceProfile
from remat.graph.scratch import Call, call_of, device_of, measure_scratch, where_measured_on
from remat.meter import LiveMemoryMeter, Loss, LossError, output_tensors, training_step
from remat.native import regions
from remat.native.hf import real_packing_check
from remat.native.pipelining import Action, Pipeline, ScheduleTrace
from remat.native.regions import OpKey, Policy, Region

_DEVICE_QUERY = torch.ops.prim.device.default


@dataclass(frozen=True)
class _OpFacts:
    """What the recorder asks of an op on every call, worked out once per op."""

    name: str
    namespace: str | None
    collective: bool
    """A collective whose outputs a process group's thread holds (:meth:`_Recorder._free`)."""
    writes: bool
    """Declares that it writes an argument, or writes one without saying so."""
    sac_ignored: bool
    returns_input: bool
    """Returns its argument's storage when it really runs (:data:`tc.RETURNS_ITS_INPUT`)."""


@functools.cache
def _op_facts(func: Any) -> _OpFacts:
    namespace = getattr(func, "namespace", None)
    return _OpFacts(
        str(func),
        namespace,
        namespace in regions.COLLECTIVES,
        tc.is_mutable_op(func) or func in _UNANNOTATED_WRITES,
        func in SAC_IGNORED_OPS,
        func in tc.RETURNS_ITS_INPUT,
    )


@dataclass(frozen=True)
class OpEvent:
    """One ATen op of the traced step."""

    op: str
    phase: str
    """``forward`` or ``backward`` (the output gradients drawn between them count as
    backward)."""
    block: int
    """Index of the block it ran in (forward, or recomputation, or the block's backward
    ops); -1 outside blocks."""
    recompute: bool
    key: OpKey | None
    """The SAC policy's key of a forward op inside a block (``None`` elsewhere and for the
    ops SAC ignores, e.g. ``detach``)."""
    allocated_bytes: int
    """Bytes at the allocator while the op runs (a peak candidate): live tensor storages
    right after its outputs were allocated, plus its kernel's scratch and what no dispatch
    sees (:attr:`_Recorder.unseen_bytes`), where those are measured
    (:func:`remat.graph.scratch.where_measured`)."""
    new_bytes: int
    """Bytes of storages the op created."""
    flops: int
    time_s: float
    savable: bool
    """A forward op whose output SAC can keep: new storages only (not a view, which would pin
    its base), not a mutating op, and not mutated in place later in the region."""
    writes_outside: bool = False
    """A forward op of a block that writes in place to a tensor the block did not create
    (BatchNorm's running statistics): every policy keeps it, so the recomputation returns
    its cached outputs instead of updating the state a second time."""
    reads: tuple[tuple[int, str], ...] = ()
    """``(event, storage)`` for each storage (made during the step) this op read: the last
    event whose output held it (its creator, or a later view of it or in-place write)."""
    holds: tuple[str, ...] = ()
    """Storages its outputs reference (made during the step), as step-unique names."""
    creates: tuple[str, ...] = ()
    """Storages it created (a subset of ``holds``)."""
    tensor_bytes: int = 0
    """Live tensor storages right after its outputs were allocated (what a live-storage
    meter sees)."""
    scratch_bytes: int = 0
    """What its kernel allocated and freed inside itself (:mod:`remat.graph.scratch`)."""
    moved_bytes: int = 0
    """Bytes it reads and writes (0 for a view, which launches no kernel): with ``flops``
    and ``dtype``, what the roofline times (:meth:`DeviceProfile.op_time`)."""
    dtype: str = "float32"


@dataclass(frozen=True)
class StepTrace:
    events: tuple[OpEvent, ...]
    peak_bytes: int
    """At the allocator (the events' ``allocated_bytes``, and the moments something no
    dispatch sees was allocated between them)."""
    blocks: tuple[str, ...]
    forward_live: tuple[tuple[int, int], ...]
    """Per block, live bytes when its forward starts and when it has returned."""
    storage_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes of every storage named in the events' ``creates``."""
    outputs: tuple[str, ...] = ()
    """Storages of the model's outputs (held by the caller until the step ends)."""
    live_at_end: frozenset[str] = frozenset()
    """Storages still live when the backward has returned (the parameters' gradients)."""
    deaths: Mapping[str, int] = field(default_factory=dict)
    """Storage -> the first event after it was freed: where the program (its variables,
    autograd's saved tensors) let go of it, which the dataflow alone does not say."""
    tensor_peak_bytes: int = 0
    """Live tensor storages alone (the live-storage meter's peak)."""
    scratch: str = ""
    """Where kernel scratch and RNG states were measured, or why they count 0."""
    unseen_peak_bytes: int = 0
    """The allocator's bytes at the moments something no dispatch sees was allocated
    between ops (RNG states, FSDP2's resized parameters): a peak candidate besides the
    events."""
    schedule: ScheduleTrace | None = None
    """For a pipeline stage, its whole ``schedule.step()`` under the same policies, whose
    peaks ``peak_bytes`` and ``tensor_peak_bytes`` then are; the events stay one
    microbatch's (what the policies and the costs are read from)."""
    dispatch_s: tuple[float, ...] = ()
    """Per block, what selective checkpointing's own dispatch adds to the step (the
    profile's :class:`remat.problem.DispatchCosts` times the policy calls the step made; 0
    for a block run without checkpoint). Empty: not counted."""

    @property
    def peak_event(self) -> int:
        return max(range(len(self.events)), key=lambda k: self.events[k].allocated_bytes)

    def forward_stream(self, block: int) -> tuple[OpEvent, ...]:
        """The keyed forward ops of ``block``: what its policy sees, in order."""
        return tuple(
            e
            for e in self.events
            if e.block == block and e.phase == "forward" and e.key is not None
        )

    def renumbered(self, order: Sequence[int]) -> StepTrace:
        """This trace with its region ``order[k]`` as region ``k`` (what
        :meth:`FakeModel.in_call_order` does to the copy's regions): with every region eager
        the step is the same whatever their numbers, so no second trace is needed."""
        new = {old: k for k, old in enumerate(order)}

        def renumber(events: Sequence[OpEvent]) -> tuple[OpEvent, ...]:
            return tuple(e if e.block < 0 else replace(e, block=new[e.block]) for e in events)

        schedule = self.schedule
        if schedule is not None and schedule.events:
            schedule = replace(schedule, events=renumber(schedule.events))
        return replace(
            self,
            events=renumber(self.events),
            blocks=tuple(self.blocks[b] for b in order),
            forward_live=tuple(self.forward_live[b] for b in order),
            schedule=schedule,
            dispatch_s=tuple(self.dispatch_s[b] for b in order) if self.dispatch_s else (),
        )

    @property
    def recompute_flops(self) -> int:
        return sum(e.flops for e in self.events if e.recompute)

    @property
    def recompute_time_s(self) -> float:
        return sum(e.time_s for e in self.events if e.recompute)

    @property
    def dispatch_time_s(self) -> float:
        return sum(self.dispatch_s)

    @property
    def added_time_s(self) -> float:
        """What the plan adds to the step: recomputation and checkpointing's dispatch (what
        the planner minimises)."""
        return self.recompute_time_s + self.dispatch_time_s


class TraceError(RuntimeError):
    """The training step failed while remat traced it (on FakeTensors, an op whose output
    shape depends on values, say); the message names the op, the block and the module."""


class _Recorder(LiveMemoryMeter):
    """The live meter, recording each op with its place in the step."""

    def __init__(
        self,
        profile: DeviceProfile,
        blocks: Sequence[str],
        running_stats: frozenset[int],
        allocator: bool = False,
        host: bool = False,
    ) -> None:
        super().__init__()
        self.host = allocator and host
        """The step's device is the host: RNG states and wrapped numbers, which live in host
        memory whatever the device, count there."""
        self.calls: list[Call | None] | None = [] if allocator else None
        """Each row's op call (layouts only), to measure its kernel's scratch after the
        step; None when scratch is not measured."""
        self.unseen_bytes = 0
        """Live bytes the allocator holds that no dispatch sees: the RNG states checkpoint
        frames save, FSDP2's unsharded parameters resized in place, and (an upper bound) the
        numbers forward ops take as tensors (counted only with ``allocator``)."""
        self.unseen_peak = 0
        """Allocator bytes at the moments something unseen was allocated between ops."""
        self.forward_numbers: Counter[int] = Counter()
        """Per block, the bytes of the numbers its forward saved; released when the backward
        reaches an earlier block (its own backward nodes have run by then)."""
        self.replay_numbers = (-1, 0)
        """The block being replayed and the bytes of the numbers its replay saved (see
        :func:`_wrapped_number_bytes`), released when another block's replay starts."""
        self.running_stats = running_stats
        """Storage keys of BatchNorm running statistics: a recomputation leaves them alone
        (:func:`remat.native.regions.running_stats_frozen`), so writing them is no reason
        to keep an op."""
        self.profile = profile
        self.index = {p: k for k, p in enumerate(blocks)}
        self.phase = "forward"
        self.block = -1
        self.recompute = False
        self.counts: Counter[Any] = Counter()
        self.rows: list[dict[str, Any]] = []
        self.modules: list[str] = []
        """Paths of the modules whose forward is running, outermost first."""
        self.creator: dict[int, int] = {}
        """Storage key -> the row that created it, for the storages the running block's
        forward created (keys are reused once a storage dies: reset per block)."""
        self.fwd_live: dict[int, tuple[int, int]] = {}
        """Block -> live bytes when its forward starts and when it returns."""
        self.names: dict[int, str] = {}
        """Storage key -> step-unique name, for the live storages made during the step."""
        self.latest: dict[str, int] = {}
        """Storage name -> the last row whose output holds it (it, a view, an in-place op)."""
        self.storage_bytes: dict[str, int] = {}
        self.outputs: tuple[str, ...] = ()

        self.deaths: dict[str, int] = {}
        """Storage name -> the row that ran next after it was freed."""
        self.communicated: set[str] = set()
        """Names of the storages a functional collective made (tensor parallelism)."""
        self.released_late = 0
        """Bytes of the last such storage freed, still counted live (see :meth:`_free`)."""
        self.policy_calls: dict[int, list[int]] = {}
        """Block -> what SAC's dispatch did in it: forward policy calls on kept and on
        recomputed ops, replayed ops returned from the cache (filled in at the end) and
        re-run, and the region's forward calls (:meth:`dispatch_s`)."""
        self.cache_hits: list[tuple[int, Callable[[], int]]] = []
        """Per checkpointed region call not replayed yet, its block and a count of its cache
        hits so far (read when the block's replay returns)."""
        self.contexts_made: Callable[[], int] | None = None

    def _free(self, key: int, nbytes: int) -> None:
        """A storage died. The last one a functional collective made stays counted: the
        process group's worker thread holds its own reference until it has finished with
        the collective's work, which can be well after Python lets go, and the storage lives
        until then (the live-storage meter of a real step sees it, as the allocator does).
        Measured under gloo (TP on 2 ranks, TP x FSDP2 on 4): in about half the runs one
        all-reduced activation was still allocated at the step's peak, several ops after its
        last use. So one is counted: the last freed, until the next is. With the host's
        cores oversubscribed the thread can lag further (one run held two at the allocator's
        peak); that is not counted (``tests/native/test_tensor_parallel.py``)."""
        if self._tracked.get(key) == nbytes and key in self.names:
            name = self.names.pop(key)
            self.deaths[name] = len(self.rows)
            if name in self.communicated:
                super()._free(key, nbytes)
                self.live_bytes += nbytes - self.released_late
                self.released_late = nbytes
                return
        super()._free(key, nbytes)

    def storage_names(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        return self._names_of([tc.storage_key(t) for t in tensors])

    def _names_of(self, keys: Sequence[int]) -> list[str]:
        return list(dict.fromkeys(self.names[k] for k in keys if k in self.names))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _DEVICE_QUERY:
            # A FakeTensor's device, asked by the autograd engine after nearly every op (60%
            # of a fake step's dispatches): no bytes, no storage, ignored by SAC's policies.
            return func(*args, **kwargs)
        op = _op_facts(func)
        before = self.live_bytes
        # The real op returns its argument's storage; the fake kernel a copy, which kept (a
        # collective: :data:`remat.native.regions.COLLECTIVES`) would count twice.
        same = op.returns_input and tc.is_fake(args[0])
        out = args[0] if same else func(*args, **kwargs)
        leaves = tc.tensor_leaves((args, kwargs)), tc.tensor_leaves(out)
        in_tensors, outs = tc.storage_tensors(leaves[0]), tc.storage_tensors(leaves[1])
        in_keys = [tc.storage_key(t) for t in in_tensors]
        out_keys = [tc.storage_key(t) for t in outs]
        ins = set(in_keys)
        self._counted(ins, outs, out_keys)
        new_bytes = self.live_bytes - before
        creates: list[str] = []
        for k in dict.fromkeys(out_keys):
            if k in self._tracked and k not in self.names:
                name = self.names[k] = f"s{len(self.rows)}.{len(creates)}"
                self.storage_bytes[name] = self._tracked[k]
                creates.append(name)
        if op.collective:
            self.communicated.update(creates)
        reads = tuple((self.latest[n], n) for n in self._names_of(in_keys))
        holds = self._names_of(out_keys)
        self.latest.update((n, len(self.rows)) for n in holds)
        written = _written_storages(func, args, kwargs) if op.writes else set()
        mutable = bool(written)
        in_block_forward = self.block >= 0 and self.phase == "forward" and not self.recompute
        key = None
        if in_block_forward and not op.sac_ignored:
            key = (op.name, self.counts[func])
            self.counts[func] += 1
        elif self.recompute and not op.sac_ignored:
            self._calls()[3] += 1  # re-run by the replay
        outside = False
        if in_block_forward and mutable:
            outside = bool(written - self.creator.keys() - self.running_stats)
            for k in written & self.creator.keys():
                row = self.rows[self.creator[k]]
                if not row["writes_outside"]:
                    row["savable"] = False  # SAC would return the mutated tensor
        view = bool(outs) and all(k in ins for k in out_keys)
        if in_block_forward:
            self.creator.update((k, len(self.rows)) for k in out_keys if k not in ins)
        costed = (args, kwargs, out)
        if tc.any_dtensor(leaves[0]) or tc.any_dtensor(leaves[1]):
            costed = tc.local_tensors(costed)  # tensor parallel: FLOPs of this rank's shards
        flops, moved, dtype = op_cost(func, *costed, (in_tensors, outs))
        time_s = self.profile.op_time(flops, moved, dtype)
        scratch = 0
        if self.host and op.namespace == "c10d":
            scratch = self._gloo_scratch(func, args)
        if self.host and (self.phase == "forward" or self.recompute):
            wrapped = _wrapped_number_bytes(func, args, kwargs)
            self.unseen_bytes += wrapped
            if self.recompute:
                self.replay_numbers = (self.block, self.replay_numbers[1] + wrapped)
            elif self.block >= 0:
                self.forward_numbers[self.block] += wrapped
        self.rows.append(
            {
                "op": op.name,
                "phase": self.phase,
                "block": self.block,
                "recompute": self.recompute,
                "key": key,
                "new_bytes": new_bytes,
                "flops": flops,
                "time_s": 0.0 if view else time_s,
                "moved_bytes": 0 if view else moved,
                "dtype": dtype,
                "savable": key is not None and bool(outs) and (outside or not (view or mutable)),
                "writes_outside": outside,
                "reads": reads,
                "holds": tuple(holds),
                "creates": tuple(creates),
                "tensor_bytes": self.live_bytes,
                "allocated_bytes": self.live_bytes + self.unseen_bytes + scratch,
            }
        )
        if self.calls is not None:
            self.calls.append(call_of(func, args, kwargs))
        return out

    def _gloo_scratch(self, func: Any, args: tuple[Any, ...]) -> int:
        """What gloo, the CPU's process group, allocates inside FSDP2's collectives, which
        no dispatch sees, returned as the op's scratch (measured at the allocator, 2.13, 2
        ranks, with each event's thread and address): an all-gather gathers into a buffer
        of its output's size on gloo's worker thread and copies out; a reduce-scatter works
        on a copy of its input, made on the calling thread and held by the collective's
        ``Work``. FSDP2 waits on both before the collective returns (``async_op=False``),
        and the buffer dies with the wait (the copy when the ``Work`` does, as
        ``reduce_scatter_single`` returns). Counting the copy while the input lived, as
        this did before, matched runs where gloo's thread dropped the work last: the copy
        then dies there, a free the profiler does not record (``tests/native/
        gloo_settle.py``), and the meter counted it live until its address was reused."""
        if func is tc.ALLGATHER_BASE:
            return int(args[0].untyped_storage().nbytes())
        if func is tc.REDUCE_SCATTER_BASE:
            return int(args[1].untyped_storage().nbytes())
        return 0

    def made_outside(self, tensor: torch.Tensor) -> None:
        """``tensor`` was made outside dispatch (a checkpoint frame's saved RNG state, live
        until the frame dies with its last saved tensor; BatchNorm's scratch statistics of a
        re-run): counted at the allocator while it lives."""
        if self.calls is None:
            return
        storage = tensor.untyped_storage()
        self._unseen(storage.nbytes())
        weakref.finalize(storage, self._unseen, -storage.nbytes())

    def _unseen(self, delta: int) -> None:
        """``delta`` bytes no dispatch sees were allocated (or, negative, freed) between ops."""
        self.unseen_bytes += delta
        self.unseen_peak = max(self.unseen_peak, self.live_bytes + self.unseen_bytes)

    def backward_reaches(self, block: int) -> None:
        """The gradient of ``block``'s output is complete: every later block's backward nodes
        that lead to it have run and released what they saved."""
        self.block = block
        for later in [b for b in self.forward_numbers if b > block]:
            self.unseen_bytes -= self.forward_numbers.pop(later)

    def resized(self, delta: int) -> None:
        """FSDP2 resized an unsharded parameter's storage in place by ``delta`` bytes."""
        if self.calls is not None:
            self._unseen(delta)

    def allocator_peak(self) -> int:
        """Add each op's measured scratch to its row; the step's peak at the allocator."""
        if self.calls is not None:
            known = [(row, c) for row, c in zip(self.rows, self.calls, strict=True) if c]
            for (row, _), b in zip(known, measure_scratch([c for _, c in known]), strict=True):
                row["scratch_bytes"] = b
                row["allocated_bytes"] += b
        return max([self.unseen_peak, self.peak_bytes, *(r["allocated_bytes"] for r in self.rows)])

    @contextlib.contextmanager
    def region(self, region: Region, recompute: bool) -> Iterator[None]:
        saved = (self.block, self.recompute)
        self.block, self.recompute = self.index[region.path], recompute
        if not recompute:
            self.counts.clear()
            self.creator.clear()
            self._calls()[4] += 1
            if self.contexts_made is not None:
                self.cache_hits.append((self.block, self.contexts_made))
                self.contexts_made = None
        elif self.replay_numbers[0] != self.block:
            # Regions' backwards run one after another: the last one's replayed graph is gone.
            self.unseen_bytes -= self.replay_numbers[1]
            self.replay_numbers = (self.block, 0)
        try:
            yield
        finally:
            if recompute:
                self._replayed(self.block)
            self.block, self.recompute = saved

    def _replayed(self, block: int) -> None:
        """``block``'s replay returned: count the cache hits of its region calls."""
        waiting = []
        for b, hits in self.cache_hits:
            n = hits() if b == block else 0
            if n:
                self.policy_calls[b][2] += n
            else:
                waiting.append((b, hits))
        self.cache_hits = waiting

    def events(self) -> tuple[OpEvent, ...]:
        return tuple(OpEvent(**row) for row in self.rows)

    def _calls(self) -> list[int]:
        return self.policy_calls.setdefault(self.block, [0, 0, 0, 0, 0])

    def policy_called(self, keep: bool) -> None:
        self._calls()[not keep] += 1

    def sac_contexts(self, contexts: tuple[Any, Any]) -> None:
        """A region's SAC contexts, made just before its forward starts (:meth:`region`)."""
        self.contexts_made = tc.sac_cache_hits(contexts)

    def dispatch_s(self, events: Sequence[OpEvent]) -> tuple[float, ...]:
        """Per block, the seconds its policy calls add (:class:`remat.problem.DispatchCosts`),
        beside the device time of its own ops where the profile's dispatch overlaps it."""
        costs = self.profile.sac_dispatch
        device = [0.0] * len(self.index)
        for e in events:
            if e.block >= 0:
                device[e.block] += e.time_s
        return tuple(
            costs.exposed_s(costs.host_s(*self.policy_calls[b]), device[b])
            if b in self.policy_calls
            else 0.0
            for b in range(len(self.index))
        )


_UNANNOTATED_WRITES: dict[Any, tuple[int, ...]] = {
    torch.ops.aten.native_batch_norm.default: (3, 4),
}
"""Ops whose schema does not declare the arguments they write: ``native_batch_norm`` (what
eager BatchNorm runs on CPU) updates ``running_mean`` and ``running_var`` in training."""


_SAVES_OTHER = frozenset(
    str(op)
    for op in (
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.div.Tensor,
        torch.ops.aten.div.Tensor_mode,
        torch.ops.aten.pow.Tensor_Tensor,
        torch.ops.aten.where.self,
        torch.ops.aten.maximum.default,
        torch.ops.aten.minimum.default,
        torch.ops.aten.atan2.default,
        torch.ops.aten.xlogy.Tensor,
        torch.ops.aten.lerp.Tensor,
        torch.ops.aten.hypot.default,
        torch.ops.aten.clamp.Tensor,
        torch.ops.aten.copysign.Tensor,
    )
)
"""Ops whose derivative formula saves a tensor argument that may be a wrapped number."""


def _wrapped_number_bytes(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Bytes of the 0-dim tensors Python numbers become where ``func`` takes a tensor and
    autograd saves it (``scores / math.sqrt(d)`` calls ``div.Tensor`` with a float, and
    ``DivBackward0`` keeps ``other``). Why: the wrapper is made before dispatch and handed to
    modes as the number again, so no dispatch meter sees it, and a saved one bypasses saved-
    tensor hooks (a checkpoint replay makes it again). Wrappers of other ops die with the op
    (their bytes are in its measured scratch). When a saved one is freed is not visible here:
    it is counted as held until the backward reaches an earlier block (a replay's: until
    another block's replay starts), an upper bound (:meth:`_Recorder.backward_reaches`)."""
    if str(func) not in _SAVES_OTHER or not any(t.requires_grad for t in output_tensors(args)):
        return 0  # saved only for the gradient of a tensor that requires one
    total = 0
    for k, arg in enumerate(tc.op_schema(func).arguments):
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        if isinstance(value, bool | int | float | complex) and isinstance(
            arg.type, torch.TensorType
        ):
            total += 1 if isinstance(value, bool) else 16 if isinstance(value, complex) else 8
    return total


def _written_storages(func: Any, args: Any, kwargs: Any) -> set[int]:
    """Storage keys of the arguments ``func`` writes in place."""
    out: set[int] = set()
    schema = tc.op_schema(func)
    for k, arg in enumerate(schema.arguments):
        declared = arg.alias_info is not None and arg.alias_info.is_write
        if not declared and k not in _UNANNOTATED_WRITES.get(func, ()):
            continue
        value = args[k] if k < len(args) else kwargs.get(arg.name)
        out.update(tc.storage_key(t) for t in tc.storage_tensors(value))
    return out


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
            "remat.native.parallel.tensor_parallel(model, tp_size, "
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
    the regions (regions finer than the blocks, :func:`remat.native.regions.split_blocks`,
    run inside the blocks FSDP2 shards). ``pipeline``: the model is that stage of a pipeline
    (:mod:`remat.native.pipelining`); each trace also steps it through the schedule, as its
    rank on a fake process group of ``n_stages`` ranks, and its peak is that step's.
    ``target``: one microbatch's, for the last stage's loss. ``loss``: the user's loss
    (:class:`remat.meter.Loss`, its target on the copy's tensors), part of every traced step
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
        (:func:`remat.native.parallel.tensor_parallel`); None for a real process group, or
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
            if real:
                raise TraceError(
                    "a pipeline stage is planned on FakeTensors, and this model's step "
                    "cannot run on them"
                )
            pipeline.check_modules(model)
            dp = fsdp_world or 1
            if self.world is None and dp == 1:
                self.world = tc.FakeWorld(pipeline.ranks, rank=pipeline.stage)
            else:  # the pipeline and the data-parallel ranks on one mesh
                if self.world is None and tc.tensor_parallel_mesh(model) is not None:
                    raise TraceError(
                        "a tensor-parallel pipeline stage with FSDP2 inside it is planned "
                        "ahead of the job, not in it yet: plan it on FakeTensors with "
                        "remat.native.parallel.tensor_parallel(stage, tp_size, dp_size=..., "
                        "pp_size=..., pp_rank=...) (remat plan --pp-size --tp-size "
                        "--zero-stage 3), save the plan and apply the file in the job"
                    )
                if self.world is None:
                    dims = [("pp", pipeline.ranks), ("dp", dp)]
                    self.world = tc.fake_mesh_world(dims, pipeline.stage * dp)
                self._pp_group = _pipeline_group(self.world, pipeline)
            with self.mode:
                self.target = tc.tree_map(self._fake, target)
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

    def _shard(
        self,
        units: list[nn.Module],
        dp: int,
        param_dtype: torch.dtype | None,
        roots: list[nn.Module] | None = None,
    ) -> None:
        """FSDP2 on the copy over ``dp`` ranks: of a fake world of its own; of the 2-D fake
        mesh a tensor-parallel plan was made on (:func:`remat.native.parallel.tensor_parallel`
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
                f"parallelize it with remat.native.parallel.tensor_parallel(model, tp_size, "
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
    ) -> StepTrace:
        """Run one training step (as :func:`remat.meter.training_step`) with ``policies[k]``
        on block ``k`` and record it; on a pipeline stage, then one ``schedule.step()``,
        which sets the peak, unless ``schedule`` is false: one microbatch's step alone then,
        whose per-block quantities are the same at a tenth of the cost (8 microbatches).
        ``target``: the last stage's microbatch target at these inputs' shape, or the loss's
        (default: the one given at construction). ``schedule_events``: keep the schedule step's events
        (:attr:`ScheduleTrace.events`, for fitting its peak over shapes; large at scale)."""
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
        with contextlib.ExitStack() as stack:
            self._recording(stack, recorder, policies, kwargs)

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
            events,
            peak,
            self.blocks,
            live,
            recorder.storage_bytes,
            recorder.outputs,
            live_at_end,
            dict(recorder.deaths),
            tensor_peak_bytes=recorder.peak_bytes,
            scratch=where or "not measured (FakeTensors, or another device): counts 0",
            unseen_peak_bytes=recorder.unseen_peak,
            dispatch_s=recorder.dispatch_s(events),
        )
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
    def _stepping(self, recorder: _Recorder) -> Iterator[None]:
        """Around a recorded step: a failure says where in the step it happened
        (:func:`_explain`), and the copy's gradients are dropped after it (shared with the
        user's model when that is fake)."""
        try:
            yield
        except (TraceError, LossError):
            raise
        except Exception as e:
            raise _explain(e, recorder, self.real) from e
        finally:
            for p in self.module.parameters():
                p.grad = None

    def _new_recorder(self, profile: DeviceProfile) -> _Recorder:
        where = where_measured_on(self.source_device, profile.name)
        host = self.source_device is not None and self.source_device.type == "cpu"
        return _Recorder(
            profile, self.blocks, self._running_stats, allocator=bool(where), host=host
        )

    def _recording(
        self,
        stack: contextlib.ExitStack,
        recorder: _Recorder,
        policies: Sequence[Policy],
        kwargs: Mapping[str, Any],
    ) -> None:
        """Enter, on ``stack``, what a recorded step runs under: ``policies[k]`` on block
        ``k``, the labels and observers that tell the recorder where each op runs, the fake
        world, the FakeTensor mode and the recorder, and a forked random stream."""
        for k, (m, policy) in enumerate(zip(self._blocks, policies, strict=True)):
            regions.wrap(m, self.blocks[k], policy)
            stack.callback(regions.unwrap, m)
            stack.enter_context(_labels(m, k, self.blocks[k], recorder))
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
        stack.enter_context(_module_stack(self._paths, recorder.modules))
        if not self.real:
            stack.enter_context(real_packing_check(kwargs))
        stack.enter_context(self.mode)
        stack.enter_context(recorder)
        stack.enter_context(torch.random.fork_rng(devices=[]))
        if recorder.host:  # CPU RNG states are host memory: device memory only on the CPU
            # After fork_rng, whose own saved state the real step does not have.
            stack.enter_context(tc.rng_states_saved(recorder.made_outside))

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
        docstring of :mod:`remat.native.pipelining`): a fresh ``PipelineStage`` each time,
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


@contextlib.contextmanager
def _labels(module: nn.Module, k: int, path: str, recorder: _Recorder) -> Iterator[None]:
    """Forward ops of block ``k`` are labelled by its forward hooks (the region observer also
    labels them, and its recomputations); its backward starts when the gradient of its output
    arrives (a hook on the output tensors)."""

    def pre(mod: nn.Module, args: Any) -> None:
        if recorder.phase == "forward":
            if k in recorder.fwd_live:
                # Its policy's (op, k) keys restart at every call: one plan cannot say
                # which call keeps what.
                raise TraceError(
                    f"region {path} runs more than once in the forward (a "
                    "module called twice, or shared): a region must run once per step"
                )
            recorder.block = k
            recorder.counts.clear()
            recorder.creator.clear()
            recorder.fwd_live[k] = (recorder.live_bytes, recorder.live_bytes)

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        if recorder.phase != "forward":
            return
        recorder.block = -1
        recorder.fwd_live[k] = (recorder.fwd_live[k][0], recorder.live_bytes)
        for t in output_tensors(out):
            if t.requires_grad:
                t.register_hook(_starts_backward(recorder, k))

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _module_stack(paths: Mapping[int, str], stack: list[str]) -> Iterator[None]:
    """Keep ``stack`` the paths of the running module forwards (to name where a step
    failed: after an exception, the innermost module stays on top)."""

    def pre(mod: nn.Module, args: Any) -> None:
        stack.append(paths.get(id(mod), type(mod).__name__))

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    handles = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _starts_backward(recorder: _Recorder, k: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        recorder.backward_reaches(k)

    return hook


def _explain(error: Exception, recorder: _Recorder, real: bool) -> Exception:
    ops = [r["op"] for r in recorder.rows if not r["op"].startswith("prim.")]
    last = f"after {ops[-1]}" if ops else "at the first op"
    where = next(
        (f"block {p}" for p, k in recorder.index.items() if k == recorder.block),
        "outside the blocks",
    )
    if recorder.phase == "forward" and recorder.modules:
        where += f", module {recorder.modules[-1]}"
    on = "a copy of the model" if real else "FakeTensors (no memory)"
    hint = ""
    if isinstance(error, tc.DATA_DEPENDENT_ERRORS):
        hint = (
            ": its shapes depend on tensor values (nonzero, item, boolean-mask indexing), "
            "which FakeTensors do not have"
        )
    return TraceError(
        f"the training step failed while remat traced it on {on}, in the {recorder.phase}, "
        f"{where}, {last}{hint}: {type(error).__name__}: {error}"
    )
