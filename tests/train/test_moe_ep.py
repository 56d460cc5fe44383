"""Expert parallel (`parallel.ep`, issue 52.3) and ZeRO on a tiny Qwen3-MoE (1 layer, 4 experts,
top-2, balance loss on) against the same 8 steps on one process (`moe_one`: losses, grad norms, the
routing metrics, every weight and moment within 1e-5), and resumed across layouts (52.4):

- ep 2 on 2 ranks, 8 steps; its step-4 checkpoint resumed on one process, whose step-6 checkpoint
  is resumed at ep 4 on 4 ranks (issue 52.4's chain ep 2 -> 1 process -> ep 4 -> ZeRO-3, whose last
  link is the killed run's below);
- ep 2 x 2 expert-data-parallel ranks with ZeRO-1 on 4 ranks, 8 steps;
- ZeRO-3 at ep 1 on 2 ranks, 8 steps (per-rank weight files; verify, export); resumed on one process;
- ep 2 with ZeRO-1 on 2 ranks killed (SIGKILL of rank 1) while rank 0 holds step 5's save open:
  equal to one process up to the kill, and its newest verified checkpoint (step 4) resumed on 4 ranks
  under ZeRO-3 at ep 1 redoes the lost steps and ends with the one process's weights.

The refusals of the config and of the plan: one line, exit 2, nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import EVAL_AT_END, NO_EVAL, REFERENCE_ARGS, TINY, assert_same_checkpoint, copy_run_at
from tests.helpers.cli import refused
from tests.helpers.killed import DEATH_BOUND_S, signal_rank, start_launch, wait_for_rank
from tests.helpers.runs import FINAL, grad_norms, kill_tree, losses, msrun, replica_hashes, resume_on_one_process, step_dir

MOE = ("model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4", "model.experts_per_token=2",
       "model.moe_ffn_dim=32", "model.router_aux_loss_coef=0.01", "train.log_every=1")
ONE = [*REFERENCE_ARGS, "--quiet", *MOE]
RESUME_AT = 4
# The killed run: rank 0 holds the save of step KILL_AT open after writing its model file (the
# fault hook of checkpoint/store.py, long enough that the kill lands first whatever the box's load):
# the newest checkpoint on disk is then half written, and the newest verified one is step KILL_AT - 1.
KILL_AT = RESUME_AT + 1


@pytest.fixture(scope="module")
def moe_one(tmp_path_factory, tiny_data) -> Path:
    """The one-process run every expert-parallel run must equal (with its final evaluation)."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("moe_one") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), *ONE, EVAL_AT_END]) == 0
    return run


# the 8 x 910B recipe's memory options (configs/qwen3-30b-a3b-zh-continue-8x910b.toml): bf16 Adam
# moments, the LM head and loss in chunks of tokens (here 24 of a micro-batch's 64: a ragged last one)
RECIPE = ("optim.moment_dtype=bf16", "optim.loss_chunk_tokens=24")
BF16_STEP = 2.0 ** -7  # neighbouring bf16 values: the moments' tolerance under RECIPE (conftest.py assert_same_checkpoint)


