"""Data parallel under msrun (CPU backend mccl) against a single process with the same global batch."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mspretrain import world as world_mod
from mspretrain.errors import UserError
from mspretrain.parallel import distributed
from tests.conftest import NO_EVAL, TINY, assert_close_rel, assert_same_checkpoint, copy_run_at, relative_error
from tests.helpers.killed import DEATH_BOUND_S, LONG, ended_within, signal_rank, start_launch, wait_for_beat_after, wait_for_rank
from tests.helpers.runs import ARGS, FINAL, MSRUN, STEPS, final_nll, grad_norms, kill_tree, losses, msrun, replica_hashes, step_dir


def test_rank_detection():
    assert world_mod.detect({}) is None
    env = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118", "RANK_ID": "1"}
    assert world_mod.detect(env) == world_mod.World(rank=1, size=2)
    with pytest.raises(UserError, match="half set"):
        world_mod.detect({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2"})
    with pytest.raises(UserError, match="outside"):
        world_mod.detect({**env, "RANK_ID": "5"})
    line = distributed.msrun_command(8, ["train", "--config", "c.toml"], nodes=2, node_rank=1, master_addr="10.0.0.1")
    assert "--worker_num=16" in line and "--local_worker_num=8" in line and "--node_rank=1" in line


def test_launch_builds_the_msrun_line_and_refuses_bad_input(capsys):
    from mspretrain.cli import main

    assert main(["launch", "--nproc", "8", "--nodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--dry-run",
                 "--", "train", "--config", "c.toml", "--data", "d", "--run", "r", "train.max_steps=5"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("msrun --worker_num=16 --local_worker_num=8 --master_addr=10.0.0.1 --master_port=8118 --node_rank=1")
    assert line.endswith("mspretrain train --config c.toml --data d --run r train.max_steps=5")
    assert main(["launch", "--nproc", "2", "--dry-run"]) == 2
    assert "no command to launch" in capsys.readouterr().err
    assert main(["launch", "--nproc", "2", "--nodes", "2", "--node-rank", "2", "--", "train"]) == 2
    assert "do not describe a cluster" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_two_ranks_match_one_process(tmp_path, tiny_data, reference_run, wire, request):
    """Losses, grad norms and the final model and optimizer files of 2 msrun ranks against one
    process. The losses alone cannot see a gradient scale: clipping and Adam hide it from the
    weights for a while; the grad norm and the moments show it at once."""
    if wire == "fp32":  # the session's run (conftest: two "nodes" of one worker), also checked in test_multinode.py and
        # compared with per-parameter AllReduce on one 2-worker msrun in test_zero2.py
        two = request.getfixturevalue("two_ranks_fp32")
    else:  # fp16 on the wire needs loss scaling (config.validate); a static power-of-two scale is exact in fp32
        two = tmp_path / f"two-{wire}"
        msrun(tmp_path, tiny_data, two, f"precision.allreduce_dtype={wire}", "precision.loss_scale=static")
    one, got = losses(reference_run), losses(two)
    assert sorted(one) == sorted(got) == STEPS
    tol = 1e-5 if wire == "fp32" else 1e-3  # fp16 on the wire rounds each gradient to 11 bits
    for step in one:
        assert abs(one[step] - got[step]) <= tol, (step, one[step], got[step])
    # measured: fp32 wire <= 1e-7 (grad norms), 1.1e-6 (weights and moments); fp16 wire 1.1e-5, 6.6e-4
    norm_tol, state_tol = (1e-5, 1e-5) if wire == "fp32" else (1e-4, 5e-3)
    one_gn, got_gn = grad_norms(reference_run), grad_norms(two)
    assert sorted(one_gn) == sorted(got_gn) == STEPS
    for step in one_gn:
        assert got_gn[step] == pytest.approx(one_gn[step], rel=norm_tol), (step, one_gn[step], got_gn[step])
    assert_same_checkpoint(step_dir(two, FINAL), step_dir(reference_run, FINAL), state_tol)
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # replicas stayed identical
    if wire == "fp16":
        _lm_head_crossed_in_fp32(step_dir(two, 1), step_dir(reference_run, 1))
        assert "eval/nll" not in json.loads((two / "metrics.jsonl").read_text().splitlines()[-1])  # eval.at_end=false
    else:  # the final evaluation on 2 ranks (each scores the whole valid split) equals one process's (measured 1.3e-9)
        assert final_nll(two) == pytest.approx(final_nll(reference_run), rel=1e-6)


def _lm_head_crossed_in_fp32(two: Path, one: Path) -> None:
    """The fp16 wire exempts lm_head (the field report's exemption): seen from outside, after one
    step lm_head's first moment (0.1 x its clipped gradient) is the single process's to fp32
    rounding, and every other parameter's carries fp16's 11-bit rounding. Up to one common factor:
    the clipping coefficient, which sees the other gradients' rounding through the global norm."""
    from safetensors.numpy import load_file

    got = {}
    for f in two.glob("optimizer*.safetensors"):
        got.update(load_file(str(f)))
    want = load_file(str(one / "optimizer.safetensors"))

    def error_up_to_a_factor(k: str) -> float:
        g, w = got[k].astype(np.float64).ravel(), want[k].astype(np.float64).ravel()
        return relative_error(g, (g @ w / (w @ w)) * w)

    names = sorted(k for k in want if k.startswith("exp_avg."))
    assert "exp_avg.lm_head.weight" in names
    errors = {k: error_up_to_a_factor(k) for k in names}
    # measured: lm_head 1.4e-7 (fp32 rounding; an fp16 lm_head gives ~3e-4), the others 2.6e-4 to 3.3e-4
    assert errors.pop("exp_avg.lm_head.weight") <= 1e-5
    assert min(errors.values()) >= 1e-4, errors  # the others really crossed in fp16


def test_owner_table_is_balanced_and_deterministic():
    from mspretrain.step.step import assign_owners

    sizes = [4096, 64, 4096, 64, 2048, 2048, 64]
    owners = assign_owners(sizes, 2)
    assert owners == assign_owners(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert max(load) - min(load) <= 64  # within the smallest parameter of even
    # the rule itself, by hand: largest first, each to the rank holding the fewest *elements* so far
    # (ties to the lower rank); balancing parameter counts instead gives [0, 1, 0, 1, 0, 1]
    assert assign_owners([6, 5, 4, 3, 3, 3], 2) == [0, 1, 1, 0, 0, 1]
    assert assign_owners(sizes, 1) == [0] * len(sizes)
    assert set(assign_owners(sizes, 3)) == {0, 1, 2}


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_optimizer_matches_one_process_and_resumes_anywhere(tmp_path, tiny_data, reference_run):
    """ZeRO-1 on 2 msrun workers: same losses and grad norms as one unsharded process, identical
    replicas, one optimizer shard per rank whose union is the unsharded state; a single process
    resumes it and, after resumed updates, has the weights and moments of the unbroken run."""
    from safetensors.numpy import load_file

    from mspretrain.checkpoint import store
    from mspretrain.cli import main

    two = tmp_path / "two-sharded"
    msrun(tmp_path, tiny_data, two, "optim.shard_optimizer=true")
    one, got = losses(reference_run), losses(two)
    assert sorted(got) == STEPS
    for step in one:
        assert abs(one[step] - got[step]) <= 1e-5, (step, one[step], got[step])
    one_gn, got_gn = grad_norms(reference_run), grad_norms(two)
    assert sorted(got_gn) == STEPS
    for step in one_gn:
        assert got_gn[step] == pytest.approx(one_gn[step], rel=1e-5), (step, one_gn[step], got_gn[step])
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]

    final = step_dir(two, FINAL)
    assert store.verify(final) is None
    names = sorted(p.name for p in final.iterdir())
    assert "optimizer-00000-of-00002.safetensors" in names and "optimizer-00001-of-00002.safetensors" in names
    assert not list((two / "checkpoints").glob("*.tmp"))  # staging dirs were moved in and removed
    shard0, shard1 = (load_file(str(final / f"optimizer-0000{r}-of-00002.safetensors")) for r in (0, 1))
    moments = lambda d: {k for k in d if k != "opt_step"}
    assert moments(shard0) and moments(shard1) and not moments(shard0) & moments(shard1)
    union = {**shard0, **shard1}
    ref = load_file(str(step_dir(reference_run, FINAL) / "optimizer.safetensors"))
    assert set(union) == set(ref)
    for k, v in ref.items():
        assert abs(union[k].astype("float64") - v).max() <= 1e-6, k
        if k != "opt_step":  # most exp_avg_sq values are below 1e-6: the line above cannot see them
            assert_close_rel(union[k], v, 1e-5, k)  # measured <= 7e-7
    assert_same_checkpoint(final, step_dir(reference_run, FINAL), 1e-5)

    # One unsharded process resumes the 2-rank sharded checkpoint of step 5 and takes 3 more
    # updates. Step 6's loss is a forward pass on step-5 weights and cannot see the resumed
    # moments; the weights, moments and grad norms after the resumed updates can.
    resume_at = 5
    resumed = copy_run_at(two, tmp_path / "resumed", resume_at)
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(resumed), *ARGS]) == 0
    assert f"resumed from step_{resume_at:06d}" in (resumed / "train.log").read_text()
    after, after_gn = losses(resumed), grad_norms(resumed)
    for step in range(resume_at + 1, FINAL + 1):
        assert abs(after[step] - one[step]) <= 1e-5, (step, one[step], after[step])
        assert after_gn[step] == pytest.approx(one_gn[step], rel=1e-5), (step, one_gn[step], after_gn[step])
    for step in range(resume_at + 1, FINAL + 1):  # after the first resumed update, and after the last
        assert_same_checkpoint(step_dir(resumed, step), step_dir(reference_run, step), 1e-5)
    # the audit follows the history across the change of world size: exact, and it says so
    from mspretrain.forensics.audit import audit_run

    audit = audit_run(resumed)
    assert audit.exact, audit.findings
    assert [r["world"] for r in audit.resumes] == [1] and "world size 2 -> 1 at step 6" in audit.notes


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_fp16_wire_overflow_skips_the_step_on_every_rank(tmp_path, tiny_data):
    """Scaled gradients that fit fp32 but not fp16 (max 65,504) overflow on the wire only: every
    rank sees the same inf after the all-reduce, so all skip the update and halve the scale
    together, and the replicas stay equal. (One process has no wire: it would not skip.)"""
    run = tmp_path / "overflow"
    msrun(tmp_path, tiny_data, run, "precision.allreduce_dtype=fp16", "precision.loss_scale=dynamic",
           f"precision.init_scale={2.0 ** 24}", "metrics.loss_scale_every=1",
           args=["train.max_steps=6", "checkpoint.every=0", "--quiet", NO_EVAL])
    recs = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[0]["skipped"] == 1, recs[0]  # 2^24 x a gradient of ~0.004 is past fp16's range
    assert 0 < recs[-1]["skipped"] < 6, recs[-1]  # the scale came down until steps applied again
    state = json.loads((step_dir(run, 6) / "train_state.json").read_text())
    assert state["skipped_steps"] == recs[-1]["skipped"] and state["applied_steps"] == 6 - recs[-1]["skipped"]
    assert state["loss_scale"]["scale"] < 2.0 ** 24
    hashes = replica_hashes(run)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # both ranks skipped the same steps


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_spike_rewind_under_msrun_matches_one_process(rewind_one_process, two_nodes_rewind):
    """Spike `rewind` on 2 sharded ranks: both reload the same checkpoint (the newest save of the
    run, waited for until rank 0 has published it) and the run equals one process's, rewinds included.
    The 2 ranks are the session's `two_nodes_rewind` (conftest; tests/launch/test_multinode.py checks its
    shards and final state)."""
    one, two = rewind_one_process, two_nodes_rewind

    def series(run):
        return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    a, b = series(one), series(two)
    assert [s for s, _ in a] == [s for s, _ in b] and len(a) > 14  # the rewinds repeated steps
    # lr 10x the reference's: fp32 summation order differs between ranks and one process, and the
    # high lr amplifies it (measured 1.6e-5 by step 19 with the counter-based initial weights)
    assert all(abs(x - y) <= 5e-5 for (_, x), (_, y) in zip(a, b))
    assert "rewound to step_000012" in (two / "train.log").read_text()
    from mspretrain.forensics.audit import audit_run

    for run in (one, two):  # rewinds repeat steps by design: the audit follows them and finds nothing
        audit = audit_run(run)
        assert audit.exact and audit.rewinds, (run.name, audit.findings)
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]


