"""`prepare --ray ADDRESS` (issue 29, item 5): a real two-node Ray cluster on 127.0.0.1 (a head
and one worker node, each a `ray start --block` process group started and killed here), and the
data dir it writes compared byte for byte with a local run, with and without near dedup, with a
trained and with a given tokenizer. The head offers no CPU, so every chunk runs on the worker node.
The refusals (no ray, unreachable address, --workers with --ray) need no cluster."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from mspretrain.errors import UserError
from mspretrain.prepare import dedup, diskdedup
from mspretrain.prepare.raypool import RayCluster
from mspretrain.train.distributed import free_local_port
from tests.conftest import make_poems
from tests.helpers import dedup_corpus, dedup_reference, refused

ROOT = Path(__file__).resolve().parents[1]
START_SECONDS = 90  # a node's `ray start` on a busy 2-core box


def ray_env() -> dict:
    # the nodes' worker processes import this tree's mspretrain, as the driver does
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray 2.60 turns token authentication on at the head when ~/.ray/auth_token exists
            # (left by any earlier `ray get-auth-token --generate`), while a node started without
            # RAY_AUTH_MODE=token does not send it and cannot join: one mode for every process here
            "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~2 MB, ~700 K characters: several chunks of pass 1 (pool.CHUNK_CHARS) for the one worker
    node, with exact and near duplicates planted; a blank-line file and a line-per-document one."""
    d = tmp_path_factory.mktemp("raw")
    poems = make_poems(21000, seed=5)
    base = ["\n".join(poems[i: i + 3]) for i in range(0, 15000, 3)]  # ~110 characters each
    near = [p.replace("。", "！", 1) for p in base[:300:3]]  # one character changed: Jaccard ~0.9
    (d / "a.txt").write_text("\n\n".join(base + base[:200] + near) + "\n", encoding="utf-8")
    (d / "b.txt").write_text("\n".join(p.replace("\n", " ") for p in poems[15000:]) + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def cluster():
    """HOST:PORT of a Ray head (0 CPUs) with one worker node (1 CPU), both killed at the end."""
    import ray  # noqa: F401  a pinned test dependency (pyproject [test]): missing must fail, not skip

    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    tmp = tempfile.mkdtemp(prefix="msr-", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    port = free_local_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--object-store-memory=80000000", "--disable-usage-stats"]
    procs: list[subprocess.Popen] = []

    def start(args: list[str], name: str) -> None:
        log = open(Path(tmp) / f"{name}.log", "wb")
        procs.append(subprocess.Popen([ray_bin, "start", *args, *common], stdout=log, stderr=subprocess.STDOUT,
                                      env=ray_env(), start_new_session=True))  # its own group: killed whole below

    def started(name: str) -> bool:  # `ray start` prints this once its node has joined
        return "Ray runtime started" in (Path(tmp) / f"{name}.log").read_text(errors="replace")

    def nodes_up() -> bool:
        try:  # a `ray status` slow on a loaded box is "not yet": START_SECONDS bounds the wait
            out = subprocess.run([ray_bin, "status", f"--address={address}"], capture_output=True, text=True, env=ray_env(),
                                 timeout=max(1.0, min(30.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            return False
        return out.stdout.count(" node_") >= 2

    try:
        # both at once: the worker node waits for the head's GCS by itself
        start(["--head", f"--port={port}", "--num-cpus=0", f"--temp-dir={tmp}/t", "--include-dashboard=false"], "head")
        start([f"--address={address}", "--num-cpus=1"], "worker")
        deadline = time.time() + START_SECONDS
        while not (started("head") and started("worker") and nodes_up()):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                logs = "\n".join((Path(tmp) / f"{n}.log").read_text(errors="replace")[-2000:] for n in ("head", "worker"))
                raise AssertionError(f"the Ray cluster did not come up with 2 nodes in {START_SECONDS} s:\n{logs}")
            time.sleep(0.5)
        yield address
    finally:
        for p in reversed(procs):  # SIGTERM lets `ray start --block` stop its node; SIGKILL whatever is left
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 3
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def run_local(corpus: Path, out: Path, *extra: str) -> None:
    """The same command without --ray, here (no Ray in it)."""
    assert main(["prepare", str(corpus), "--out", str(out), *extra, "--workers", "2", "--quiet",
                 "prepare.min_chars=4", "prepare.valid_fraction=0.1"]) == 0


def run_prepare(corpus: Path, out: Path, *extra: str) -> str:
    """The CLI in a process of its own, as a user runs it (ray.init's state stays out of pytest); its stdout."""
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(corpus), "--out", str(out), *extra,
           "prepare.min_chars=4", "prepare.valid_fraction=0.1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ray_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""  # Ray's own log lines stay out of prepare's output
    return r.stdout


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "train.bin" in names and "manifest.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("near", [False, True], ids=["exact", "near"])
def test_ray_run_is_byte_identical_to_the_local_run(cluster, corpus, tmp_path, near):
    near_flag = f"prepare.near_dedup={str(near).lower()}"
    local = tmp_path / "local"
    run_local(corpus, local, "--vocab-size", "500", near_flag)
    dropped = json.loads((local / "manifest.json").read_text())["dropped"]
    assert dropped["exact_dup"] >= 200 and (dropped.get("near_dup", 0) >= 50) == near
    out = run_prepare(corpus, tmp_path / "ray", "--vocab-size", "500", "--ray", cluster, near_flag)
    assert "on Ray at" in out and "1 CPU on 1 node" in out  # the head offers none: the chunks ran on the worker node
    same_files(local, tmp_path / "ray")
    # with the trained tokenizer given: one pass, the tokenizer file sent to the node by content
    given = tmp_path / "given-tok" / "tokenizer.model"
    given.parent.mkdir()
    shutil.copy(local / "tokenizer.model", given)
    run_local(corpus, tmp_path / "local-given", "--tokenizer", str(given), near_flag)
    run_prepare(corpus, tmp_path / "ray-given", "--tokenizer", str(given), "--ray", cluster, near_flag)
    same_files(tmp_path / "local-given", tmp_path / "ray-given")


@pytest.mark.slow
def test_dedup_partitions_on_ray_decide_as_here(cluster, tmp_path, monkeypatch):
    """Many partitions, each sorted by a Ray task on the worker node: the same decisions as the
    in-memory reference (tests/helpers.py `dedup_reference`, as in tests/test_diskdedup.py)."""
    monkeypatch.setattr(diskdedup, "PART_BYTES", 4096)  # many partition files (the driver splits)
    docs = dedup_corpus(1500, seed=1)
    want_exact, want_near = dedup_reference(docs, 0.8)
    dd = diskdedup.DiskDedup(tmp_path / "dd", 200_000, dedup.LshSettings.make(0.8, 1234))
    assert dd.exact.parts > 8 and dd.near.parts > 8
    for lo in range(0, len(docs), 97):
        part = docs[lo: lo + 97]
        dd.add(dedup.dedup_keys(part), dedup.band_keys(dedup.signatures(part, seed=3), dd.bands, dd.rows))
    with RayCluster(cluster) as ray_cluster:
        dd.resolve(ray_cluster.map)
    exact, near = dd.dropped(0, len(docs))
    np.testing.assert_array_equal(exact, want_exact)
    np.testing.assert_array_equal(near, want_near)


@pytest.mark.slow
def test_a_node_running_other_code_is_refused_before_anything_is_written(cluster, monkeypatch):
    """The node check compares each node's fingerprint with the driver's: here the driver's
    version is changed in this process only, as if the nodes ran another release."""
    import mspretrain

    monkeypatch.setattr(mspretrain, "__version__", "0.0.0+other")
    with pytest.raises(UserError) as refusal:
        RayCluster(cluster)
    assert re.fullmatch(r"Ray node .* runs other code than this machine \(mspretrain \S+ sources (\w+) there, 0\.0\.0\+other "
                        r"sources \1 here\), so the output would not be byte-identical; nothing was written", refusal.value.cause)
    assert refusal.value.fix == "install the same mspretrain and library versions on every node"


def test_unreachable_address_is_refused_and_nothing_is_written(corpus, tmp_path, capsys):
    import ray  # noqa: F401

    out = tmp_path / "data"
    err = refused(capsys, "prepare", str(corpus), "--out", str(out), "--ray", f"127.0.0.1:{free_local_port()}")
    assert err.startswith("error: cannot reach the Ray cluster at 127.0.0.1:") and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


def test_an_address_ray_would_not_take_is_refused(corpus, tmp_path, capsys):
    err = refused(capsys, "prepare", str(corpus), "--out", str(tmp_path / "data"), "--ray", "head-node")
    assert err.splitlines()[0] == "error: --ray head-node: not an address Ray accepts"
    assert list(tmp_path.iterdir()) == []


def test_without_ray_installed_the_hint_names_the_extra(corpus, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    err = refused(capsys, "prepare", str(corpus), "--out", str(tmp_path / "data"), "--ray", "auto")
    assert err.splitlines()[0] == "error: --ray needs the `ray` package, which is not installed"
    assert "pip install 'mspretrain[ray]'" in err
    assert list(tmp_path.iterdir()) == []


def test_workers_and_ray_exclude_each_other(corpus, tmp_path, capsys):
    err = refused(capsys, "prepare", str(corpus), "--out", str(tmp_path / "d"), "--ray", "auto", "--workers", "2")
    assert "--workers and --ray exclude each other" in err
