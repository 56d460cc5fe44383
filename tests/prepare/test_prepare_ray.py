"""`prepare --ray ADDRESS`: a real two-node Ray cluster on 127.0.0.1 (a head
and one worker node, each a `ray start --block` process group started and killed here), and the
data dir it writes compared byte for byte with a local run, with and without near dedup, with a
trained and with a given tokenizer. The head offers no CPU, so every chunk runs on the worker node.
The refusals (no ray, unreachable address, --workers with --ray) need no cluster."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from mspretrain.errors import UserError
from mspretrain.parallel.distributed import free_local_port
from mspretrain.prepare import dedup, diskdedup
from mspretrain.prepare.raypool import RayCluster
from tests.conftest import make_poems
from tests.helpers.cli import refused
from tests.helpers.prepare import dedup_corpus, dedup_reference
from tests.helpers.ray import ray_cluster, run_local, run_prepare, same_files

cluster = ray_cluster  # the fixture: a 2-node Ray cluster on 127.0.0.1, started once for this module


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
    in-memory reference (tests/helpers/prepare.py `dedup_reference`, as in tests/prepare/test_diskdedup.py)."""
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
