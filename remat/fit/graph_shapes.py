"""A model's step at every batch and sequence length, from a few concrete captures.

Capturing with symbolic shapes would thread SymInts through every stage; instead the step is
captured concretely at the shapes :mod:`remat.solver.formula` needs (two batches times three
lengths), every storage's bytes, every op's FLOPs, bytes moved and output dimensions are fitted
exactly as polynomials in ``b`` and ``s``, and the fit is checked at a shape it was not built
from. The graph must be the same at every shape of a range (same ops, same storages): it is
for ``b >= 2``, while ``b = 1`` takes other decompositions (a batch of one folds into matmuls
differently), so it is a range of its own. A model whose graph changes with the length (a
size-dependent branch) raises :class:`remat.solver.formula.FitError` naming the first op that
differs.

Inputs at another shape are the example inputs tiled and cropped along their batch and
sequence dimensions, so token ids, masks and labels stay valid.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from remat import _torch_compat as tc
from remat.measure.costs import node_bytes_moved, node_dtype, view_like
from remat.measure.profiles import get_profile
from remat.problem import Problem, Role
from remat.solver.formula import FitError, Fitter, Poly

__all__ = [
    "DynamicProblem",
    "ShapeRange",
    "Dims",
    "capture_dynamic",
    "inputs_at",
    "same_graph",
    "sequence_dims",
    "shape_at",
]

Inputs = tuple[tuple[Any, ...], Mapping[str, Any]]
Analyzer = Callable[[tuple[Any, ...], Mapping[str, Any]], Any]
"""``(args, kwargs) -> Analysis`` (:func:`remat.executors.graph.analyze.analyze` with the model
bound)."""


@dataclass(frozen=True)
class Dims:
    """Which dimension of the inputs is the batch and which the sequence (``None``: the
    model has no sequence, e.g. images), and the example's sizes of both."""

    batch: int
    seq: int | None
    batch_dim: int = 0
    seq_dim: int = 1

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: Mapping[str, Any], seq: bool | None = None) -> Dims:
        """Read from the first tensor input: dim 0 is the batch; dim 1 the sequence when it
        has an integer dtype (token ids) or ``seq=True``."""
        first = next(
            (t for t in tc.tree_leaves((args, dict(kwargs))) if isinstance(t, torch.Tensor)),
            None,
        )
        if first is None or first.dim() == 0:
            raise ValueError("the example inputs hold no tensor with a batch dimension")
        has_seq = (not first.is_floating_point()) if seq is None else seq
        if has_seq and first.dim() < 2:
            raise ValueError("the first input has no sequence dimension (dim 1)")
        return Dims(int(first.shape[0]), int(first.shape[1]) if has_seq else None)


def sequence_dims(args: tuple[Any, ...], kwargs: Mapping[str, Any], max_seq: int) -> Dims:
    """:meth:`Dims.of` for inputs whose length varies up to ``max_seq``: refused without a
    sequence dimension, or with an example longer than ``max_seq``."""
    dims = Dims.of(args, kwargs)
    if dims.seq is None:
        raise ValueError(
            "max_seq needs a sequence dimension: dim 1 of the first input, with an integer "
            "dtype (token ids)"
        )
    if dims.seq > max_seq:
        raise ValueError(
            f"the example's length {dims.seq} is past max_seq={max_seq}: give an example at "
            "or below the longest length"
        )
    return dims