@pytest.fixture(scope="module")
def moe_one_recipe(tmp_path_factory, tiny_data) -> Path:
    """The one-process run with RECIPE's options, which the ZeRO-3 run must equal."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("moe_one_recipe") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), *ONE, *RECIPE, NO_EVAL]) == 0
    return run


def _moe_metrics(run: Path) -> dict[int, dict[str, float]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/")} for r in recs if "loss" in r}


def _same_moe_metrics(run: Path, one: Path, steps: range | None = None) -> None:
    """The routing metrics (expert load, balance loss) of `steps` (all of one's) as one process logged them."""
    want, got = _moe_metrics(one), _moe_metrics(run)
    for step in steps or want:
        assert set(got[step]) == set(want[step]), step
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


def _equal_from(run: Path, one: Path, first: int, moments_rtol: float | None = None) -> None:
    """Losses and grad norms of steps first..FINAL within 1e-5, and the final checkpoint's weights and
    moments (the moments within `moments_rtol` if given)."""
    a, b, ga, gb = losses(one), losses(run), grad_norms(one), grad_norms(run)
    for step in range(first, FINAL + 1):
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
        assert gb[step] == pytest.approx(ga[step], rel=1e-5), (step, ga[step], gb[step])
    assert_same_checkpoint(step_dir(run, FINAL), step_dir(one, FINAL), 1e-5, moments_rtol)


@pytest.mark.slow
@pytest.mark.msrun
def test_ep2_equals_one_process_then_resumes_on_one_and_at_ep4(tmp_path, tiny_data, moe_one, capsys):
    """ep=2 on 2 ranks: each rank holds 2 of the 4 experts, the tokens dispatched over both ranks.
    The balance loss is the one process's on the whole batch (its routing stats summed over the
    ranks), so the routing metrics agree too; each rank writes its experts' slices of the stacks
    under whole-model names (nothing gathered), which `checkpoints --verify`, `eval` and one process
    read whole (resumed: steps 5-8). Then issue 52.4's chain goes on: that one
    process's step-6 checkpoint cut at ep=4 on 4 ranks (one expert a rank, each rank reading its
    expert's weights and moments from the whole tensors) does steps 7-8, and every resumed leg ends
    with the unbroken run's weights and moments within 1e-5 (ep -> ZeRO-3: the killed run's test)."""
    from safetensors.numpy import load_file

    from mspretrain.checkpoint.model_shards import read_whole

    run = tmp_path / "ep2"
    msrun(tmp_path, tiny_data, run, "parallel.ep=2", EVAL_AT_END, args=ONE)
    assert "expert parallel over 2 ranks" in (run / "train.log").read_text()
    _equal_from(run, moe_one, 1)
    assert sorted(losses(run)) == list(range(1, FINAL + 1))
    _same_moe_metrics(run, moe_one)
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

    at = FINAL - 2
    ep4 = copy_run_at(resumed, tmp_path / "to-ep4", at)
    msrun(tmp_path, tiny_data, ep4, "parallel.ep=4", NO_EVAL, args=ONE, nproc=4)
    log = (ep4 / "train.log").read_text()
    assert f"resumed from step_{at:06d}" in log and "expert parallel over 4 ranks x 1 expert-data-parallel" in log
    _equal_from(ep4, moe_one, at + 1)
    _same_moe_metrics(ep4, moe_one, range(at + 1, FINAL + 1))
    for r in range(4):  # each rank wrote its one expert's slice; read back whole
        keys = load_file(str(step_dir(ep4, FINAL) / f"model-0000{r}-of-00004.safetensors"))
        assert f"layers.0.mlp.w13.weight@{r * n // 4}:{(r + 1) * n // 4}" in keys
    assert read_whole(step_dir(ep4, FINAL))["layers.0.mlp.w13.weight"].shape == (4, 64, 64)


@pytest.mark.slow
@pytest.mark.msrun
def test_ep2_by_edp2_with_zero1_on_4_ranks_equals_one_process(tmp_path, tiny_data, moe_one):
    """4 ranks at ep=2 x 2 expert-data-parallel ranks with ZeRO-1, from step 0: two ep groups (ranks
    0-1, 2-3) each cutting the experts, the ranks holding the same experts (0 and 2, 1 and 3) summing
    their gradients over their edp group; the other parameters' optimizer state sharded over the 4
    ranks, each rank's experts' state its own. The 8 steps' losses, grad norms and routing metrics and
    the final weights and moments equal the one process's within 1e-5; the checkpoints' shards hold
    every key once, the experts' slices in the files of edp rank 0's ranks (dp ranks 0 and 1)."""
    from safetensors.numpy import load_file

    run = tmp_path / "ep2-edp2"
    msrun(tmp_path, tiny_data, run, "parallel.ep=2", "optim.shard_optimizer=true", NO_EVAL, args=ONE, nproc=4)
    assert "expert parallel over 2 ranks x 2 expert-data-parallel" in (run / "train.log").read_text()
    assert sorted(losses(run)) == list(range(1, FINAL + 1))
    _equal_from(run, moe_one, 1)
    _same_moe_metrics(run, moe_one)
    hashes = replica_hashes(run)
    assert len(hashes) == 4 and len(set(hashes)) == 1
    shards = [set(load_file(str(f))) - {"opt_step"} for f in sorted(step_dir(run, FINAL).glob("optimizer-*-of-*.safetensors"))]
    assert len(shards) == 4 and sum(map(len, shards)) == len(set().union(*shards))  # sharded, no key twice
    n = 4 * 64 * 64  # the experts' state: the slices of edp rank 0's ranks (dp ranks 0 and 1), nothing whole
    assert "exp_avg.layers.0.mlp.w13.weight@0:8192" in shards[0] and f"exp_avg.layers.0.mlp.w13.weight@{n // 2}:{n}" in shards[1]
    assert not any(k.startswith("exp_avg.layers.0.mlp.w13") for k in shards[2] | shards[3])


@pytest.mark.msrun
def test_zero3_equals_one_process_and_resumes_on_one(tmp_path, tiny_data, moe_one_recipe):
    """ZeRO-3 on 2 ranks at ep=1, with the 8 x 910B recipe's bf16 moments and chunked loss (RECIPE):
    every weight (the router and the 3-D expert stacks too) a slice per rank, each MoE layer's
    gathered with the block's others; the routing stats summed over the ranks. Losses, grad norms,
    routing metrics and the final weights equal the one process's (the bf16 moments within one
    bf16 step); each rank writes
    its slices under whole-model names (`NAME@START:STOP`), which `checkpoints --verify` and
    `export` read (the one process's export within 1e-5), and one process resumes the step-4
    checkpoint to the same end."""
    import numpy as np
    from safetensors.numpy import load_file

    from mspretrain.cli import main
    from mspretrain.model.hf import read_hf_dir

    run = tmp_path / "zero3"
    msrun(tmp_path, tiny_data, run, "optim.shard_parameters=true", *RECIPE, NO_EVAL, args=ONE)
    assert "weights, optimizer state and gradients sharded over 2 ranks" in (run / "train.log").read_text()
    _equal_from(run, moe_one_recipe, 1, BF16_STEP)
    _same_moe_metrics(run, moe_one_recipe)
    weights = [set(load_file(str(step_dir(run, FINAL) / f"model-0000{r}-of-00002.safetensors"))) for r in (0, 1)]
    n = 4 * 64 * 64  # layers.0.mlp.w13.weight: (experts, 2 x moe_ffn_dim, dim)
    assert f"layers.0.mlp.w13.weight@0:{n // 2}" in weights[0] and f"layers.0.mlp.w13.weight@{n // 2}:{n}" in weights[1]
    assert not weights[0] & weights[1]
    hashes = replica_hashes(run)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # the per-rank files verify and export (per-expert HF tensors) the model one process exports
    assert main(["checkpoints", str(run), "--verify"]) == 0
    exported = {}
    for r in (run, moe_one_recipe):
        assert main(["export", str(r), "--format", "hf", "--out", str(tmp_path / f"hf-{r.name}"), "--quiet"]) == 0
        exported[r] = read_hf_dir(tmp_path / f"hf-{r.name}")[1]
    assert sorted(exported[run]) == sorted(exported[moe_one_recipe])
    assert exported[run]["layers.0.mlp.w13.weight"].shape == (4, 64, 64)  # read back from per-expert HF tensors
    for k, v in exported[moe_one_recipe].items():
        np.testing.assert_allclose(exported[run][k], v, rtol=0, atol=1e-5, err_msg=k)
    resumed = resume_on_one_process(run, tiny_data, tmp_path, RESUME_AT, *MOE, *RECIPE)
    _equal_from(resumed, moe_one_recipe, RESUME_AT + 1, BF16_STEP)


def _killed_ep2(tmp: Path, tiny_data: Path) -> dict:
    """ep=2 with ZeRO-1 on 2 ranks, the one process's config from step 0, its rank 1 SIGKILLed while
    rank 0 holds the save of step KILL_AT open mid-write (MSPRETRAIN_FAULT_SAVE_DELAY). Only drives
    the job and records what it saw and what it left in checkpoints/; the test asserts (and holds
    the msrun lock: conftest's autouse fixture)."""
    import signal
    import time

    run = tmp / "killed"
    held = run / "checkpoints" / f"step_{KILL_AT:06d}.tmp"
    with pytest.MonkeyPatch.context() as mp:  # the launch's environment only, not the resume's
        mp.setenv("MSPRETRAIN_FAULT_SAVE_DELAY", f"900@{KILL_AT}")
        proc = start_launch(tmp, tiny_data, run, *REFERENCE_ARGS, *MOE, "parallel.ep=2",
                            "optim.shard_optimizer=true", NO_EVAL)
    try:
        beat = wait_for_rank(run, 1, KILL_AT, proc)
        deadline = time.time() + 120
        while not (held / "model-00000-of-00002.safetensors").is_file():  # rank 0's save of KILL_AT is held from here
            assert proc.poll() is None and time.time() < deadline, proc.communicate() if proc.poll() is not None else "no held save"
            time.sleep(0.2)
    except BaseException:
        kill_tree(proc)
        raise
    err, took = signal_rank(proc, beat["pid"], signal.SIGKILL)
    ckpts = run / "checkpoints"
    left = {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(ckpts.iterdir()) if p.is_dir()}
    return {"run": run, "rc": proc.returncode, "err": err, "took": took, "before": losses(run), "left": left}


@pytest.mark.sigkill
@pytest.mark.slow
@pytest.mark.msrun
def test_killed_ep2_run_resumes_on_4_ranks_with_zero3(tmp_path, tiny_data, moe_one):
    """A killed expert-parallel run resumed at another layout and world size: ep=2 with ZeRO-1 on 2
    ranks, killed while step 5's save is half written, equals one process up to the kill (losses,
    grad norms, routing metrics, its step-4 checkpoint's weights and moments). What it left: the
    verified checkpoints of steps 1-4, rank 0's unfinished step_000005.tmp (the model file, no
    manifest) and rank 1's staged optimizer shard(s). Resumed on 4 ranks under ZeRO-3 at ep 1 (every
    weight a slice per rank, the experts whole on none), the run takes the newest verified
    checkpoint, removes the unfinished ones, redoes the lost steps with the losses one process
    logged for them, and ends with the one process's weights and moments (1e-5)."""
    from mspretrain.checkpoint import store

    k = _killed_ep2(tmp_path, tiny_data)
    run = k["run"]
    assert k["rc"] == 1, k["err"][-2000:]
    assert k["took"] <= DEATH_BOUND_S, k["took"]
    line = next(l for l in k["err"].splitlines() if l.startswith("error: "))
    assert line.startswith("error: rank 1 died at step "), line
    left = k["left"]
    assert [n for n in left if not n.endswith(".tmp")] == [step_dir(run, s).name for s in range(1, KILL_AT)], left
    assert left[f"step_{KILL_AT:06d}.tmp"] == ["model-00000-of-00002.safetensors"], left  # held mid-write: no manifest
    assert f"step_{KILL_AT:06d}.rank1.tmp" in left, left  # rank 1's shard of that save, staged
    assert all(store.verify(step_dir(run, s)) is None for s in range(1, KILL_AT))

    before, one = k["before"], losses(moe_one)
    redo = [s for s in sorted(before) if s >= KILL_AT]
    assert sorted(before) == list(range(1, max(redo) + 1)) and redo, sorted(before)  # steps past the last save lost
    for step in before:  # ep 2 x ZeRO-1 on 2 ranks, from step 0, as one process
        assert abs(before[step] - one[step]) <= 1e-5, (step, one[step], before[step])
        assert grad_norms(run)[step] == pytest.approx(grad_norms(moe_one)[step], rel=1e-5), step
    _same_moe_metrics(run, moe_one, range(1, max(redo) + 1))
    assert_same_checkpoint(step_dir(run, RESUME_AT), step_dir(moe_one, RESUME_AT), 1e-5)

    msrun(tmp_path, tiny_data, run, "optim.shard_parameters=true", NO_EVAL, args=ONE, nproc=4)
    log = (run / "train.log").read_text()
    assert f"removing unfinished checkpoint step_{KILL_AT:06d}.tmp" in log
    assert f"resumed from step_{RESUME_AT:06d}" in log
    assert "weights, optimizer state and gradients sharded over 4 ranks" in log
    after = losses(run)  # the redone steps' records come after the killed run's
    for step in redo:
        assert abs(after[step] - one[step]) <= 1e-5, (step, one[step], after[step])
    _equal_from(run, moe_one, KILL_AT)
    assert sorted(p.name for p in step_dir(run, FINAL).glob("model-*")) == [f"model-0000{r}-of-00004.safetensors" for r in range(4)]
    assert not list((run / "checkpoints").glob("*.tmp"))


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
