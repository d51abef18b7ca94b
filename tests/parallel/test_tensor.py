"""Planning tensor parallelism ahead, with no process group (:mod:`remat.parallel.tensor`).

That such a plan's peaks are the ones measured on real ranks is checked in
``test_tensor_parallel.py``; here, what needs no processes: the shards, and the errors.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat.budget import Options
from remat.cli import main
from remat.executors.sac.events import TraceError
from remat.parallel.tensor import llama_tp_plan, tensor_parallel
from remat.request import model_static_memory
from tests.zoo import ZOO, llama

LLAMA = ["hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
         "--set", "intermediate_size=128", "--set", "num_attention_heads=4",
         "--set", "num_key_value_heads=2", "--set", "vocab_size=128", "--seq", "64",
         "--batch", "2", "--budget-gb", "0.05", "--device", "cpu", "--time-limit", "5"]  # fmt: skip


def test_static_memory_counts_this_ranks_shards() -> None:
    with remat.fake_mode():
        whole = llama(2, 64)
        model = llama(2, 64)
    tensor_parallel(model, 2)
    sharded = sum(
        p.numel()
        for path, m in whole.named_modules()
        if path.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
        or path.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")
        for p in m.parameters()
    )
    everything = sum(p.numel() for p in whole.parameters())
    options = Options()
    assert model_static_memory(model, options).parameters == 4 * (everything - sharded // 2)
    assert model_static_memory(whole, options).parameters == 4 * everything


def test_a_model_without_llama_projections_is_refused() -> None:
    gpt2 = next(c for c in ZOO if c.name == "hf_gpt2").build()
    with pytest.raises(ValueError, match="no Llama-style projections"):
        llama_tp_plan(gpt2, 2)
    with pytest.raises(ValueError, match="at least 2"):
        tensor_parallel(gpt2, 1)


def test_cli_plans_rank_0_of_a_tensor_parallel_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *LLAMA, "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel x 2" in out and "remat.apply" in out
    assert main(["plan", *LLAMA, "--tp-size", "2", "--executor", "graph"]) == 2
    assert "--tp-size plans remat.apply's executor" in capsys.readouterr().out
    zero3 = ["--zero-stage", "3", "--world-size", "2"]
    assert main(["plan", *LLAMA, "--tp-size", "2", *zero3]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, however it wrapped
    assert "tensor parallel x 2 (rank 0's shard): 4 ranks on a 2-D mesh" in out
    assert main(["plan", *LLAMA, "--sequence-parallel"]) == 2
    assert "--sequence-parallel needs --tp-size" in capsys.readouterr().out


def test_fit_answers_for_rank_0_of_a_tensor_parallel_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remat fit --tp-size 2 --sequence-parallel`` fits rank 0's step: the model and each
    shallow copy the formula traces are parallelized on a fake world of their own (a fit
    of this tiny Llama takes 40 s, so the fit itself is stubbed here; its native formula on
    a parallel model is the one ``remat plan --tp-size`` traces)."""
    import remat.cli.fit as cli_fit
    from remat._torch_compat import fake_world_of, is_dtensor

    seen: dict[str, object] = {}

    def fit(model: torch.nn.Module, *a: object, copies: object = None, **kw: object) -> None:
        seen["model"], seen["copies"] = model, copies
        raise ValueError("stubbed")

    monkeypatch.setattr(cli_fit, "fit", fit)
    args = ["fit", *LLAMA, "--executor", "sac", "--tp-size", "2", "--sequence-parallel"]
    assert main(args) == 1 and "stubbed" in capsys.readouterr().err
    model = seen["model"]
    assert isinstance(model, torch.nn.Module) and fake_world_of(model) is not None
    embed = model.get_input_embeddings()
    assert is_dtensor(embed.weight)  # sequence parallelism shards the embedding's output
    copies = seen["copies"]
    assert callable(copies)
    copy = copies(5)
    assert fake_world_of(copy) not in (None, fake_world_of(model))
    assert len(copy.model.layers) == 5 and is_dtensor(copy.model.layers[0].mlp.up_proj.weight)
    assert main(["fit", *LLAMA, "--executor", "sac", "--sequence-parallel"]) == 2


def test_a_plan_never_sees_another_fake_worlds_mesh(tmp_path: object) -> None:
    """DTensor's caches key on meshes, and meshes of equal shape compare equal across fake
    worlds: a cached result handed the first plan's mesh to the second plan's tensors, whose
    groups are gone once a job's ``destroy_process_group()`` clears c10d's registry (seen in
    the suite, after test_errors.py's in-process gloo group). Each fake world clears them."""
    import torch.distributed as dist

    tokens = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(7))

    def planned() -> int:
        with remat.fake_mode():
            model = llama(2, 128).train()
        tensor_parallel(model, 2, sequence_parallel=True)
        remat.apply(model, tokens, plan="keep_all")
        return remat.plan_of(model).predicted_peak_bytes

    first = planned()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    dist.destroy_process_group()
    assert planned() == first


