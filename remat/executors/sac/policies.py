"""The policies a block can take: its menu from keeping everything to recomputing everything
(:func:`menu`), the fixed plans (:data:`NATIVE_PLANS`), and each option applied to every
block (:func:`uniform_plans`)."""

from __future__ import annotations

from collections.abc import Sequence

from remat import _torch_compat as tc
from remat.executors.sac.regions import FullReplay, OpKey, Policy
from remat.executors.sac.solution import NativeProblem, Option
from remat.executors.sac.trace import OpEvent

COVERAGE = (0.99, 0.95, 0.9, 0.8, 0.65, 0.5, 0.35, 0.2)
"""Shares of a block's recompute time the intermediate menu options keep. On an 8-layer Llama
(hidden 512, seq 512) at three budgets, these eight levels cut the estimated recompute time
by 16-28% against four (0.99, 0.95, 0.8, 0.5) in about the same planning time (11-14 s), and
by more than thirteen levels did (the chain DP's grid lands elsewhere with other menus)."""


NATIVE_PLANS = ("keep_all", "keep_matmuls", "torchtitan_op", "block")
"""Fixed native plans: every block eager; every block keeping the outputs of its ops with
FLOPs (matmuls, convolutions, attention); torchtitan's op-SAC policy
(:func:`torchtitan_op_keys`); every block recomputed whole."""


FITTED_PLANS = ("keep_all", "keep_matmuls", "block")
"""The fixed plans ``remat fit`` and :func:`remat.memory_formula` fit over shapes on the
``sac`` executor (each costs a trace per shape)."""


TORCHTITAN_SAVE_OPS = (
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten.max.default",
    "aten.linear.default",
    "aten.topk.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
)
"""What torchtitan 0.3.0's op-SAC policy saves besides PyTorch's compute-intensive ops
(``torchtitan/distributed/activation_checkpoint.py``, ``_get_default_save_ops``; its flex
attention, compiled-code and expert-parallel entries are not ATen ops a CPU step runs)."""


TORCHTITAN_MM_OPS = ("aten.mm.default", "aten.linear.default")
"""The ops of which torchtitan's policy recomputes every second call in a region."""


def menu(stream: Sequence[OpEvent]) -> list[Option]:
    """Options of one class, from keeping everything to keeping nothing (see the docstring)."""
    forced = required_keys(stream)
    savable = [e for e in stream if e.savable and e.key is not None and e.key not in forced]
    total = sum(e.time_s for e in savable)
    ranked = sorted(savable, key=lambda e: (-e.time_s / max(e.new_bytes, 1), e.new_bytes))
    options = [Option("eager", None)]
    seen: set[frozenset[OpKey]] = set()

    def add(name: str, keys: frozenset[OpKey]) -> None:
        keys |= forced
        if keys not in seen:
            seen.add(keys)
            options.append(Option(name, keys))

    add("keep all savable", frozenset(e.key for e in savable if e.key is not None))
    for share in COVERAGE:
        kept: list[OpKey] = []
        covered = 0.0
        for e in ranked:
            if covered >= share * total:
                break
            assert e.key is not None
            kept.append(e.key)
            covered += e.time_s
        add(f"keep {share:.1%} of recompute time", frozenset(kept))
    add("keep matmuls", matmul_keys(stream))
    add("recompute all", frozenset())
    return options


def matmul_keys(stream: Sequence[OpEvent]) -> frozenset[OpKey]:
    """Savable ops with FLOPs in PyTorch's registry (matmuls, convolutions, attention), and
    the ops every policy keeps."""
    keys = frozenset(e.key for e in stream if e.savable and e.flops > 0 and e.key is not None)
    return keys | required_keys(stream)


def torchtitan_op_keys(stream: Sequence[OpEvent]) -> frozenset[OpKey]:
    """torchtitan 0.3.0's op-SAC policy on one region: the outputs of PyTorch's
    compute-intensive ops and of :data:`TORCHTITAN_SAVE_OPS` are kept, except every second
    ``mm``/``linear`` call of the region's forward (its count runs over both), and the ops
    every policy keeps. Its policy also recomputes the MoE router's matmuls
    (``force_recompute_mm_shapes_by_fqns``), which a dense model does not have. The fixed
    plan runs it without early stop, as torchtitan does (:class:`FullReplay`)."""
    save = tc.compute_intensive_ops() | frozenset(TORCHTITAN_SAVE_OPS)
    keys = set(required_keys(stream))
    mm_calls = 0
    for e in stream:
        if e.key is None:
            continue
        if e.op in TORCHTITAN_MM_OPS:
            mm_calls += 1
            if mm_calls % 2 == 0:
                continue
        if e.op in save and e.savable:
            keys.add(e.key)
    return frozenset(keys)


def required_keys(stream: Sequence[OpEvent]) -> frozenset[OpKey]:
    """Ops every policy keeps: in-place writes to state the block does not own (BatchNorm's
    running statistics), which a recomputation would apply twice."""
    return frozenset(e.key for e in stream if e.writes_outside and e.key is not None)


def fixed_policies(problem: NativeProblem, name: str) -> tuple[Policy, ...]:
    """Every block's policy under one of :data:`NATIVE_PLANS`."""
    if name not in NATIVE_PLANS:
        raise ValueError(f"unknown native plan {name!r}; valid: {', '.join(NATIVE_PLANS)}")
    policies: list[Policy] = []
    for k in range(len(problem.blocks)):
        stream = problem.streams[problem.class_of(k)]
        if name == "keep_all":
            policies.append(None)
        elif name == "block":
            policies.append(required_keys(stream))
        elif name == "torchtitan_op":  # replayed whole, as torchtitan's wrapper runs it
            policies.append(FullReplay(torchtitan_op_keys(stream)))
        else:
            policies.append(matmul_keys(stream))
    return tuple(policies)


def menus_of(problem: NativeProblem) -> tuple[list[list[Option]], int, int]:
    """Each block's menu (its class's), the number of classes, and the longest menu's
    length."""
    menus = {c[0]: menu(problem.streams[c[0]]) for c in problem.classes}
    options_of = [menus[problem.class_of(k)] for k in range(len(problem.blocks))]
    return options_of, len(menus), max(len(m) for m in menus.values())


def uniform_plans(problem: NativeProblem) -> dict[str, tuple[Policy, ...]]:
    """The chain DP's menu applied alike to every block: option ``k`` of each class's menu
    (its last where a class has fewer), from every block eager to every block recomputed."""
    options_of, _, n_opts = menus_of(problem)
    out: dict[str, tuple[Policy, ...]] = {}
    for o in range(n_opts):
        picked = [opts[min(o, len(opts) - 1)] for opts in options_of]
        names = dict.fromkeys(p.name for p in picked)
        out[f"menu {o}: {' / '.join(names)}"] = tuple(p.policy for p in picked)
    return out
