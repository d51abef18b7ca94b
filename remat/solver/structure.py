"""The repeated structure of a training step: identical blocks, found by structural hash.

Blocks are first grouped by module path (the children of the largest ModuleList, see
:mod:`remat.solver.blocks`), then compared by a structural signature of their forward and
backward values (op, shape, bytes, randomness, and inputs as positions inside the block or as
the role and shape of what comes from outside), so blocks that merely share a name pattern but
differ (another width, a different attention) land in different classes. Within a class, values
correspond by position: a plan found for one block transfers to the others.

:func:`block_problem` cuts one block out of the step as a :class:`Problem` of its own: what
comes from outside is external (free), the gradient flowing in is a tangent, the block's outputs
are user outputs and the gradients it passes on are gradient outputs. Its plans are what the
chain solver (:mod:`remat.solver.chain`) chooses among.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from remat.problem import EXTERNAL_ROLES, Problem, Role, Value
from remat.solver.blocks import block_of


@dataclass(frozen=True)
class Block:
    path: str
    """Module path, e.g. ``model.layers.3``."""
    forward: tuple[str, ...]
    """The block's forward values, in graph order."""
    backward: tuple[str, ...]
    """Backward values attributed to the block (they inherit its module path), and the
    gradient accumulations that run inside its backward and read only its values."""


@dataclass(frozen=True)
class Structure:
    blocks: tuple[Block, ...]
    """Every block, in forward order."""
    classes: tuple[tuple[int, ...], ...]
    """Indices into ``blocks`` of structurally identical blocks."""

    @property
    def repeated(self) -> bool:
        return any(len(c) > 1 for c in self.classes)

    def correspondence(self, a: int, b: int) -> dict[str, str]:
        """Value names of block ``a`` mapped to those of block ``b`` (same class)."""
        x, y = self.blocks[a], self.blocks[b]
        return dict(zip((*x.forward, *x.backward), (*y.forward, *y.backward), strict=True))


def find_structure(problem: Problem, block_types: tuple[str, ...] = ()) -> Structure:
    """Blocks in forward order and their classes of identical structure."""
    owner = _within_backward_ranges(problem, block_of(problem, block_types))
    fwd: dict[str, list[str]] = {}
    bwd: dict[str, list[str]] = {}
    for v in problem.values:
        b = owner.get(v.name)
        if b is None:
            continue
        if v.role is Role.FORWARD:
            fwd.setdefault(b, []).append(v.name)
        elif v.role is Role.BACKWARD:
            bwd.setdefault(b, []).append(v.name)
    blocks = tuple(Block(p, tuple(names), tuple(bwd.get(p, ()))) for p, names in fwd.items())
    classes: dict[tuple[object, ...], list[int]] = {}
    for k, block in enumerate(blocks):
        classes.setdefault(_signature(problem, block), []).append(k)
    return Structure(blocks, tuple(tuple(c) for c in classes.values()))


def _within_backward_ranges(
    problem: Problem, owner: Mapping[str, str | None]
) -> dict[str, str | None]:
    """``owner`` with each backward value outside every block that runs between a block's first
    and last backward op and reads only that block's values given to that block. Why:
    autograd's gradient accumulations (the ``add`` summing a value's gradients from its
    several users) have no forward op and carry whatever module the trace saw last (on GPT-2,
    ``lm_head``); left outside, the block problem holds their summands as gradients passed on
    until its backward's end, 300 MB per GPT-2 small block that its real backward frees at
    once. An accumulation that also reads the gradient flowing in stays outside: the last
    block's allocates where the others add in place, and would make it a class of its own."""
    out = dict(owner)
    backward = [v for v in problem.values if v.role is Role.BACKWARD]
    spans: dict[str, list[int]] = {}
    for k, v in enumerate(backward):
        b = owner.get(v.name)
        if b is not None:
            spans.setdefault(b, [k, k])[1] = k
    for b, (lo, hi) in spans.items():
        for v in backward[lo : hi + 1]:
            if out.get(v.name) is None and v.inputs and all(out.get(i) == b for i in v.inputs):
                out[v.name] = b
    return out


