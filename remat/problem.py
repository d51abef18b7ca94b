"""The contract between the torch side (``remat.executors.graph``) and the solvers
(``remat.solver``).

A :class:`Problem` is the joint forward+backward graph reduced to numbers: one :class:`Value` per
graph node, in the graph's (topological) order, with the storages it references, what it
allocates, its FLOPs and estimated time. It imports nothing from torch, so solvers can be tested
on hand-built graphs and the solver side never depends on a torch release.

Memory is accounted per *storage*, not per value: a view references its base's storage and costs
nothing; a storage is live while any value referencing it is live. That is exactly what a
live-storage meter measures, which is why simulated and measured peaks can agree.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum

import networkx as nx


class Role(str, Enum):
    """Where a value comes from in one training step."""

    PARAM = "param"  # a parameter: exists before the step (external storage)
    BUFFER = "buffer"  # a buffer (e.g. BatchNorm running stats): external
    INPUT = "input"  # a user input: external
    CONSTANT = "constant"  # a tensor constant of the graph: external
    TANGENT = "tangent"  # gradient of a user output, allocated by the caller before backward
    FORWARD = "forward"  # computed by the forward pass; may be saved or recomputed
    BACKWARD = "backward"  # computed by the backward pass, in a fixed order


EXTERNAL_ROLES = frozenset({Role.PARAM, Role.BUFFER, Role.INPUT, Role.CONSTANT})


@dataclass(frozen=True)
class Value:
    """One node of the joint graph."""

    name: str
    role: Role
    op: str
    """Operator name, e.g. ``aten.mm.default`` (``getitem`` for tuple projections)."""
    inputs: tuple[str, ...] = ()
    storages: tuple[str, ...] = ()
    """Storages this value keeps alive (a view shares its base's; a tuple holds all its parts)."""
    allocates: tuple[str, ...] = ()
    """Storages created by this op (empty for views and external values)."""
    flops: int = 0
    time_s: float = 0.0
    random: bool = False
    """Draws random numbers (or projects a random op's tuple): never recomputed."""
    module_path: str = ""
    module_stack: tuple[tuple[str, str], ...] = ()
    """Enclosing modules, outermost first, as (path, class name); backward ops inherit the
    stack of the forward op they differentiate."""
    shape: tuple[int, ...] = ()
    """Shape of the (first) tensor this value holds; empty for scalars and non-tensors."""
    savable: bool = True
    """The executor can keep this value (``"sac"``: it owns new storage and nothing mutates
    it later in its region)."""
    policy: bool = False
    """``"sac"``: a forward op of a region that its policy is called on (in the forward and
    in each replay that reaches it): what :class:`DispatchCosts` counts."""
    scratch_bytes: int = 0
    """Bytes the op's kernel allocates and frees inside itself (internal copies, workspaces),
    measured on the device (:mod:`remat.measure.scratch`): live only while the op runs, seen by
    the allocator, not by a live-storage meter."""
    region: str = ""
    """The checkpoint region a forward value runs in (``"sac"`` problems: the block's path),
    or the region whose backward a backward value belongs to; empty outside regions."""
    pinned: bool = False
    """Computed once and never recomputed, though it draws nothing: the user's loss, which
    runs eagerly around remat's module (its autograd keeps what its backward reads), and the
    module's outputs the loss reads (:mod:`remat.executors.graph.loss`)."""

    @property
    def never_recomputed(self) -> bool:
        """A plan keeps this value wherever the backward reads it (:attr:`random` or
        :attr:`pinned`)."""
        return self.random or self.pinned

    def __post_init__(self) -> None:
        if not set(self.allocates) <= set(self.storages):
            raise ValueError(f"{self.name}: allocated storages must be referenced by the value")


@dataclass(frozen=True)
class Link:
    """The copy link between device and host memory, in bytes per second each way: what an
    offloaded value's copies cost (:mod:`remat.solver.offload`)."""

    d2h: float
    """Device to host, alone on the link."""
    h2d: float
    """Host to device, alone on the link."""
    shared_d2h: float = 0.0
    """Device to host while a host-to-device copy runs too (0: as :attr:`d2h`)."""
    shared_h2d: float = 0.0
    """Host to device while a device-to-host copy runs too (0: as :attr:`h2d`)."""
    synchronous: bool = False
    """Every copy blocks compute for its whole length (a CPU device's host store): no copy
    is hidden."""
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.d2h, self.h2d) <= 0 or min(self.shared_d2h, self.shared_h2d) < 0:
            raise ValueError(f"copy bandwidths must be positive: {self}")

    def rate(self, to_host: bool, both: bool) -> float:
        """Bytes per second of one direction, alone or beside the other."""
        if to_host:
            return (self.shared_d2h or self.d2h) if both else self.d2h
        return (self.shared_h2d or self.h2d) if both else self.h2d


