"""Benchmark (not a test): remat's accounting of a GPT layer's activations against Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models"), Sec. 4.1, eq. (1):

    activations per layer = s*b*h*(34 + 5*a*s/h) bytes   (16-bit activations, 1-byte masks)

A 2-layer stack of the paper's layer (gptlayer.py: explicit attention, dropout p=0.1, causal
mask as a buffer) plus a final LayerNorm is built under FakeTensorMode and run through
remat.analyze with the a100 profile in three precisions:

* ``fp16``       the model itself in fp16 (what the paper assumes: every activation 16-bit,
                 Megatron-LM's fp16 model copy), no autocast;
* ``fp16-mixed`` remat's precision="fp16-mixed": fp32 parameters, traced under torch.autocast;
* ``fp32``       for reference (remat splits fp32 dropout into a bool mask and a product).

For each config, the keep-all saved set (remat.solver.fixed.fixed_saved_set(problem,
"keep_all") through make_plan; Plan.saved_bytes, storage-deduplicated) is attributed per layer
by the module that allocates each storage, and per paper term. Layer 1's numbers are reported
(layer 0 is identical; the check below asserts it). Then the megatron, block and keep-all
solvers' saved bytes, and the same layer with F.scaled_dot_product_attention.

    python experiments/megatron_check.py          # ~1 min on 2 cores; writes results/megatron_check*.csv
"""

from __future__ import annotations

import csv
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import remat
from remat.problem import Role
from remat.solver.fixed import fixed_saved_set
from remat.solver.plan import Proof, make_plan
from remat.solver.registry import solve

sys.path.insert(0, str(Path(__file__).parent))
from gptlayer import Stack

RESULTS = Path(__file__).parent / "results"
CONFIGS = [(2048, 4096, 32), (1024, 2048, 16), (512, 1024, 16)]  # (s, h, a)
BATCH = 4

# Paper terms, in units of sbh (16-bit) unless marked as2b (units of a*s^2*b).
PAPER = {
    "LN1 input (prev. layer output)": (2, 0),
    "QKV input (LN1 output)": (2, 0),
    "QK^T inputs (Q, K)": (4, 0),
    "softmax output": (0, 2),
    "attention dropout mask": (0, 1),
    "attention dropout output": (0, 2),
    "V (attention-over-V input)": (2, 0),
    "output-proj input": (2, 0),
    "attention-out dropout mask": (1, 0),
    "LN2 input (residual)": (2, 0),
    "fc1 input (LN2 output)": (2, 0),
    "GeLU input (fc1 output)": (8, 0),
    "fc2 input (GeLU output)": (8, 0),
    "MLP dropout mask": (1, 0),
}
EXTRA = (
    "LayerNorm mean/rstd",
    "fp16 weight copies (autocast)",
    "attention-out dropout output",
    "MLP dropout output",
)


def build(s: int, h: int, a: int, dtype: torch.dtype, fused: bool = False, p_attn: float = 0.1):
    torch.set_default_dtype(dtype)
    try:
        with remat.fake_mode():
            model = Stack(2, h, a, s, p=0.1, fused=fused)
            for layer in model.layers:
                layer.attn.p = p_attn
                layer.attn.attn_drop.p = p_attn
            x = torch.randn(BATCH, s, h)
    finally:
        torch.set_default_dtype(torch.float32)
    return model, x


def analyze(s, h, a, precision, fused=False, p_attn=0.1):
    dtype = torch.float16 if precision == "fp16" else torch.float32
    model, x = build(s, h, a, dtype, fused, p_attn)
    prec = "fp16-mixed" if precision == "fp16-mixed" else "fp32"
    return remat.analyze(model, (x,), device_profile="a100", precision=prec).problem


def _layer(path: str) -> str | None:
    parts = path.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "layers" else None


