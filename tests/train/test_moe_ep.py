"""Expert parallel (`parallel.ep`, issue 52.3) against one process: a tiny Qwen3-MoE (1 layer, 4
experts, top-2, balance loss on) trained 8 steps at ep=2 on 2 msrun CPU ranks equals the same
run on one process (losses, grad norms, the routing metrics, every weight and moment); its step-4
checkpoint resumes on one process, and the one process's step-4 checkpoint resumes on 4 ranks at
ep=2 x 2 expert-data-parallel ranks with ZeRO-1, each equal to the unbroken run. The refusals of
the config and of the plan: one line, exit 2, nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import EVAL_AT_END, NO_EVAL, REFERENCE_ARGS, TINY, assert_same_checkpoint, copy_run_at
from tests.helpers.cli import refused
from tests.helpers.runs import FINAL, grad_norms, losses, msrun, replica_hashes, resume_on_one_process, step_dir

MOE = ("model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4", "model.experts_per_token=2",
       "model.moe_ffn_dim=32", "model.router_aux_loss_coef=0.01", "train.log_every=1")
ONE = [*REFERENCE_ARGS, "--quiet", *MOE]
RESUME_AT = 4


@pytest.fixture(scope="module")
def moe_one(tmp_path_factory, tiny_data) -> Path:
    """The one-process run every expert-parallel run must equal (with its final evaluation)."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("moe_one") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), *ONE, EVAL_AT_END]) == 0
    return run


