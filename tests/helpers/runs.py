"""Runs on two ranks and what runs write: `MSRUN`, `ARGS`/`STEPS`/`FINAL` (the session's
`reference_run`'s), `msrun`, `two_nodes`, `kill_tree`, `losses`, `final_nll`, `grad_norms`, `step_dir`,
`replica_hashes`, `read_tb_scalars`, `resume_on_one_process`, `assert_two_ranks_equal_one_process`,
`fp16_run_equals_one_process`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NO_EVAL, REFERENCE_ARGS, REFERENCE_STEPS, TINY

# msrun ships with MindSpore next to this interpreter; CI runs the venv's python without the venv on PATH.
MSRUN = shutil.which("msrun", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")

# The msrun runs use the config of the session's single-process `reference_run` (tests/conftest.py):
# 8 steps, a checkpoint after each, every grad norm logged; without its final evaluation (`NO_EVAL`).
ARGS = [*REFERENCE_ARGS, "--quiet", NO_EVAL]
STEPS = list(range(1, REFERENCE_STEPS + 1))
FINAL = REFERENCE_STEPS


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and everything under it (msrun and its workers are in their own groups)."""
    from mspretrain.launcher.watchdog import kill_tree as kill

    kill(proc.pid)
    proc.wait(timeout=30)


def msrun(tmp_path: Path, data: Path, run: Path, *extra: str, args: list[str] = ARGS, nproc: int = 2,
          timeout: float = 600) -> None:
    """`nproc` workers through `mspretrain launch` (which must find msrun and itself next to the
    interpreter: CI runs the venv's python without the venv on PATH, as here); the tiny config,
    `args` (the reference run's) and `extra`. Asserts exit 0, with the workers' logs."""
    from mspretrain.parallel.distributed import free_local_port

    logs = tmp_path / f"logs-{run.name}"
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", str(nproc), "--master-port", str(free_local_port()),
           "--log-dir", str(logs), "--", "train", "--config", str(TINY), "--data", str(data), "--run", str(run), *args, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "GLOG_v": "3"})
    try:
        proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # a timeout: msrun and its workers (own process groups) go too,
            kill_tree(proc)      # not left training beside the rest of the suite
    text = "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))
    assert proc.returncode == 0, text[-3000:]


def losses(run: Path) -> dict[int, float]:
    """step -> loss, from a run's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def final_nll(run: Path) -> float:
    """The valid NLL a run's final evaluation logged (its last metrics record)."""
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval/nll" in last, f"{run.name}: no evaluation at its last step: {sorted(last)}"
    return last["eval/nll"]


def grad_norms(run: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "grad_norm" in r}


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def replica_hashes(run: Path) -> list[str]:
    """Each rank's digest of its weights (ranks/rank_*.json): equal when the replicas agree."""
    return [json.loads(p.read_text())["weights_sha256"] for p in sorted((run / "ranks").glob("rank_*.json"))]


def two_nodes(tmp_path: Path, data: Path, run: Path, *args: str, timeout: float = 900) -> None:
    """Node 0 and node 1 as two `mspretrain launch --nodes 2` processes of one worker each, as two
    hosts would run them: both exit 0, one scheduler, each node its own log dir."""
    from mspretrain.parallel.distributed import free_local_port

    logs, port = tmp_path / f"logs-{run.name}", str(free_local_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "1", "--nodes", "2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", port, "--log-dir", str(logs),
               "--", "train", "--config", str(TINY), "--data", str(data), "--run", str(run), "--quiet", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "GLOG_v": "3"}))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        from mspretrain.launcher.watchdog import kill_tree

        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=30)
    logs_text = "".join(f.read_text(errors="replace")[-1500:] for f in sorted(logs.rglob("*.log")))
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node}: {out[-2000:]}\n{logs_text}"
    # one scheduler, each node its own log dir (two schedulers would fight over the port and scheduler.log)
    assert (logs / "node_0" / "scheduler.log").is_file() and (logs / "node_0" / "worker_0.log").is_file()
    assert (logs / "node_1" / "worker_1.log").is_file()