# ---------------------------------------------------------------- a rank dies or stops

STOP_GRACE = 25  # long enough to run `diagnose --hang` on the live hang first


@pytest.fixture(scope="module")
def killed_then_stopped(tmp_path_factory, tiny_data) -> dict:
    """One job sequence for the two tests below (one msrun start-up and compilation fewer than a
    job each): a 400-step job whose rank 1 is SIGKILLed after step 5; then its relaunch, which
    resumes and, once past the steps it redid, has rank 1 SIGSTOPped. Each test asserts on its
    half; this only drives the processes and records what it saw."""
    import contextlib
    import io
    import signal
    import time

    from mspretrain.checkpoint import store
    from mspretrain.cli import main

    tmp = tmp_path_factory.mktemp("death")
    run, out = tmp / "killed", {}
    proc = start_launch(tmp, tiny_data, run, *LONG)
    try:
        beat = wait_for_rank(run, 1, 5, proc)
    except BaseException:
        kill_tree(proc)
        raise
    err, took = signal_rank(proc, beat["pid"], signal.SIGKILL)
    killed_pid = beat["pid"]
    out["killed"] = {"rc": proc.returncode, "err": err, "took": took, "before": losses(run)}
    # The relaunch resumes from the newest verified checkpoint, and the steps it redoes must give the
    # losses the killed job logged for them. The kill may land just after a save, leaving nothing
    # to redo: the newer checkpoints are set aside so that it starts from the oldest one kept.
    kept = sorted(p for p in (run / "checkpoints").glob("step_*[0-9]") if store.verify(p) is None)
    for p in kept[1:]:
        shutil.rmtree(p)
    resume_at = int(kept[0].name.split("_")[1])
    redo = [s for s in out["killed"]["before"] if s > resume_at]
    out["relaunch"] = {"resume_at": resume_at, "redo": redo}
    if not redo:
        return out
    proc = start_launch(tmp, tiny_data, run, *LONG, launch=("--stop-grace", str(STOP_GRACE)))
    try:
        beat = wait_for_rank(run, 1, max(redo) + 1, proc, not_pid=killed_pid)  # past every redone step
        t0 = time.time()
        os.kill(beat["pid"], signal.SIGSTOP)
        time.sleep(3)  # rank 0 runs into the next step's collective and waits there
        # and its heartbeat is one written since the stop (its thread beats every 2 s, later on a
        # loaded box): an older one can be steps behind rank 1's last, and diagnose then names
        # rank 0 "behind" as well
        wait_for_beat_after(run, 0, t0, proc)
        with contextlib.redirect_stdout(io.StringIO()) as live:
            live_rc = main(["diagnose", str(run), "--hang"])
        err, took = ended_within(proc, t0)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    with contextlib.redirect_stdout(io.StringIO()) as after:
        after_rc = main(["diagnose", str(run), "--hang"])
    out["relaunch"].update(log=(run / "train.log").read_text(), after=losses(run))
    out["stopped"] = {"rc": proc.returncode, "err": err, "took": took, "live_rc": live_rc, "live": live.getvalue(),
                      "after_rc": after_rc, "after": after.getvalue()}
    return out