def test_sequence_parallelism_shards_what_the_norms_save() -> None:
    """torchtitan's sequence-parallel plan, ahead of the job: each norm saves a sequence
    shard of its input, so every fixed plan's peak falls below plain TP's (the 2-rank
    check of these predictions is test_tensor_parallel.py's)."""
    tokens = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(7))
    peaks = {}
    for sp in (False, True):
        for name in ("keep_all", "block"):
            with remat.fake_mode():
                model = llama(3, 128).train()
            tensor_parallel(model, 2, sequence_parallel=sp)
            remat.apply(model, tokens, plan=name)
            peaks[sp, name] = remat.plan_of(model).predicted_peak_bytes
    assert peaks[True, "keep_all"] < peaks[False, "keep_all"], peaks
    assert peaks[True, "block"] < peaks[False, "block"], peaks
    with remat.fake_mode():
        stage = llama(2, 128).train()
    with pytest.raises(ValueError, match="sequence parallelism with pipeline stages"):
        tensor_parallel(stage, 2, pp_size=2, sequence_parallel=True)
    stage.lm_head.weight = stage.model.embed_tokens.weight  # tied, as small Llamas are
    with pytest.raises(ValueError, match="ties its embedding and head weights"):
        llama_tp_plan(stage, 2, sequence_parallel=True)


def test_collectives_are_always_kept() -> None:
    from remat.executors.sac.regions import KeyPolicy

    policy = KeyPolicy(frozenset())
    all_reduce = torch.ops._c10d_functional.all_reduce.default
    assert policy(None, all_reduce).name == "MUST_SAVE"  # type: ignore[arg-type]
    assert policy(None, torch.ops.aten.mm.default).name == "PREFER_RECOMPUTE"  # type: ignore[arg-type]


def test_each_rank_recomputes_its_shards_flops() -> None:
    """FLOPs of the ops a DTensor runs are this rank's (matmuls and attention split by the
    tensor-parallel degree), not the whole layer's. And the timeline says where it counts an
    all-reduced activation the process group may still hold (none without collectives)."""
    flops, late = {}, {}
    for tp in (1, 2):
        with remat.fake_mode():
            model = llama(3, 128)
        if tp > 1:
            tensor_parallel(model, tp)
        tokens = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(7))
        remat.apply(model, tokens, plan="block")
        flops[tp] = remat.plan_of(model).recompute_flops
        late[tp] = {s.late_bytes for s in remat.plan_of(model).simulation.timeline}
    assert flops[1] > 0 and flops[2] * 2 == flops[1]
    assert late[1] == {0} and late[2] == {0, 4 * 128 * 64 * 4}, late  # batch x seq x hidden


def test_a_causal_lm_cut_into_stages_computes_the_model() -> None:
    """``--pp-size``'s stages run the model's own forward: chained, they give its logits and
    gradients bitwise (train mode, attention dropout on, one random stream)."""
    from remat.parallel.split import causal_lm_stages, stage_example

    model = llama(4, 64)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    expected = model(tokens).logits
    expected.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    stages = causal_lm_stages(model, 3)
    assert [len(s.layers) for s in stages] == [1, 1, 2]
    assert stage_example(stages[1], tokens, torch.float32).shape == (2, 32, 64)
    torch.manual_seed(1)
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, expected)
    h.sum().backward()
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)
    with pytest.raises(ValueError, match="not a Llama-family causal LM"):
        causal_lm_stages(next(c for c in ZOO if c.name == "hf_gpt2").build(), 2)
    with pytest.raises(ValueError, match="2 to 4 stages"):
        causal_lm_stages(model, 5)