def _signature(problem: Problem, block: Block) -> tuple[object, ...]:
    values = problem.by_name
    names = (*block.forward, *block.backward)
    local = {n: k for k, n in enumerate(names)}
    storage_local: dict[str, int] = {}
    sig: list[object] = []
    for n in names:
        v = values[n]
        ins = tuple(local[i] if i in local else _outside(values[i]) for i in v.inputs)
        sto = tuple(storage_local.setdefault(s, len(storage_local)) for s in v.storages)
        nbytes = tuple(problem.storage_bytes.get(s, 0) for s in v.allocates)
        sig.append((v.role.value, v.op, v.shape, v.never_recomputed, ins, sto, nbytes, v.flops))
    return tuple(sig)


BALLAST = "__ballast__"


def _outside(v: Value) -> tuple[str, tuple[int, ...]]:
    """What an input from outside the block looks like: a parameter (buffer, constant), or an
    activation (the first block reads the model's input where the others read a block's
    output: the same to the block)."""
    kind = v.role.value if v.role in (Role.PARAM, Role.BUFFER, Role.CONSTANT) else "activation"
    return kind, v.shape


def block_problem(problem: Problem, block: Block, ballast_bytes: int = 0) -> Problem:
    """The block's step as a problem of its own (see the module docstring).

    ``ballast_bytes``: a buffer allocated and freed just before the block's backward starts,
    standing in for the later blocks' backward, which runs while this block's saved values
    wait: with a ballast larger than the block's own backward, a budget bounds what the block
    keeps across its forward and backward rather than its own backward's peak."""
    values = problem.by_name
    inside = {*block.forward, *block.backward}
    users = problem.users
    own_storages = {s for n in inside for s in values[n].allocates}
    outside: dict[str, Value] = {}
    kept: list[Value] = []
    for n in sorted(inside, key=problem.index.__getitem__):
        v = values[n]
        for i in v.inputs:
            if i in inside or i in outside:
                continue
            u = values[i]
            if u.role is Role.BACKWARD or u.role is Role.TANGENT:
                # A gradient flowing in: held by the engine through the block's backward.
                owned = tuple(s for s in u.storages if s in problem.storage_bytes)
                outside[i] = Value(i, Role.TANGENT, u.op, (), owned, owned, shape=u.shape)
            else:
                role = u.role if u.role in EXTERNAL_ROLES else Role.INPUT
                outside[i] = Value(i, role, u.op, shape=u.shape)
        kept.append(
            Value(
                name=n,
                role=v.role,
                op=v.op,
                inputs=v.inputs,
                storages=tuple(s for s in v.storages if s in own_storages),
                allocates=v.allocates,
                flops=v.flops,
                time_s=v.time_s,
                random=v.random,
                module_path=v.module_path,
                module_stack=v.module_stack,
                shape=v.shape,
                pinned=v.pinned,
            )
        )
    grads = set(problem.grad_outputs)
    user_outputs = tuple(
        n
        for n in block.forward
        if n in problem.user_outputs or any(u not in inside for u in users[n])
    )
    grad_outputs = tuple(
        n for n in block.backward if n in grads or any(u not in inside for u in users[n])
    )
    ext = sorted(outside.values(), key=lambda v: problem.index[v.name])
    tangent_storages = {s for v in ext for s in v.allocates}
    storage_bytes: dict[str, int] = {
        s: b for s, b in problem.storage_bytes.items() if s in own_storages or s in tangent_storages
    }
    tangents = [v.name for v in ext if v.role is Role.TANGENT]
    if ballast_bytes and tangents:
        sid = f"{BALLAST}#0"
        storage_bytes[sid] = ballast_bytes
        first = next(k for k, v in enumerate(kept) if v.role is Role.BACKWARD)
        kept.insert(first, Value(BALLAST, Role.BACKWARD, "ballast", (tangents[0],), (sid,), (sid,)))
    return Problem(
        values=(*ext, *kept),
        storage_bytes=storage_bytes,
        user_outputs=user_outputs,
        mutation_outputs=tuple(n for n in problem.mutation_outputs if n in inside),
        grad_outputs=grad_outputs,
        grads_held=problem.grads_held,
        device_profile=problem.device_profile,
        metadata={**problem.metadata, "block": block.path},
    )
