"""The recorder: the live-storage meter, extended to record every op of a traced step with
where it ran (which block, forward or backward, whether it is a recomputation), which
storages it creates, reads and frees, and its estimated time.

It also holds the module hooks that label the ops, and turns a failure inside the step into a
:class:`~remat.executors.sac.events.TraceError` naming the op, the block and the module.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat import _torch_compat as tc
from remat.executors.sac import regions
from remat.executors.sac.events import OpEvent, TraceError
from remat.executors.sac.regions import Region
from remat.measure.costs import op_cost
from remat.measure.meter import LiveMemoryMeter, output_tensors
from remat.measure.profiles import DeviceProfile
from remat.measure.scratch import Call, call_of, measure_scratch

_DEVICE_QUERY = torch.ops.prim.device.default


@dataclass(frozen=True)
class _OpFacts:
    """What the recorder asks of an op on every call, worked out once per op."""

    name: str
    namespace: str | None
    collective: bool
    """A collective whose outputs a process group's thread holds (:meth:`Recorder._free`)."""
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


class Recorder(LiveMemoryMeter):
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
        (:func:`remat.executors.sac.regions.running_stats_frozen`), so writing them is no reason
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
        peak); that is not counted (``tests/parallel/test_tensor_ranks.py``)."""
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
        # collective: :data:`remat.executors.sac.regions.COLLECTIVES`) would count twice.
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
                "late_bytes": self.released_late,
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
        then dies there, a free the profiler does not record (``tests/executors/sac/
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
    another block's replay starts), an upper bound (:meth:`Recorder.backward_reaches`)."""
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


@contextlib.contextmanager
def label_blocks(module: nn.Module, k: int, path: str, recorder: Recorder) -> Iterator[None]:
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
                t.register_hook(starts_backward(recorder, k))

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def module_stack(paths: Mapping[int, str], stack: list[str]) -> Iterator[None]:
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


def starts_backward(recorder: Recorder, k: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        recorder.backward_reaches(k)

    return hook


def explain_failure(error: Exception, recorder: Recorder, real: bool) -> Exception:
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