def resume_on_one_process(run: Path, data: Path, tmp_path: Path, at: int, *extra: str) -> Path:
    """A copy of `run` as it was after the save of step `at`, resumed to the end by one process
    (the tiny config, `ARGS`, `extra`)."""
    from mspretrain.cli import main

    resumed = tmp_path / f"resumed-{run.name}"
    shutil.copytree(run, resumed)
    for step in range(at + 1, FINAL + 1):
        shutil.rmtree(step_dir(resumed, step))
    (resumed / "metrics.jsonl").write_text("".join(l + "\n" for l in (resumed / "metrics.jsonl").read_text().splitlines()
                                                   if json.loads(l).get("step", 0) <= at))
    assert main(["train", "--config", str(TINY), "--data", str(data), "--run", str(resumed), *ARGS, *extra]) == 0
    assert f"resumed from step_{at:06d}" in (resumed / "train.log").read_text()
    return resumed


def assert_two_ranks_equal_one_process(two: Path, reference_run: Path, data: Path, tmp_path: Path) -> Path:
    """A 2-rank run against the one-process reference: losses (1e-5), grad norms (rel 1e-5), the
    final checkpoint, identical replicas; then resumed from its step 5 on one process, the same
    losses and grad norms to the end. Returns the resumed run dir."""
    from tests.conftest import assert_same_checkpoint

    one, got = losses(reference_run), losses(two)
    assert sorted(got) == STEPS
    for step in one:
        assert abs(one[step] - got[step]) <= 1e-5, (step, one[step], got[step])
    one_gn, got_gn = grad_norms(reference_run), grad_norms(two)
    for step in one_gn:
        assert got_gn[step] == pytest.approx(one_gn[step], rel=1e-5), (step, one_gn[step], got_gn[step])
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert_same_checkpoint(step_dir(two, FINAL), step_dir(reference_run, FINAL), 1e-5)

    resumed = resume_on_one_process(two, data, tmp_path, 5)
    after, after_gn = losses(resumed), grad_norms(resumed)
    for step in range(6, FINAL + 1):
        assert abs(after[step] - one[step]) <= 1e-5, (step, one[step], after[step])
        assert after_gn[step] == pytest.approx(one_gn[step], rel=1e-5)
    return resumed


def fp16_run_equals_one_process(two: Path, one: Path) -> tuple[dict, dict]:
    """A 2-worker fp16 run against the same config on one process: losses, identical replicas,
    the final checkpoint. Returns both runs' losses by step."""
    from tests.conftest import assert_same_checkpoint

    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == STEPS
    # The two ranks sum the gradients in another order, and fp16 weights can round the other way
    # from there (one fp16 ulp of a weight is ~1e-3 relative): measured 1.7e-5 at step 7 of 8 with
    # the initial weights drawn otherwise, and 1.2e-5 at step 3 (ZeRO-2, bucket_mb 0) with the
    # counter-based draw; a loss of ~6.2, so 3e-5 is 5e-6 relative.
    for step in a:
        assert abs(a[step] - b[step]) <= (3e-5 if step <= 5 else 1e-4), (step, a[step], b[step])
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # fp16 weights: one ulp is ~1e-3 relative, and summation order flips some roundings (measured
    # 1.6e-4 and 7.7e-4 in two runs), as in the fp16-wire test of test_distributed.py
    assert_same_checkpoint(step_dir(two, FINAL), step_dir(one, FINAL), 5e-3)
    return a, b


def read_tb_scalars(tb_dir: Path) -> dict[str, list[int]]:
    """tag -> steps, from TensorBoard event files: TensorBoard's own reader when it is installed,
    else the TFRecord framing (u64 length, u32 crc, payload, u32 crc) parsed with the Event proto."""
    import struct

    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[int]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            payload = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            ev = Event.FromString(payload)
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append(ev.step)
    return out
