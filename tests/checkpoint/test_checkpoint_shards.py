"""The optimizer-shard protocol of sharded runs, without MindSpore: rank R stages, rank 0 publishes."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain.checkpoint import shards, store
from mspretrain.checkpoint.store import SaveError
from mspretrain.config import schema as cfgmod


def _publish_rank0(root, step, world, **kw):
    return store.write_checkpoint_dir(
        root / store.step_dir_name(step), step=step, model={"w": np.ones((2, 2), np.float32)},
        optimizer={"opt_step": np.asarray(1), "exp_avg.w": np.zeros((2, 2), np.float32)}, train_state={},
        data_state={}, config=cfgmod.Config(), optimizer_file=store.optimizer_shard_name(0, world),
        collect=lambda tmp: shards.collect(root, step, world, tmp, **kw))


def test_shards_are_moved_in_hashed_by_their_rank_and_verified(tmp_path):
    root = tmp_path / "checkpoints"
    shards.write_shard(root, 3, 1, 2, {"opt_step": np.asarray(1), "exp_avg.v": np.full((3,), 2.0, np.float32)})
    staged = json.loads((shards.staging_dir(root, 3, 1) / "shard.json").read_text())["files"][0]  # one entry per file
    ckpt = _publish_rank0(root, 3, 2)
    assert store.verify(ckpt) is None
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["files"]["optimizer-00001-of-00002.safetensors"]["sha256"] == staged["sha256"]
    assert not shards.staging_dir(root, 3, 1).exists()
    assert store.optimizer_keys(ckpt) == {"opt_step", "exp_avg.w", "exp_avg.v"}
    assert set(store.read_optimizer_tensors(ckpt, keys={"exp_avg.v"})) == {"exp_avg.v"}
    np.testing.assert_array_equal(load_file(str(ckpt / "optimizer-00001-of-00002.safetensors"))["exp_avg.v"], 2.0)


def test_a_failed_rank_fails_the_save_and_publishes_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    d = shards.staging_dir(root, 5, 1)
    d.mkdir(parents=True)
    (d / "error.json").write_text(json.dumps({"error": "No space left on device"}))
    with pytest.raises(SaveError, match="rank 1 could not write its optimizer shard: No space left on device"):
        _publish_rank0(root, 5, 2)
    assert not (root / "step_000005").exists() and not (root / "step_000005.tmp").exists()


def test_a_missing_rank_times_out_with_the_shared_storage_hint(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(SaveError, match="rank 1 did not deliver .* storage every rank shares"):
        _publish_rank0(root, 7, 2, wait_s=0.2)
    assert store.list_checkpoints(tmp_path) == []


def test_a_rank_that_cannot_write_tells_rank_0(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards, "save_tensors", disk_full)
    with pytest.raises(SaveError, match="rank 1: .*No space left"):
        shards.write_shard(root, 9, 1, 2, {"opt_step": np.asarray(1)})
    assert "No space left" in json.loads((shards.staging_dir(root, 9, 1) / "error.json").read_text())["error"]