def test_cli_plans_every_stage_of_a_pipeline(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    """``--pp-size 2``: each stage planned for its own device budget over a 1F1B step; the
    first stage (2 microbatches in flight) recomputes, the last (1) does not. With
    ``--tp-size 2`` too, each stage's peak is its tensor-parallel rank's."""
    pp = [*LLAMA[: LLAMA.index("--budget-gb")], "--device", "cpu", "--time-limit", "3",
          "--executor", "sac", "--pp-size", "2", "--microbatches", "2"]  # fmt: skip
    save = f"{tmp_path}/plan.json"
    assert main(["plan", *pp, "--budget-gb", "0.00133", "--save", save]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [r[1].strip() for r in rows] == ["2", "1"], out  # in flight
    recompute = [float(r[4]) for r in rows]
    assert recompute[0] > 0 == recompute[1], out
    assert "bubble share" in out and f"{tmp_path}/plan.stage1.json" in out.replace("\n", "")
    interleaved = ["--set", "num_hidden_layers=4", "--pp-schedule", "Interleaved1F1B",
                   "--stages-per-rank", "2", "--budget-gb", "0.01", "--save", save]  # fmt: skip
    assert main(["plan", *pp, *interleaved]) == 0, capsys.readouterr()
    out = " ".join(capsys.readouterr().out.split())
    assert "4 stages on 2 ranks" in out and "│ 0 (0, 2) │" in out and "│ 1 (1, 3) │" in out
    assert f"{tmp_path}/plan.rank1.json" in out.replace(" ", "")
    # PP x TP: each rank's stage parallelized on a fake (pp, tp) mesh; TP shards its
    # activations, so each stage's eager peak falls.
    assert main(["plan", *pp, "--tp-size", "2", "--budget-gb", "0.00133"]) == 0
    tp_out = capsys.readouterr().out
    assert "tensor parallel x 2" in tp_out.replace("\n", " ")
    tp_rows = [line.split("│")[1:-1] for line in tp_out.splitlines() if line.startswith("│")]

    def eager(r: list[str]) -> int:
        return int(r[3].split("->")[0].replace(",", ""))

    assert all(eager(t) < eager(r) for t, r in zip(tp_rows, rows, strict=True)), (tp_out, out)
    # PP x FSDP2 x TP: FSDP2's bf16 inside each stage, on one fake (pp, dp, tp) mesh; the
    # stages compute in bf16 and receive bf16, so the peaks fall again.
    three_d = ["--tp-size", "2", "--zero-stage", "3", "--world-size", "2", "--precision",
               "bf16-fsdp", "--budget-gb", "0.00133"]  # fmt: skip
    assert main(["plan", *pp, *three_d]) == 0
    out_3d = capsys.readouterr().out
    assert "tensor parallel x 2, ZeRO-3 x 2; bf16-fsdp" in " ".join(out_3d.split()), out_3d
    rows_3d = [line.split("│")[1:-1] for line in out_3d.splitlines() if line.startswith("│")]
    assert all(eager(t) < eager(r) for t, r in zip(rows_3d, tp_rows, strict=True)), out_3d
    assert main(["plan", *pp, "--microbatches", "3"]) == 2
    assert "does not split into 3 microbatches" in capsys.readouterr().out


def test_tp_with_fsdp2_needs_the_2d_mesh_it_was_parallelized_for() -> None:
    """FSDP2 over world_size ranks shards a fake TP model's "dp" mesh dimension, which must
    have that size (that the 2-D plan's peak is the one measured on 4 ranks is checked in
    test_tensor_parallel.py)."""
    tokens = torch.randint(0, 128, (2, 32))
    with remat.fake_mode():
        flat = llama(2, 64)
    tensor_parallel(flat, 2)
    with pytest.raises(remat.TraceError, match=r"dp_size=2\)"):
        remat.apply(flat, tokens, plan="block", zero_stage=3, world_size=2)
    with remat.fake_mode():
        model = llama(2, 64)
    tensor_parallel(model, 2, dp_size=2)
    with pytest.raises(
        remat.TraceError, match="has 2 data-parallel ranks, not zero_stage=3.s world_size=4"
    ):
        remat.apply(model, tokens, plan="block", zero_stage=3, world_size=4)
    remat.apply(model, tokens, plan="block", zero_stage=3, world_size=2)
    assert remat.plan_of(model).predicted_peak_bytes > 0


def test_a_tensor_parallel_stage_must_be_parallelized_as_its_pipeline_rank() -> None:
    """Ahead of the job a TP stage's pipeline runs over its fake mesh's ``"pp"`` dimension:
    a stage parallelized without one, or as another rank, says how to parallelize it; a
    rank's stages parallelized apart (two fake worlds) are refused."""
    from torch import nn

    from remat.parallel.split import causal_lm_stages
    from tests.zoo import PIPELINE_SEQ, pipeline_loss, stage_inputs

    def stage(i: int, n: int = 2) -> nn.Module:
        with remat.fake_mode():
            return causal_lm_stages(llama(4, PIPELINE_SEQ), n)[i]

    x, target = stage_inputs(1)
    pipe = remat.Pipeline("1F1B", 1, 2, 2, loss_fn=pipeline_loss)
    for kwargs in ({}, {"pp_size": 2, "pp_rank": 0}):
        wrong = tensor_parallel(stage(1), 2, **kwargs)
        with pytest.raises(
            TraceError, match=r"tensor_parallel\(model, tp_size, pp_size=2, pp_rank=1\)"
        ):
            remat.apply(wrong, x, pipeline=pipe, target=target, plan="keep_all")
    apart = nn.ModuleList(tensor_parallel(stage(i, 4), 2, pp_size=2, pp_rank=0) for i in (0, 2))
    pipe = remat.Pipeline("Interleaved1F1B", 0, 4, 2, loss_fn=pipeline_loss, stages_per_rank=2)
    xs = (stage_inputs(0)[0], stage_inputs(2)[0])
    with pytest.raises(ValueError, match="parallelize a rank's modules together"):
        remat.apply(apart, xs, pipeline=pipe, plan="keep_all", block_types=("*.layers.*",))