def _resize(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    if dim >= t.dim() or t.shape[dim] == n:
        return t
    reps = [1] * t.dim()
    reps[dim] = -(-n // t.shape[dim])
    return t.repeat(*reps).narrow(dim, 0, n).contiguous()


def shape_at(dims: Dims, shape: Sequence[int], b: int, s: int | None) -> tuple[int, ...]:
    """An example tensor's shape at batch ``b`` and length ``s``: its batch (sequence)
    dimension resized where it has the example's size."""
    out = list(shape)
    if out and out[dims.batch_dim] == dims.batch:
        out[dims.batch_dim] = b
    seq = dims.seq is not None and s is not None and len(out) > dims.seq_dim
    if seq and s is not None and out[dims.seq_dim] == dims.seq:
        out[dims.seq_dim] = s
    return tuple(out)


def inputs_at(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], dims: Dims, b: int, s: int | None
) -> Inputs:
    """The example inputs tiled and cropped to batch ``b`` and length ``s`` (the shapes of
    :func:`shape_at`), so token ids, masks and labels stay valid. One tensor passed twice
    (``model(ids, labels=ids)``) stays one tensor: the captured graph then has the same
    inputs at every shape, as it has at the example's."""
    done: dict[int, torch.Tensor] = {}

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if id(t) in done:
            return done[id(t)]
        target = shape_at(dims, t.shape, b, s)
        out = t
        for d, n in enumerate(target):
            out = _resize(out, d, n)
        done[id(t)] = out
        return out

    new_args, new_kwargs = tc.tree_map(one, (args, dict(kwargs)))
    return tuple(new_args), new_kwargs


@dataclass(frozen=True)
class ShapeRange:
    """One graph valid over ``b_min <= b <= b_max`` (and ``s_min <= s <= s_max``), with every
    size as a polynomial."""

    b_min: int
    b_max: int | None
    s_min: int | None
    s_max: int | None
    template: Problem
    """The problem captured at one of the fit's shapes: structure, names, roles."""
    storage: Mapping[str, Poly]
    scratch: Mapping[str, Poly]
    flops: Mapping[str, Poly]
    moved: Mapping[str, Poly]
    """Bytes read and written by each timed op (the roofline's memory term)."""
    shapes: Mapping[str, tuple[Poly, ...]]
    dtypes: Mapping[str, str]
    fitted_at: tuple[tuple[int, int], ...]
    checked_at: tuple[tuple[int, int], ...]

    def contains(self, b: int, s: int | None) -> bool:
        return within(self, b, s)

    def times_at(self, b: int, s: int | None) -> dict[str, float]:
        """Each timed op's roofline seconds at ``(b, s)`` (the others take none)."""
        s_ = 0 if s is None else s
        profile = get_profile(self.template.device_profile)
        return {
            n: profile.op_time(self.flops[n].at(b, s_), m.at(b, s_), self.dtypes[n])
            for n, m in self.moved.items()
        }

    def problem_at(self, b: int, s: int | None) -> Problem:
        """The concrete problem at ``(b, s)``: sizes evaluated, times from the roofline."""
        s_ = 0 if s is None else s
        profile = get_profile(self.template.device_profile)
        values = []
        for v in self.template.values:
            flops = self.flops[v.name].at(b, s_)
            time_s = (
                profile.op_time(flops, self.moved[v.name].at(b, s_), self.dtypes[v.name])
                if v.name in self.moved
                else 0.0
            )
            values.append(
                dataclasses.replace(
                    v,
                    flops=flops,
                    time_s=time_s,
                    shape=tuple(d.at(b, s_) for d in self.shapes[v.name]),
                    scratch_bytes=self.scratch[v.name].at(b, s_) if v.name in self.scratch else 0,
                )
            )
        return dataclasses.replace(
            self.template,
            values=tuple(values),
            storage_bytes={k: p.at(b, s_) for k, p in self.storage.items()},
        )


@dataclass(frozen=True)
class DynamicProblem:
    """A step over every batch (and length) its ranges cover."""

    ranges: tuple[ShapeRange, ...]
    dims: Dims

    def range_of(self, b: int, s: int | None) -> ShapeRange:
        for r in self.ranges:
            if r.contains(b, s):
                return r
        covered = ", ".join(range_text(r) for r in self.ranges)
        raise ValueError(f"(b={b}, s={s}) is outside the captured ranges ({covered})")

    def problem_at(self, b: int, s: int | None) -> Problem:
        return self.range_of(b, s).problem_at(b, s)


class Bounds(Protocol):
    """A range of shapes (frozen dataclasses: read-only members)."""

    @property
    def b_min(self) -> int: ...
    @property
    def b_max(self) -> int | None: ...
    @property
    def s_min(self) -> int | None: ...
    @property
    def s_max(self) -> int | None: ...


def within(r: Bounds, b: int, s: int | None) -> bool:
    """``(b, s)`` is in the range ``r`` bounds (no length: any)."""
    if b < r.b_min or (r.b_max is not None and b > r.b_max):
        return False
    if s is None or r.s_min is None:
        return True
    return s >= r.s_min and (r.s_max is None or s <= r.s_max)


def range_text(r: Bounds) -> str:
    """``b >= 2, 3 <= s <= 4096``."""
    b = f"b = {r.b_min}" if r.b_max == r.b_min else f"b >= {r.b_min}"
    if r.s_min is None:
        return b
    top = "" if r.s_max is None else f" <= {r.s_max}"
    return f"{b}, {r.s_min} <= s{top}"


def _signature(problem: Problem) -> list[tuple[Any, ...]]:
    return [
        (
            v.name,
            v.role,
            v.op,
            v.inputs,
            v.storages,
            v.allocates,
            v.never_recomputed,
            v.savable,
            len(v.shape),
        )
        for v in problem.values
    ]


def same_graph(problem: Problem, template: Problem) -> bool:
    """Same values, ops, storages and ranks: a plan of ``template`` means the same there."""
    return _signature(problem) == _signature(template)


def _timed(analysis: Any) -> dict[str, tuple[int, str]]:
    """``name -> (bytes moved, dtype)`` of every op that launches a kernel (not a view, a
    tuple projection or a placeholder), as :func:`remat.measure.costs.node_time` times them."""
    by_name = analysis.problem.by_name
    out: dict[str, tuple[int, str]] = {}
    for node in analysis.joint.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        v = by_name.get(node.name)
        if v is None or view_like(node, bool(v.allocates)):
            continue
        out[node.name] = (node_bytes_moved(node, False), node_dtype(node))
    return out


def _fit_range(
    analyze_at: Callable[[int, int | None], Any],
    fit_shapes: Sequence[tuple[int, int]],
    check_shapes: Sequence[tuple[int, int]],
    has_seq: bool,
    b_range: tuple[int, int | None],
    s_range: tuple[int | None, int | None],
    progress: Callable[[str], None] | None,
) -> ShapeRange:
    shapes = [*fit_shapes, *check_shapes]
    analyses = []
    for b, s in shapes:
        if progress:
            progress(f"capturing at b={b}" + (f", s={s}" if has_seq else ""))
        analyses.append(analyze_at(b, s if has_seq else None))
    problems = [a.problem for a in analyses]
    ref = _signature(problems[0])
    for (b, s), p in zip(shapes, problems, strict=True):
        sig = _signature(p)
        if sig != ref:
            k = next(
                (i for i, (x, y) in enumerate(zip(ref, sig, strict=False)) if x != y),
                min(len(ref), len(sig)),
            )
            what = problems[0].values[k] if k < len(problems[0].values) else None
            where = f"{what.op} in {what.module_path or '(top level)'}" if what else "its end"
            raise FitError(
                f"the step's graph changes with the shape: at b={b}, s={s} it differs from "
                f"b={shapes[0][0]}, s={shapes[0][1]} at value {k} ({where}); the model "
                "branches on a size. Plan each shape (or bucket) separately."
            )
    timed = [_timed(a) for a in analyses]
    fitter = Fitter.over([(b, s if has_seq else 0) for b, s in fit_shapes])
    n_fit = len(fit_shapes)

    def fitted(what: str, samples: Sequence[int]) -> Poly:
        poly = fitter(samples[:n_fit])
        for (b, s), got in zip(check_shapes, samples[n_fit:], strict=True):
            if poly(b, s if has_seq else 0) != got:
                raise FitError(
                    f"{what} is not a polynomial of degree <= 2 in s (1 in b): fitted "
                    f"{poly}, which gives {poly(b, s if has_seq else 0)} at b={b}, s={s}, "
                    f"where the capture has {got}"
                )
        return poly

    template = problems[0]
    storage = {
        k: fitted(f"storage {k}", [p.storage_bytes[k] for p in problems])
        for k in template.storage_bytes
    }
    scratch: dict[str, Poly] = {}
    flops: dict[str, Poly] = {}
    moved: dict[str, Poly] = {}
    dims: dict[str, tuple[Poly, ...]] = {}
    dtypes: dict[str, str] = {}
    for i, v in enumerate(template.values):
        where = f"{v.name} ({v.op} in {v.module_path or '(top level)'})"
        if any(p.values[i].scratch_bytes for p in problems):
            scratch[v.name] = fitted(
                f"the kernel scratch of {where}", [p.values[i].scratch_bytes for p in problems]
            )
        flops[v.name] = fitted(f"the FLOPs of {where}", [p.values[i].flops for p in problems])
        dims[v.name] = tuple(
            fitted(f"dimension {d} of {where}", [p.values[i].shape[d] for p in problems])
            for d in range(len(v.shape))
        )
        if v.name in timed[0]:
            moved[v.name] = fitted(f"the bytes {where} moves", [t[v.name][0] for t in timed])
            dtypes[v.name] = timed[0][v.name][1]
    return ShapeRange(
        b_min=b_range[0],
        b_max=b_range[1],
        s_min=s_range[0],
        s_max=s_range[1],
        template=template,
        storage=storage,
        scratch=scratch,
        flops=flops,
        moved=moved,
        shapes=dims,
        dtypes=dtypes,
        fitted_at=tuple(fit_shapes),
        checked_at=tuple(check_shapes),
    )


def fit_lengths(seq: int) -> tuple[list[int], int]:
    """Three lengths to fit at and one to check at, at and below the example's ``seq``
    (lengths past it may exceed the model's positions)."""
    if seq < 8:
        raise ValueError(
            f"give an example sequence of at least 8 tokens to fit lengths (got {seq})"
        )
    k = max(2, seq // 8)
    return [seq - 2 * k, seq - k, seq], seq - k - k // 2


@dataclass(frozen=True)
class RangeShapes:
    """The shapes one range of a fit is captured at: ``fit`` determines its polynomials,
    ``check`` tests them at shapes they were not built from (``s = 0``: no sequence)."""

    fit: tuple[tuple[int, int], ...]
    check: tuple[tuple[int, int], ...]
    b_range: tuple[int, int | None]
    s_range: tuple[int | None, int | None]


def range_shapes(
    dims: Dims, *, max_seq: int | None = None, batch: int | None = None
) -> list[RangeShapes]:
    """Two ranges, ``b = 1`` and ``b >= 2`` (a polynomial in ``b`` needs two batches, and
    ``b = 1`` often takes other kernels), each over every length from 3 up to ``max_seq``
    when the model has a sequence. ``batch``: only the range that holds it."""
    has_seq = dims.seq is not None
    lengths, check = fit_lengths(dims.seq) if dims.seq is not None else ([0, 0, 0], 0)
    s_range: tuple[int | None, int | None] = (3, max_seq) if has_seq else (None, None)
    s_fit = lengths if has_seq else [0]
    out = []
    if batch is None or batch == 1:
        out.append(
            RangeShapes(
                tuple((1, s) for s in s_fit),
                ((1, check),) if has_seq else (),
                (1, 1),
                s_range,
            )
        )
    if batch is None or batch >= 2:
        out.append(
            RangeShapes(
                tuple((b, s) for b in (2, 3) for s in s_fit),
                ((4, check),) if has_seq else ((4, 0), (5, 0)),
                (2, None),
                s_range,
            )
        )
    return out


def capture_dynamic(
    analyze: Analyzer,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    dims: Dims,
    *,
    max_seq: int | None = None,
    batch: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> DynamicProblem:
    """Fit the step over the ranges of :func:`range_shapes` (4 captures for ``b = 1``, 7 for
    ``b >= 2``)."""
    has_seq = dims.seq is not None

    def analyze_at(b: int, s: int | None) -> Any:
        a, kw = inputs_at(args, kwargs, dims, b, s)
        return analyze(a, kw)

    ranges = [
        _fit_range(analyze_at, r.fit, r.check, has_seq, r.b_range, r.s_range, progress)
        for r in range_shapes(dims, max_seq=max_seq, batch=batch)
    ]
    return DynamicProblem(tuple(ranges), dims)


_LAYER = re.compile(r"^(?P<head>.*?)\.(?P<index>\d+)(?P<tail>\..*)?$")


def _layer_keys(problem: Problem, layers: int) -> list[tuple[Any, ...]]:
    """A name for each value that is the same in a deeper copy of the model: its role, its
    module path with the layer index replaced by first / middle / last, the op and its
    ordinal there. A value outside any module (an accumulation in the backward) takes the
    layer of the value before it."""
    keys = []
    seen: Counter[tuple[Any, ...]] = Counter()
    context: dict[Any, int | None] = {}
    for v in problem.values:
        m = _LAYER.match(v.module_path)
        index: int | None
        if m:
            index = int(m["index"])
            context[v.role] = index
            path = f"{m['head']}.{{{_position(index, layers)}}}{m['tail'] or ''}"
        else:
            index = context.get(v.role)
            path = v.module_path
        where = (v.role, path, _op(v), None if index is None else _position(index, layers))
        scope = (*where, index)
        keys.append((*where, seen[scope]))
        seen[scope] += 1
    return keys


def _op(v: Any) -> str:
    """The op, or ``placeholder`` for an input (whose op is its own numbered name)."""
    return "placeholder" if v.op == v.name else str(v.op)


_WEIGHTS = frozenset({Role.PARAM, Role.BUFFER, Role.CONSTANT})


def _position(index: int, layers: int) -> str:
    return "first" if index == 0 else "last" if index == layers - 1 else "middle"


def map_range(
    small: ShapeRange, full: Any, shape: tuple[int, int], small_layers: int, full_layers: int
) -> ShapeRange:
    """``small``'s polynomials for a deeper copy of the model (``full``: its analysis at
    ``shape``, in the range), value by value through :func:`_layer_keys`; every size of
    ``full`` is checked against its polynomial at that shape."""
    problem: Problem = full.problem
    by_key = dict(
        zip(_layer_keys(small.template, small_layers), small.template.values, strict=True)
    )
    b, s_ = shape
    timed = _timed(full)
    storage: dict[str, Poly] = {}
    scratch: dict[str, Poly] = {}
    flops: dict[str, Poly] = {}
    moved: dict[str, Poly] = {}
    shapes: dict[str, tuple[Poly, ...]] = {}
    dtypes: dict[str, str] = {}

    def check(what: str, poly: Poly, got: int) -> Poly:
        if poly(b, s_) != got:
            raise FitError(
                f"{what}: the shallow copy's {poly} gives {poly(b, s_)}, the model {got}"
            )
        return poly

    for v, key in zip(problem.values, _layer_keys(problem, full_layers), strict=True):
        if v.role in _WEIGHTS and not v.allocates:
            # A parameter, buffer or constant: its size is not the batch's or length's, and
            # its storage existed before the step.
            flops[v.name] = Poly.constant(v.flops)
            shapes[v.name] = tuple(Poly.constant(d) for d in v.shape)
            continue
        w = by_key.get(key)
        if w is None or _op(w) != _op(v) or len(w.allocates) != len(v.allocates):
            raise FitError(f"{v.name} ({v.op} in {v.module_path}) has no match in the shallow copy")
        for a, c in zip(v.allocates, w.allocates, strict=True):
            storage[a] = check(f"storage {a}", small.storage[c], problem.storage_bytes[a])
        if w.name in small.scratch or v.scratch_bytes:
            scratch[v.name] = check(
                f"scratch of {v.name}", small.scratch.get(w.name, Poly()), v.scratch_bytes
            )
        flops[v.name] = check(f"FLOPs of {v.name}", small.flops[w.name], v.flops)
        if len(v.shape) != len(small.shapes[w.name]):
            raise FitError(f"{v.name}: rank {len(v.shape)} against the shallow copy's")
        shapes[v.name] = tuple(
            check(f"dimension {d} of {v.name}", p, v.shape[d])
            for d, p in enumerate(small.shapes[w.name])
        )
        if (v.name in timed) != (w.name in small.moved):
            raise FitError(f"{v.name} launches a kernel in one copy only")
        if v.name in timed:
            moved[v.name] = check(f"bytes {v.name} moves", small.moved[w.name], timed[v.name][0])
            dtypes[v.name] = timed[v.name][1]
    missing = set(problem.storage_bytes) - set(storage)
    if missing:
        raise FitError(f"storages without a polynomial: {sorted(missing)[:3]}")
    return dataclasses.replace(
        small,
        template=problem,
        storage=storage,
        scratch=scratch,
        flops=flops,
        moved=moved,
        shapes=shapes,
        dtypes=dtypes,
        checked_at=(*small.checked_at, (b, s_)),
    )


def capture_dynamic_deep(
    analyze: Analyzer,
    analyze_shallow: Analyzer,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    dims: Dims,
    *,
    layers: int,
    shallow_layers: int,
    max_seq: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> DynamicProblem:
    """:func:`capture_dynamic` for a deep stack of identical layers: the fit runs on a
    shallow copy (``shallow_layers`` >= 3: a first, a middle and a last layer), and the deep
    model is captured once per range, at the example's length, to take its structure and
    check every one of its sizes against the shallow copy's polynomials. A 70B model costs
    two deep captures instead of eleven. Falls back to :func:`capture_dynamic` on the deep
    model when a size does not match."""
    if shallow_layers < 3 or layers <= shallow_layers:
        raise ValueError("the shallow copy needs 3 or more layers, and fewer than the model")
    shallow = capture_dynamic(
        analyze_shallow, args, kwargs, dims, max_seq=max_seq, progress=progress
    )
    s = dims.seq
    ranges = []
    try:
        for r in shallow.ranges:
            shape = (r.b_min if r.b_max == r.b_min else max(2, dims.batch), s or 0)
            if progress:
                progress(f"capturing the {layers}-layer model at b={shape[0]}, s={s}")
            a, kw = inputs_at(args, kwargs, dims, shape[0], s)
            ranges.append(map_range(r, analyze(a, kw), shape, shallow_layers, layers))
    except FitError as e:
        if progress:
            progress(f"the shallow copy does not match ({e}); fitting the model itself")
        return capture_dynamic(analyze, args, kwargs, dims, max_seq=max_seq, progress=progress)
    return DynamicProblem(tuple(ranges), dims)