def classify(problem, saved: frozenset[str]) -> dict[str, dict[str, int]]:
    """Bytes of the saved storages per layer ('layers.0', ...) and per paper term.

    A storage belongs to the layer of the module whose op allocates it; the term is read from
    that op, its module and, for the attention's copies, their order."""
    values = problem.by_name
    storages = {s for n in saved for s in values[n].storages}
    by_alloc = defaultdict(list)
    for st in storages:
        by_alloc[st.rsplit("#", 1)[0]].append(st)
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    clones: dict[str, int] = defaultdict(int)
    for v in problem.values:  # graph order, so clone ordinals are forward order
        if v.role is not Role.FORWARD:
            continue
        if v.op == "aten.clone.default" and "attn" in v.module_path:
            clones[v.name] = clones[_layer(v.module_path) or ""]
            clones[_layer(v.module_path) or ""] += 1
        if v.op == "aten.add.Tensor" and v.module_path == _layer(v.module_path):
            clones[v.name] = clones["add:" + v.module_path]
            clones["add:" + v.module_path] += 1
        if v.name not in by_alloc:
            continue
        path = v.module_path
        layer = _layer(path) or path or "top"
        leaf = path.split(".")[-1] if path else ""
        for st in by_alloc[v.name]:
            nbytes = problem.storage_bytes[st]
            idx = int(st.rsplit("#", 1)[1])
            op = v.op
            src = values[v.inputs[0]] if v.inputs else None
            if op == "aten.native_layer_norm.default":
                term = (
                    "LayerNorm mean/rstd"
                    if idx > 0
                    else (
                        "QKV input (LN1 output)"
                        if leaf == "ln1"
                        else "fc1 input (LN2 output)"
                        if leaf == "ln2"
                        else "other"
                    )
                )
            elif op == "aten._to_copy.default" and src is not None and src.role is Role.PARAM:
                term = "fp16 weight copies (autocast)"
            elif op == "aten._to_copy.default" and leaf in ("qkv", "fc1"):
                term = "QKV input (LN1 output)" if leaf == "qkv" else "fc1 input (LN2 output)"
            elif op == "aten.clone.default" and "attn" in path:
                term = [
                    "QK^T inputs (Q, K)",
                    "QK^T inputs (Q, K)",
                    "V (attention-over-V input)",
                    "output-proj input",
                ][min(clones[v.name], 3)]
            elif op == "aten._softmax.default" or op == "aten._safe_softmax.default":
                term = "softmax output"
            elif op == "aten.native_dropout.default" or op == "aten.bernoulli.p":
                mask = idx == 1 or op == "aten.bernoulli.p"
                if leaf == "attn_drop":
                    term = "attention dropout mask" if mask else "attention dropout output"
                elif leaf == "drop1":
                    term = "attention-out dropout mask" if mask else "attention-out dropout output"
                elif leaf == "drop2":
                    term = "MLP dropout mask" if mask else "MLP dropout output"
                else:
                    term = "other"
            elif op == "aten.mul.Tensor" and leaf == "attn_drop":
                term = "attention dropout output"  # fp32: the split dropout's product
            elif op == "aten.addmm.default" and leaf == "fc1":
                term = "GeLU input (fc1 output)"
            elif op == "aten.gelu.default":
                term = "fc2 input (GeLU output)"
            elif op == "aten.add.Tensor" and path == layer:
                # the layer's two residual adds: the first feeds ln2, the second the next ln1
                term = (
                    "LN2 input (residual)"
                    if clones[v.name] == 0
                    else ("LN1 input (prev. layer output)")
                )
            else:
                term = f"other: {op}"
            out[layer][term] += nbytes
    return out


def saved_of(problem, solver: str):
    return solve(problem, solver=solver, budget_bytes=None)


S2_TERMS = ("softmax output", "attention dropout mask", "attention dropout output")


