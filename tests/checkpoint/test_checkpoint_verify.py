"""verify(): cheap checks before any hashing, parallel hashing with the same reasons as before,
and a deterministic answer (the first failing file in sorted-name order). No MindSpore needed."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mspretrain.checkpoint import store
from mspretrain.config import schema as cfgmod


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.zeros(32, np.float32)}
    optim = {f"{k}.{n}": np.ones_like(v) for n, v in model.items() for k in ("exp_avg", "exp_avg_sq")}
    return store.write_checkpoint_dir(tmp_path / "checkpoints" / "step_000002", step=2, model=model, optimizer=optim,
                                      train_state={"tokens": 10}, data_state={"pos": 3}, config=cfgmod.Config())


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _no_hashing(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("hashed a file although a cheap check had already failed")

    monkeypatch.setattr(store, "_sha256", fail)


def test_intact_checkpoint_verifies(ckpt):
    assert store.verify(ckpt) is None
    assert store.verify(ckpt, deep=False) is None


def test_truncation_is_found_without_hashing(ckpt, monkeypatch):
    f = ckpt / store.OPTIM_FILE
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])
    _no_hashing(monkeypatch)
    assert store.verify(ckpt) == f"optimizer.safetensors size mismatch ({size // 2} bytes, manifest says {size})"


def test_deleted_file_is_found_without_hashing(ckpt, monkeypatch):
    (ckpt / "data_state.json").unlink()
    _no_hashing(monkeypatch)
    assert store.verify(ckpt) == "data_state.json is missing"


def test_size_problem_is_reported_before_an_earlier_files_bad_hash(ckpt, monkeypatch):
    _flip(ckpt / "config.toml")  # sorts first, but only hashing would find it
    (ckpt / "train_state.json").unlink()
    _no_hashing(monkeypatch)
    assert store.verify(ckpt) == "train_state.json is missing"


def test_bit_flip_is_a_sha256_mismatch(ckpt):
    _flip(ckpt / store.OPTIM_FILE)
    assert store.verify(ckpt) == "optimizer.safetensors sha256 mismatch"
    assert store.verify(ckpt, deep=False) is None  # same size: only the hash can tell


def test_two_corrupt_files_report_the_first_in_sorted_order(ckpt):
    _flip(ckpt / store.OPTIM_FILE)
    _flip(ckpt / store.MODEL_FILE)
    for _ in range(5):  # threads finish in any order; the answer must not
        assert store.verify(ckpt) == "model.safetensors sha256 mismatch"


def test_hashing_runs_in_the_verify_thread_pool(ckpt, monkeypatch):
    import threading

    seen: set[str] = set()
    real = store._sha256

    def spy(path, stop=None):
        seen.add(threading.current_thread().name)
        return real(path, stop)

    monkeypatch.setattr(store, "_sha256", spy)
    assert store.verify(ckpt) is None
    assert seen, "verify() hashed nothing"  # all() of nothing is True
    assert all(n.startswith("verify") for n in seen)


def test_latest_verified_skips_a_corrupt_newest(ckpt):
    run = ckpt.parent.parent
    newer = store.write_checkpoint_dir(run / "checkpoints" / "step_000004", step=4, model={"w": np.ones(8, np.float32)},
                                       optimizer=None, train_state={}, data_state=None, config=cfgmod.Config())
    _flip(newer / store.MODEL_FILE)
    lines: list[str] = []
    assert store.latest_verified(run, log=lines.append) == ckpt
    assert lines == ["checkpoint step_000004 is corrupt: model.safetensors sha256 mismatch — using step_000002"]


def test_missing_manifest_and_unreadable_manifest(ckpt):
    (ckpt / store.MANIFEST).write_text("{not json", encoding="utf-8")
    assert store.verify(ckpt) == "manifest.json is unreadable"
    (ckpt / store.MANIFEST).unlink()
    assert store.verify(ckpt) == "no manifest.json (the save did not finish)"


def test_recover_reads_the_manifest_as_verify_does(ckpt, tmp_path):
    """`recover` judges the weights through the same validated manifest reader: a hand-edited
    manifest is a reason ("weights not usable"), never a traceback; the damaged one stays as it was."""
    import json

    from mspretrain.errors import UserError
    from mspretrain.forensics.recover import recover

    mpath = ckpt / store.MANIFEST
    manifest = json.loads(mpath.read_text(encoding="utf-8"))
    manifest["files"][store.MODEL_FILE] = 5  # an entry that is not an object
    mpath.write_text(json.dumps(manifest), encoding="utf-8")
    before = mpath.read_bytes()
    with pytest.raises(UserError, match="weights not usable .*model.safetensors.* is not an object"):
        recover(tmp_path)
    assert mpath.read_bytes() == before


def test_prune_keeps_the_newest_verified_checkpoint_when_newer_ones_are_damaged(tmp_path):
    """keep_last=1 with the newest checkpoint corrupt: the newest one that verifies (what a resume
    would load) is kept too, and only the others go."""
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((8, 4)).astype(np.float32)}
    optim = {f"{k}.w": np.ones((8, 4), np.float32) for k in ("exp_avg", "exp_avg_sq")}
    for step in (2, 4, 6):
        store.write_checkpoint_dir(tmp_path / "checkpoints" / f"step_{step:06d}", step=step, model=model, optimizer=optim,
                                   train_state={"tokens": step}, data_state={"pos": step}, config=cfgmod.Config())
    _flip(tmp_path / "checkpoints" / "step_000006" / store.OPTIM_FILE)
    removed = store.prune(tmp_path, keep_last=1, keep_every=0, log=lambda s: None)
    assert [p.name for p in removed] == ["step_000002"]
    assert [s for s, _ in store.list_checkpoints(tmp_path)] == [4, 6]
    assert store.latest_verified(tmp_path, log=lambda s: None).name == "step_000004"


def test_the_same_tensors_are_written_as_the_same_bytes(tmp_path):
    """safetensors writes the metadata from a Rust hash map whose order changes from one write to the
    next (of 12 writes of one file, both orders appear): checkpoint/tensor_file.py sorts it, so the
    same checkpoint hashes alike whenever it is written. The files still load, metadata included."""
    import hashlib
    import json
    import struct

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from mspretrain.checkpoint.tensor_file import save_tensors, sort_metadata

    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": np.arange(3, dtype=np.int64), "é": np.ones(2, np.float16)}
    meta = {"format": "mspretrain", "step": "12", "a": "x"}

    def header_order(p: Path) -> tuple:
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        return tuple(json.loads(raw[8:8 + n])["__metadata__"])

    plain = set()
    for i in range(12):  # the library alone: the order varies (3 keys: 6 orders)
        save_file(tensors, str(tmp_path / f"plain{i}.safetensors"), metadata=meta)
        plain.add(header_order(tmp_path / f"plain{i}.safetensors"))
    assert len(plain) > 1, plain
    digests = set()
    for i in range(12):
        p = tmp_path / f"ours{i}.safetensors"
        save_tensors(tensors, p, meta)
        digests.add(hashlib.sha256(p.read_bytes()).hexdigest())
        assert header_order(p) == ("a", "format", "step")
    assert len(digests) == 1
    got = load_file(str(tmp_path / "ours0.safetensors"))
    assert set(got) == set(tensors) and all(np.array_equal(got[k], tensors[k]) for k in tensors)
    with safe_open(str(tmp_path / "ours0.safetensors"), "np") as f:
        assert f.metadata() == meta
    # sorting a sorted file changes nothing; a header written with other spacing is left alone
    assert not sort_metadata(tmp_path / "ours0.safetensors")
    spaced = tmp_path / "spaced.safetensors"
    header = b'{"__metadata__": {"step": "1", "format": "x"}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    header += b" " * (-len(header) % 8)
    spaced.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    before = spaced.read_bytes()
    assert not sort_metadata(spaced) and spaced.read_bytes() == before


def test_two_writes_of_one_checkpoint_hash_alike(tmp_path, ckpt):
    """The same step written twice (a re-save after a rewind writes it again): every file but the
    manifest (which records the time) has the same sha256."""
    import json

    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.zeros(32, np.float32)}
    optim = {f"{k}.{n}": np.ones_like(v) for n, v in model.items() for k in ("exp_avg", "exp_avg_sq")}
    files = []
    for i in range(6):
        d = store.write_checkpoint_dir(tmp_path / f"again{i}" / "step_000002", step=2, model=model, optimizer=optim,
                                       train_state={"tokens": 10}, data_state={"pos": 3}, config=cfgmod.Config())
        files.append(json.loads((d / "manifest.json").read_text())["files"])
    files.append(json.loads((ckpt / "manifest.json").read_text())["files"])
    assert all(f == files[0] for f in files[1:])
