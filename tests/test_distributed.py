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


@pytest.mark.skipif(shutil.which("msrun") is None, reason="msrun not on PATH")
def test_two_ranks_match_one_process(tmp_path, tiny_data):
    from mspretrain.cli import main

    args = ["train", "--config", str(TINY), "--data", str(tiny_data), "train.max_steps=5", "checkpoint.every=0", "--quiet"]
    assert main(args[:3] + ["--run", str(tmp_path / "one")] + args[3:]) == 0

    exe = shutil.which("mspretrain") or str(Path(sys.executable).with_name("mspretrain"))
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={_free_port()}",
           f"--log_dir={tmp_path / 'logs'}", "--join=True", exe] + args[:3] + ["--run", str(tmp_path / "two")] + args[3:]
    env = {**os.environ, "GLOG_v": "3", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert proc.returncode == 0, logs[-3000:]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5, (step, one[step], two[step])
    hashes = [json.loads(p.read_text())["weights_sha256"] for p in sorted((tmp_path / "two" / "ranks").glob("rank_*.json"))]
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # replicas stayed identical
