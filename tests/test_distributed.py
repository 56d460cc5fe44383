"""Data parallel under msrun (CPU backend mccl) against a single process with the same global batch."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mspretrain.errors import UserError
from mspretrain.train import distributed
from tests.conftest import TINY


def _metrics(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_detection():
    assert distributed.detect({}) is None
    env = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118", "RANK_ID": "1"}
    assert distributed.detect(env) == distributed.World(rank=1, size=2)
    with pytest.raises(UserError, match="half set"):
        distributed.detect({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2"})
    with pytest.raises(UserError, match="outside"):
        distributed.detect({**env, "RANK_ID": "5"})
    with pytest.raises(UserError, match="Ascend-only"):
        distributed.check_zero("cpu", True)
    line = distributed.msrun_command(8, ["train", "--config", "c.toml"], nodes=2, node_rank=1, master_addr="10.0.0.1")
    assert "--worker_num=16" in line and "--local_worker_num=8" in line and "--node_rank=1" in line


ARGS = ["train.max_steps=5", "checkpoint.every=0", "--quiet"]


def _msrun(tmp_path: Path, data: Path, run: Path, *extra: str) -> None:
    exe = shutil.which("mspretrain") or str(Path(sys.executable).with_name("mspretrain"))
    logs = tmp_path / f"logs-{run.name}"
    cmd = [MSRUN, "--worker_num=2", "--local_worker_num=2", f"--master_port={_free_port()}", f"--log_dir={logs}",
           "--join=True", exe, "train", "--config", str(TINY), "--data", str(data), "--run", str(run), *ARGS, *extra]
    env = {**os.environ, "GLOG_v": "3", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    text = "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))
    assert proc.returncode == 0, text[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_data) -> Path:
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("dp") / "one"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), *ARGS]) == 0
    return run


def _replica_hashes(run: Path) -> list[str]:
    return [json.loads(p.read_text())["weights_sha256"] for p in sorted((run / "ranks").glob("rank_*.json"))]


# msrun ships with MindSpore next to this interpreter; CI runs the venv's python without the venv on PATH.
MSRUN = shutil.which("msrun", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_two_ranks_match_one_process(tmp_path, tiny_data, one_process, wire):
    two = tmp_path / f"two-{wire}"
    _msrun(tmp_path, tiny_data, two, f"precision.allreduce_dtype={wire}")
    one, got = _metrics(one_process), _metrics(two)
    assert sorted(one) == sorted(got) == [1, 2, 3, 4, 5]
    tol = 1e-5 if wire == "fp32" else 1e-3  # fp16 on the wire rounds each gradient to 11 bits
    for step in one:
        assert abs(one[step] - got[step]) <= tol, (step, one[step], got[step])
    hashes = _replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # replicas stayed identical