def _moe_metrics(run: Path) -> dict[int, dict[str, float]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/")} for r in recs if "loss" in r}


def _equal_from(run: Path, one: Path, first: int) -> None:
    """Losses and grad norms of steps first..FINAL within 1e-5, and the final checkpoint's weights and moments."""
    a, b, ga, gb = losses(one), losses(run), grad_norms(one), grad_norms(run)
    for step in range(first, FINAL + 1):
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
        assert gb[step] == pytest.approx(ga[step], rel=1e-5), (step, ga[step], gb[step])
    assert_same_checkpoint(step_dir(run, FINAL), step_dir(one, FINAL), 1e-5)


@pytest.mark.msrun
def test_ep2_equals_one_process_and_resumes_on_one(tmp_path, tiny_data, moe_one, capsys):
    """ep=2 on 2 ranks: each rank holds 2 of the 4 experts, the tokens dispatched over both ranks.
    The balance loss is the one process's on the whole batch (its routing stats summed over the
    ranks), so the routing metrics agree too; the checkpoints hold whole experts under whole-model
    names (each rank's experts' slices in its own files, nothing gathered), which one process resumes."""
    run = tmp_path / "ep2"
    msrun(tmp_path, tiny_data, run, "parallel.ep=2", EVAL_AT_END, args=ONE)
    assert "expert parallel over 2 ranks" in (run / "train.log").read_text()
    _equal_from(run, moe_one, 1)
    assert sorted(losses(run)) == list(range(1, FINAL + 1))
    want, got = _moe_metrics(moe_one), _moe_metrics(run)
    for step in want:
        assert set(got[step]) == set(want[step])
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    last = lambda r: json.loads((r / "metrics.jsonl").read_text().splitlines()[-1])["eval/nll"]  # noqa: E731
    assert last(run) == pytest.approx(last(moe_one), rel=1e-5)  # the evaluation runs expert parallel too
    hashes = replica_hashes(run)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # the whole model's digest, gathered over the ep group
    # nothing gathered for a save: each rank wrote its experts' slice of the stacks (weights and
    # moments), rank 0 the rest; one process reads them whole
    from safetensors import safe_open

    n = 4 * 64 * 64  # layers.0.mlp.w13.weight: (experts, 2 x moe_ffn_dim, dim)
    for r, lo, hi in ((0, 0, n // 2), (1, n // 2, n)):
        for kind, prefix in (("model", ""), ("optimizer", "exp_avg.")):
            with safe_open(str(step_dir(run, FINAL) / f"{kind}-0000{r}-of-00002.safetensors"), "numpy") as f:
                keys = set(f.keys())
            assert f"{prefix}layers.0.mlp.w13.weight@{lo}:{hi}" in keys and f"{prefix}layers.0.mlp.w13.weight" not in keys
            assert (f"{prefix}layers.0.attn.wo.weight" in keys) == (r == 0)
    # and every reader takes them: `checkpoints --verify`, `eval` (the one process's numbers)
    from mspretrain.cli import main

    assert main(["checkpoints", str(run), "--verify"]) == 0
    scores = []
    for r in (run, moe_one):
        capsys.readouterr()
        assert main(["eval", str(r), "--json", "--batch-size", "3", "--quiet"]) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert scores[0]["nll"] == pytest.approx(scores[1]["nll"], rel=1e-5) and scores[0]["tokens"] == scores[1]["tokens"]
    resumed = resume_on_one_process(run, tiny_data, tmp_path, RESUME_AT, *MOE)
    _equal_from(resumed, moe_one, RESUME_AT + 1)


@pytest.mark.msrun
def test_one_process_checkpoint_resumes_at_ep2_by_edp2_with_zero1(tmp_path, tiny_data, moe_one):
    """The one process's step-4 checkpoint (whole experts) resumed by 4 ranks at ep=2 x 2 expert-data-
    parallel ranks with ZeRO-1: two ep groups (ranks 0-1, 2-3) each cutting the experts, the ranks
    holding the same experts (0 and 2, 1 and 3) summing their gradients over their edp group; the
    other parameters' optimizer state sharded over the 4 ranks, each rank's experts' state its own.
    Steps 5-8 and the final weights and moments equal the unbroken one-process run within 1e-5; the
    checkpoints' shards hold every key once, the experts' slices in the files of edp rank 0's ranks."""
    from safetensors.numpy import load_file

    run = copy_run_at(moe_one, tmp_path / "to-ep2", RESUME_AT)
    msrun(tmp_path, tiny_data, run, "parallel.ep=2", "optim.shard_optimizer=true", NO_EVAL, args=ONE, nproc=4)
    assert f"resumed from step_{RESUME_AT:06d}" in (run / "train.log").read_text()
    _equal_from(run, moe_one, RESUME_AT + 1)
    shards = [set(load_file(str(f))) - {"opt_step"} for f in sorted(step_dir(run, FINAL).glob("optimizer-*-of-*.safetensors"))]
    assert len(shards) == 4 and sum(map(len, shards)) == len(set().union(*shards))  # sharded, no key twice
    n = 4 * 64 * 64  # the experts' state: the slices of edp rank 0's ranks (dp ranks 0 and 1), nothing whole
    assert "exp_avg.layers.0.mlp.w13.weight@0:8192" in shards[0] and f"exp_avg.layers.0.mlp.w13.weight@{n // 2}:{n}" in shards[1]
    assert not any(k.startswith("exp_avg.layers.0.mlp.w13") for k in shards[2] | shards[3])


@pytest.mark.msrun
def test_zero3_equals_one_process_and_resumes_on_one(tmp_path, tiny_data, moe_one):
    """ZeRO-3 on 2 ranks at ep=1: every weight (the router and the 3-D expert stacks too) a slice
    per rank, each MoE layer's gathered with the block's others; the routing stats summed over the
    ranks. Losses, grad norms, routing metrics and the final weights and moments equal the one
    process's; each rank writes its slices under whole-model names (`NAME@START:STOP`), which
    `checkpoints --verify` and `export` read (the one process's export within 1e-5), and one
    process resumes the step-4 checkpoint to the same end."""
    import numpy as np
    from safetensors.numpy import load_file

    from mspretrain.cli import main
    from mspretrain.model.hf import read_hf_dir

    run = tmp_path / "zero3"
    msrun(tmp_path, tiny_data, run, "optim.shard_parameters=true", NO_EVAL, args=ONE)
    assert "weights, optimizer state and gradients sharded over 2 ranks" in (run / "train.log").read_text()
    _equal_from(run, moe_one, 1)
    want, got = _moe_metrics(moe_one), _moe_metrics(run)
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    weights = [set(load_file(str(step_dir(run, FINAL) / f"model-0000{r}-of-00002.safetensors"))) for r in (0, 1)]
    n = 4 * 64 * 64  # layers.0.mlp.w13.weight: (experts, 2 x moe_ffn_dim, dim)
    assert f"layers.0.mlp.w13.weight@0:{n // 2}" in weights[0] and f"layers.0.mlp.w13.weight@{n // 2}:{n}" in weights[1]
    assert not weights[0] & weights[1]
    hashes = replica_hashes(run)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # the per-rank files verify and export (per-expert HF tensors) the model one process exports
    assert main(["checkpoints", str(run), "--verify"]) == 0
    exported = {}
    for r in (run, moe_one):
        assert main(["export", str(r), "--format", "hf", "--out", str(tmp_path / f"hf-{r.name}"), "--quiet"]) == 0
        exported[r] = read_hf_dir(tmp_path / f"hf-{r.name}")[1]
    assert sorted(exported[run]) == sorted(exported[moe_one])
    assert exported[run]["layers.0.mlp.w13.weight"].shape == (4, 64, 64)  # read back from per-expert HF tensors
    for k, v in exported[moe_one].items():
        np.testing.assert_allclose(exported[run][k], v, rtol=0, atol=1e-5, err_msg=k)
    resumed = resume_on_one_process(run, tiny_data, tmp_path, RESUME_AT, *MOE)
    _equal_from(resumed, moe_one, RESUME_AT + 1)


def test_ep_refusals(tmp_path, tiny_data, capsys):
    """One line each naming the key, exit 2, no run dir: a dense model, an ep that does not divide the
    experts or the data-parallel ranks (one process here), tp, the capacity factor, the EMA or ZeRO-3
    with ep, ep 0."""
    base = ("train", "--config", TINY, "--data", tiny_data, "--run", tmp_path / "r", "train.max_steps=1")
    cases = [((), "parallel.ep=2", "needs a mixture-of-experts model"),
             (MOE, "parallel.ep=3", "does not divide model.num_experts = 4"),
             (MOE, "parallel.ep=2", "does not divide the 1 data-parallel ranks"),
             ((*MOE, "parallel.tp=2"), "parallel.ep=2", "parallel.tp is not supported with expert parallel"),
             ((*MOE, "model.capacity_factor=1.0"), "parallel.ep=2", "model.capacity_factor is not supported with expert parallel"),
             ((*MOE, "train.ema_decay=0.99"), "parallel.ep=2", "train.ema_decay is not supported with expert parallel"),
             ((*MOE, "optim.shard_parameters=true"), "parallel.ep=2", "and expert parallel (parallel.ep = 2) yet"),
             ((), "parallel.ep=0", "parallel.ep = 0 must be at least 1")]
    for extra, key, says in cases:
        err = refused(capsys, *base, *extra, key)
        assert says in err and len(err.strip().splitlines()) <= 2, err
        assert not (tmp_path / "r").exists()