@dataclass(frozen=True)
class DispatchCosts:
    """What PyTorch's selective checkpointing costs by itself, per op of a checkpointed
    region, beyond the ops' own time (``sac`` executor; the ``graph`` executor adds none).

    Why it matters: the policy runs in Python on every op of a checkpointed region, in the
    forward and again in the backward's replay, whether the op is kept or recomputed. On a
    CPU that is 13-20 us an op, several times a small op's own time, so a plan that keeps
    more is not always faster, and a block left without checkpoint saves its whole
    dispatch. Measured by ``experiments/sac_dispatch.py``.
    """

    forward_saved_s: float = 0.0
    """Forward, an op the policy keeps (its output is cached)."""
    forward_recomputed_s: float = 0.0
    """Forward, an op the policy recomputes."""
    replay_hit_s: float = 0.0
    """Replay, a kept op (its cached output returned)."""
    replay_recomputed_s: float = 0.0
    """Replay, a recomputed op, beyond the op's own time."""
    region_s: float = 0.0
    """Per checkpointed region (its frame, the contexts, the replay's start)."""
    overlapped: bool = False
    """Host-side costs that run beside the device's kernels (a GPU): a region's dispatch
    counts only where it exceeds the device time of the region's ops. ``False`` (a CPU):
    host and device are one, every second counts."""
    source: str = field(default="", compare=False)

    def host_s(self, saved: int, recomputed: int, hits: int, replayed: int, regions: int) -> float:
        """Host seconds for ``saved``/``recomputed`` forward policy calls, ``hits``/``replayed``
        replay calls on kept/recomputed ops, over ``regions`` checkpointed region calls."""
        return (
            saved * self.forward_saved_s
            + recomputed * self.forward_recomputed_s
            + hits * self.replay_hit_s
            + replayed * self.replay_recomputed_s
            + regions * self.region_s
        )

    def exposed_s(self, host_s: float, device_s: float) -> float:
        """What ``host_s`` of dispatch adds to a region whose ops take ``device_s``."""
        return max(0.0, host_s - device_s) if self.overlapped else host_s


@dataclass(frozen=True)
class Problem:
    """A joint forward+backward graph as numbers: what the solvers and the simulator see.

    ``values`` are in graph order, which is a topological order; the backward values' order is
    the executor's fixed backward order.
    """

    values: tuple[Value, ...]
    storage_bytes: Mapping[str, int]
    """Bytes of every storage referenced by a non-external value (external ones cost 0)."""
    user_outputs: tuple[str, ...]
    """Forward values returned to the user; held by the caller until the step ends."""
    mutation_outputs: tuple[str, ...] = ()
    """New values of mutated buffers; copied into the buffers, then freed, after the forward."""
    grad_outputs: tuple[str, ...] = ()
    """Gradients returned by the backward (one per trainable input)."""
    grads_held: bool = True
    """Gradients stay on the device to the end of the step (single device, ZeRO 0-1). False:
    each leaves as it is produced (ZeRO 2-3 reduce-scatters it), so it is freed at creation."""
    device_profile: str = "cpu"
    metadata: Mapping[str, str] = field(default_factory=dict)
    executor: str = "graph"
    """Which executor runs the plan, and so when values are materialised and freed (see
    :mod:`remat.solver.executor`): ``"graph"``, remat's own forward/backward graphs over this
    joint graph; ``"sac"``, PyTorch's checkpoint with a selective policy per region, on the
    op stream the regions run eagerly."""
    dispatch: DispatchCosts = DispatchCosts()
    """The ``sac`` executor's own cost per op (:class:`DispatchCosts`); zero: not counted."""
    link: Link | None = None
    """The device's copy link to host memory (:class:`Link`); ``None``: no offload."""

    def __post_init__(self) -> None:
        if self.executor not in ("graph", "sac"):
            raise ValueError(f"unknown executor {self.executor!r}; valid: graph, sac")
        seen: set[str] = set()
        for v in self.values:
            for i in v.inputs:
                if i not in seen:
                    raise ValueError(f"{v.name}: input {i} is not defined before it")
            if v.name in seen:
                raise ValueError(f"duplicate value name {v.name}")
            seen.add(v.name)
            for s in v.allocates:
                if s not in self.storage_bytes:
                    raise ValueError(f"{v.name}: storage {s} has no size")
        for name in (*self.user_outputs, *self.mutation_outputs, *self.grad_outputs):
            if name not in seen:
                raise ValueError(f"output {name} is not a value")

    @functools.cached_property
    def by_name(self) -> Mapping[str, Value]:
        return {v.name: v for v in self.values}

    @functools.cached_property
    def index(self) -> Mapping[str, int]:
        return {v.name: i for i, v in enumerate(self.values)}

    @functools.cached_property
    def users(self) -> Mapping[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {v.name: [] for v in self.values}
        for v in self.values:
            for i in dict.fromkeys(v.inputs):
                out[i].append(v.name)
        return {k: tuple(u) for k, u in out.items()}

    def of_role(self, *roles: Role) -> tuple[Value, ...]:
        return tuple(v for v in self.values if v.role in roles)

    @functools.cached_property
    def forward_names(self) -> frozenset[str]:
        return frozenset(v.name for v in self.values if v.role is Role.FORWARD)

    @functools.cached_property
    def backward_reads(self) -> frozenset[str]:
        """Forward values read directly by some backward op: what eager autograd would save."""
        fwd = self.forward_names
        return frozenset(
            i for v in self.values if v.role is Role.BACKWARD for i in v.inputs if i in fwd
        )

    def storages_bytes(self, storages: Iterable[str]) -> int:
        return sum(self.storage_bytes.get(s, 0) for s in set(storages))

    @functools.cached_property
    def content(self) -> tuple[object, ...]:
        """Every field, hashable: equal exactly when the problems are (a cache key for work
        that depends on the problem alone, so that two captures of one model share it)."""
        return tuple(
            tuple(sorted(x.items())) if isinstance(x, Mapping) else x
            for x in (getattr(self, f.name) for f in fields(self))
        )

    def to_networkx(self) -> nx.DiGraph:
        """The DAG with node attributes (role, op, flops, time_s, random, bytes allocated)."""
        g = nx.DiGraph()
        for v in self.values:
            g.add_node(
                v.name,
                role=v.role.value,
                op=v.op,
                flops=v.flops,
                time_s=v.time_s,
                random=v.random,
                alloc_bytes=self.storages_bytes(v.allocates),
            )
            for i in v.inputs:
                g.add_edge(i, v.name)
        return g
