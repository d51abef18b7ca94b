"""Each executor's least peak on the developers' zoo decoders: how low ``remat.apply``'s plans
(PyTorch's selective checkpointing on the blocks; code outside the blocks eager) reach against
remat's whole-graph executor, which can recompute anywhere.

Native: the least traced peak among its fixed plans and the chain DP's uniform menu options
(every region recomputed is usually the least), on the blocks and on the blocks' sub-modules
(:func:`remat.executors.sac.regions.split_blocks`, which ``auto`` also plans on), each with and
without the modules outside the blocks (:func:`remat.executors.sac.regions.outside_blocks`). Graph: the least simulated peak of the
heuristics the budget search uses (:func:`remat.solver.registry.least_peak`). Both at the
allocator, for one fp32 training step on the CPU profile. Also where the native least peak
falls (the op and whether it is inside a block). Writes ``experiments/results/least_peaks.csv``.

    .venv/bin/python experiments/least_peaks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import save, show  # noqa: E402
from remat.executors.graph.analyze import analyze  # noqa: E402
from remat.executors.sac.hf import kv_cache_off  # noqa: E402
from remat.executors.sac.passes import analyze as native_analyze  # noqa: E402
from remat.executors.sac.planner import NATIVE_PLANS, fixed_policies, uniform_plans  # noqa: E402
from remat.executors.sac.regions import find_blocks, outside_blocks, split_blocks  # noqa: E402
from remat.measure.profiles import get_profile  # noqa: E402
from remat.request import Request  # noqa: E402
from remat.solver.registry import HEURISTICS, least_peak  # noqa: E402
from tests.zoo import NATIVE_ZOO  # noqa: E402

MODELS = ("tiny_gpt", "hf_gpt2", "hf_llama_gqa", "hf_mixtral_moe", "hf_bert", "resnet_bn")


def main() -> None:
    rows = []
    for case in (c for c in NATIVE_ZOO if c.name in MODELS):
        torch.manual_seed(0)
        model, args = case.build().train(), case.inputs()
        problem = analyze(model, args, case.kwargs, device_profile="cpu").problem
        graph = min(least_peak(problem, n) for n in HEURISTICS)
        blocks = find_blocks(model)
        least = {}
        split, outside = split_blocks(model, blocks), outside_blocks(model, blocks)
        for regions, label in (
            (blocks, "blocks"),
            (blocks + outside, "blocks and the modules outside them"),
            (split, "sub-modules"),
            (split + outside, "sub-modules and the modules outside the blocks"),
        ):
            with kv_cache_off(model):
                traced, native = native_analyze(
                    model, regions, args, case.kwargs, Request.of(), get_profile("cpu"),
                    fsdp_units=blocks,
                )  # fmt: skip
                plans = {n: fixed_policies(native, n) for n in NATIVE_PLANS}
                plans |= uniform_plans(native)
                traces = {n: traced.trace(args, case.kwargs, p) for n, p in plans.items()}
            least[label] = min(traces.items(), key=lambda kv: kv[1].peak_bytes)
        label, (name, best) = min(least.items(), key=lambda kv: kv[1][1].peak_bytes)
        at = best.events[best.peak_event]
        where = best.blocks[at.block] if at.block >= 0 else "outside the blocks"
        rows.append(
            {
                "model": case.name,
                "graph_least_bytes": graph,
                "native_blocks_least_bytes": least["blocks"][1].peak_bytes,
                "native_least_bytes": best.peak_bytes,
                "ratio": round(best.peak_bytes / graph, 4),
                "native_plan": f"{name} on the {label}",
                "native_peak_at": f"{at.phase} {at.op} ({where})",
            }
        )
    show(rows, "least peak per executor (allocator, fp32, CPU profile)")
    print(f"wrote {save(rows, 'least_peaks.csv')}")


if __name__ == "__main__":
    main()