def paper_bytes(term: str, plan: str, precision: str, sbh: int, as2b: int) -> int:
    """The paper's bytes for a term under a plan (keep_all: eq. 1; megatron: selective, the
    s^2 terms recomputed; block: full recompute, only the layer input kept). fp32 doubles
    the 16-bit tensors, masks stay 1 byte."""
    if term not in PAPER:
        return 0
    if plan in ("megatron", "sdpa_p0", "sdpa_p0.1") and term in S2_TERMS:
        return 0
    if plan == "block" and term != "LN1 input (prev. layer output)":
        return 0
    ps, pa = PAPER[term]
    scale = 2 if precision == "fp32" and "mask" not in term else 1
    return int(scale * (ps * sbh + pa * as2b))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    term_rows, summary_rows = [], []
    for s, h, a in CONFIGS:
        sbh, as2b = s * BATCH * h, a * s * s * BATCH
        for precision in ("fp16", "fp16-mixed", "fp32"):
            t0 = time.perf_counter()
            problem = analyze(s, h, a, precision)
            # keep_all exactly as the brief names it: fixed_saved_set + make_plan
            why = fixed_saved_set(problem, "keep_all")
            keep_all = make_plan(
                problem, why, solver="keep_all", reason="keep_all", proof=Proof.HEURISTIC
            )
            layers = {"keep_all": classify(problem, keep_all.saved)}
            assert dict(layers["keep_all"]["layers.0"]) == dict(layers["keep_all"]["layers.1"])
            plans = {"keep_all": keep_all}
            for name in ("megatron", "block"):
                plans[name] = saved_of(problem, name)
                layers[name] = classify(problem, plans[name].saved)
            sdpa_ops = {}
            for tag, p_attn in (("sdpa_p0", 0.0), ("sdpa_p0.1", 0.1)):
                fp = analyze(s, h, a, precision, fused=True, p_attn=p_attn)
                fplan = saved_of(fp, "keep_all")
                layers[tag] = classify(fp, fplan.saved)
                sdpa_ops[tag] = next(
                    (v.op.split(".")[1] for v in fp.values if "scaled_dot_product" in v.op),
                    "math path (explicit ops)",
                )
            row = {
                "s": s,
                "h": h,
                "a": a,
                "b": BATCH,
                "precision": precision,
                "paper_keep_all_sbh": 34 + 5 * a * s / h,
                "paper_selective_sbh": 34,
            }
            fwd = sum(v.flops for v in problem.values if v.role is Role.FORWARD)
            bwd = sum(v.flops for v in problem.values if v.role is Role.BACKWARD)
            for name, per_layer in layers.items():
                l1 = per_layer["layers.1"]
                row[f"{name}_per_layer_bytes"] = sum(l1.values())
                row[f"{name}_per_layer_sbh"] = round(sum(l1.values()) / sbh, 4)
                if name in plans:
                    sim = plans[name].simulation
                    row[f"{name}_saved_bytes_2layers"] = plans[name].saved_bytes
                    row[f"{name}_peak_bytes_2layers"] = plans[name].predicted_peak_bytes
                    row[f"{name}_recompute_time_pct"] = round(
                        100 * sim.recompute_time_s / sim.step_time_s, 3
                    )
                    row[f"{name}_recompute_flops_pct"] = round(
                        100 * sim.recompute_flops / (fwd + bwd), 3
                    )
                for term in dict.fromkeys([*PAPER, *EXTRA, *sorted(l1)]):
                    got, want = l1.get(term, 0), paper_bytes(term, name, precision, sbh, as2b)
                    if not got and not want:
                        continue
                    ps, pa = PAPER.get(term, (0, 0))
                    term_rows.append(
                        {
                            "s": s,
                            "h": h,
                            "a": a,
                            "b": BATCH,
                            "precision": precision,
                            "plan": name,
                            "term": term,
                            "paper_units": (f"{ps}sbh" if ps else "") + (f"{pa}as2b" if pa else ""),
                            "paper_bytes": want,
                            "remat_bytes": got,
                            "diff_bytes": got - want,
                            "remat_sbh": round(got / sbh, 4),
                            "paper_sbh": round(want / sbh, 4),
                        }
                    )
            row.update({f"{k}_attention_op": v for k, v in sdpa_ops.items()})
            row["seconds"] = round(time.perf_counter() - t0, 1)
            summary_rows.append(row)
            print(
                f"s={s} h={h} a={a} b={BATCH} {precision:10s}: paper {row['paper_keep_all_sbh']:.0f} "
                f"sbh (selective 34) | remat keep_all {row['keep_all_per_layer_sbh']:.3f}, "
                f"megatron {row['megatron_per_layer_sbh']:.3f}, block {row['block_per_layer_sbh']:.3f}, "
                f"sdpa p=0 {row['sdpa_p0_per_layer_sbh']:.3f}, sdpa p=0.1 "
                f"{row['sdpa_p0.1_per_layer_sbh']:.3f} [{row['seconds']}s]",
                flush=True,
            )
            if (s, h, a) == CONFIGS[0]:
                for name in ("keep_all", "megatron", "block", "sdpa_p0"):
                    l1 = layers[name]["layers.1"]
                    print(
                        f"    {name}: "
                        + ", ".join(
                            f"{t} {b_ / sbh:.3g}"
                            for t, b_ in sorted(l1.items(), key=lambda kv: -kv[1])
                        )
                    )
    for fname, rows in (
        ("megatron_check_terms.csv", term_rows),
        ("megatron_check.csv", summary_rows),
    ):
        with (RESULTS / fname).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
        print("wrote", RESULTS / fname)


if __name__ == "__main__":
    main()