@pytest.mark.sigkill
@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_killed_worker_ends_the_job_naming_the_rank_and_relaunch_resumes_exactly(killed_then_stopped):
    killed, relaunch = killed_then_stopped["killed"], killed_then_stopped["relaunch"]
    assert killed["rc"] == 1, killed["err"][-2000:]
    assert killed["took"] <= DEATH_BOUND_S, killed["took"]
    line = next(l for l in killed["err"].splitlines() if l.startswith("error: "))
    assert line.startswith("error: rank 1 died at step "), line  # rank 0 was ended with the job, not named
    # relaunch: resumes from the newest verified checkpoint kept, and the steps it redoes give the
    # losses the killed job logged for them (same data, same world size: bit-exact on CPU)
    before, redo = killed["before"], relaunch["redo"]
    assert redo, (relaunch["resume_at"], sorted(before))
    assert f"resumed from step_{relaunch['resume_at']:06d}" in relaunch["log"]
    after = relaunch["after"]
    for step in redo:
        assert after[step] == pytest.approx(before[step], abs=1e-6), (step, before[step], after[step])
    assert max(after) > max(redo)


@pytest.mark.sigkill
@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_stopped_worker_is_named_by_diagnose_and_the_job_ends(killed_then_stopped):
    """The relaunched job of the test above, its rank 1 stopped (SIGSTOP) with `--stop-grace 25`."""
    assert "stopped" in killed_then_stopped, "the relaunch never ran (the kill left nothing to redo)"
    stopped = killed_then_stopped["stopped"]
    live = stopped["live"]
    assert stopped["live_rc"] == 1, live
    lag = [l for l in live.splitlines() if l.startswith("LAGGING")]
    assert len(lag) == 1 and lag[0].startswith("LAGGING: rank 1 is stopped (process "), live
    assert " at step " in lag[0] and "(phase " in lag[0]
    assert stopped["rc"] == 1, stopped["err"][-2000:]
    assert STOP_GRACE <= stopped["took"] <= DEATH_BOUND_S, stopped["took"]
    line = next(l for l in stopped["err"].splitlines() if l.startswith("error: "))
    assert line.startswith("error: rank 1 stopped at step ") and "(phase " in line, line
    # afterwards every process is gone; the watchdog's verdict still names the stopped rank
    assert stopped["after_rc"] == 1
    assert "LAGGING: rank 1 stopped at step " in stopped["after"] and "ended with it" in stopped["after"]
