"""ZeRO-3's per-rank weight files (checkpoint/model_shards.py): written by two ranks built in this
process (the collective primitives told they are rank r of 2, as tests/step/test_zero3.py does), published
with a manifest, read back whole and re-cut to another world size, and used by `checkpoints
--verify`, `recover` and `export`. The msrun runs of tests/step/test_zero3.py resume from such files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mspretrain.parallel.layout import slice_bounds

STEP = 2


def _model(vocab: int):
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model.decoder import Decoder

    return Decoder(resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, family="qwen2", qkv_bias=True),
                               vocab_size=vocab), seed=0)


@pytest.fixture
def zero3_checkpoint(tmp_path, monkeypatch, tiny_cfg, tiny_data) -> tuple[Path, dict[str, np.ndarray]]:
    """RUN/checkpoints/step_000002 written as a 2-rank ZeRO-3 job writes it (rank 1's files staged
    and collected by rank 0), the weights trained a little away from the initial ones (the q/k/v
    bias is zero at init). Returns the run dir and the whole weights."""
    from dataclasses import replace

    from mindspore.ops.operations import comm_ops

    from mspretrain.checkpoint import shards, store
    from mspretrain.checkpoint.model_shards import model_shard_name, shard_metadata
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import load_numpy, state_numpy
    from mspretrain.paths import DataPaths
    from mspretrain.step.zero3 import shard_model, slice_state

    rng = np.random.default_rng(0)
    base = _model(512)
    whole = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in state_numpy(base).items()}
    parts = []
    for rank in (0, 1):
        monkeypatch.setattr(comm_ops, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(comm_ops, "get_group_size", lambda group=None: 2)
        model = _model(512)
        load_numpy(model, whole)
        shard_model(model, [p.name for p in model.trainable_params()], 2, rank, "cpu")
        parts.append(slice_state(model, 2, rank))
    run = tmp_path / "run"
    root = run / "checkpoints"
    root.mkdir(parents=True)
    opt = lambda r: {"opt_step": np.array([STEP], np.int64), f"exp_avg.norm.weight@{32 * r}:{32 * r + 32}": np.zeros(32, np.float32)}
    shards.write_shard(root, STEP, 1, 2, opt(1), model=parts[1][0], model_metadata=shard_metadata(STEP, parts[1][1]))
    cfg = replace(tiny_cfg, model=resolve_model(base.cfg))
    store.write_checkpoint_dir(root / store.step_dir_name(STEP), step=STEP, model=parts[0][0], optimizer=opt(0),
                               train_state={"applied_steps": STEP}, data_state={"note": "unused here"}, config=cfg,
                               tokenizer_path=DataPaths(tiny_data).tokenizer_model,
                               optimizer_file=store.optimizer_shard_name(0, 2), model_file=model_shard_name(0, 2),
                               model_metadata=shard_metadata(STEP, parts[0][1]),
                               collect=lambda tmp: shards.collect(root, STEP, 2, tmp))
    return run, whole


def test_per_rank_weight_files_are_published_verified_and_read_back_at_any_world(zero3_checkpoint):
    from safetensors.numpy import load_file

    from mspretrain.checkpoint import store
    from mspretrain.checkpoint.model_shards import read_pieces, read_whole, stored_shapes

    run, whole = zero3_checkpoint
    ckpt = run / "checkpoints" / "step_000002"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "model.safetensors" not in names
    assert {"model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"} <= set(names)
    assert store.verify(ckpt) is None
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"} <= set(files)
    # each file holds its rank's slices only, 1-D, named as the optimizer state's slices are
    n = whole["layers.0.attn.wqkv.bias"].size
    assert set(load_file(str(ckpt / "model-00001-of-00002.safetensors"))) >= {f"layers.0.attn.wqkv.bias@{n // 2}:{n}"}
    assert stored_shapes(ckpt) == {k: v.shape for k, v in whole.items()}
    got = read_whole(ckpt)
    assert sorted(got) == sorted(whole)
    for k in whole:
        assert np.array_equal(got[k], whole[k]), k
    # re-cut: rank 1 of 3 reads just its ranges; a whole-file checkpoint is cut the same way
    wanted = {k: slice_bounds(v.size, 3, 1) for k, v in whole.items()}
    pieces = read_pieces(ckpt, wanted)
    for k, (a, b) in wanted.items():
        assert np.array_equal(pieces[k], whole[k].reshape(-1)[a:b]), k
    # a rank's file missing is a corrupt checkpoint
    (ckpt / "model-00001-of-00002.safetensors").unlink()
    assert store.verify(ckpt, deep=False) == "model-00001-of-00002.safetensors is missing"


def test_a_manifest_without_every_ranks_weight_file_does_not_verify(zero3_checkpoint):
    from mspretrain.checkpoint import store

    run, _ = zero3_checkpoint
    ckpt = run / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["model-00001-of-00002.safetensors"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert store.verify(ckpt) == "manifest lists no model-00001-of-00002.safetensors"


def test_checkpoints_recover_and_export_work_on_per_rank_weight_files(zero3_checkpoint, tmp_path, capsys):
    from mspretrain.cli import main
    from mspretrain.model.hf import read_hf_dir

    run, whole = zero3_checkpoint
    ckpt = run / "checkpoints" / "step_000002"
    assert main(["checkpoints", str(run), "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    (ckpt / "train_state.json").write_text("{broken")  # a state file lost: the weights are intact
    assert main(["recover", str(run)]) == 0
    assert "verifies again" in capsys.readouterr().out
    assert main(["checkpoints", str(run), "--verify"]) == 0
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    _, exported, _ = read_hf_dir(out)
    assert sorted(exported) == sorted(whole)
    for k in whole:
        assert np.array_equal(exported[k], whole[k]), k


# ------------------------------------------------------------------ hostile per-rank files

def _write_ranks(d: Path, shapes: dict[str, list], *ranks: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": "mspretrain", "step": "1", "shapes": json.dumps(shapes)}
    for r, tensors in enumerate(ranks):
        save_file(tensors, str(d / f"model-{r:05d}-of-{len(ranks):05d}.safetensors"), meta)
    return d


def _refusal(ckpt: Path, wanted=None) -> str:
    from mspretrain.checkpoint.model_shards import read_pieces
    from mspretrain.errors import UserError

    with pytest.raises(UserError) as e:
        read_pieces(ckpt, wanted or {})
    assert "\n" not in str(e.value)
    return str(e.value)


def test_pieces_that_overlap_and_leave_a_gap_are_refused_not_read_whole(tmp_path):
    """24 elements as [0, 14) and [10, 24) leave none out, [0, 14) and [16, 26) a gap; [0, 14) and
    [12, 22) overlap and leave a gap whose lengths sum to the whole (the covered-length sum read
    them whole, with 2 elements never written)."""
    x = np.arange(24, dtype=np.float32)
    shapes = {"w": [4, 6]}
    ok = _write_ranks(tmp_path / "ok", shapes, {"w@0:12": x[:12]}, {"w@12:24": x[12:]})
    from mspretrain.checkpoint.model_shards import read_pieces, read_whole

    assert np.array_equal(read_whole(ok)["w"], x.reshape(4, 6))
    assert np.array_equal(read_pieces(ok, {"w": (5, 19)})["w"], x[5:19])
    both = _write_ranks(tmp_path / "both", shapes, {"w@0:14": x[:14]}, {"w@12:22": x[12:22]})
    assert "overlap at elements [12, 14)" in _refusal(both)
    gap = _write_ranks(tmp_path / "gap", shapes, {"w@0:10": x[:10]}, {"w@12:24": x[12:]})
    assert "leave its elements [10, 12) unwritten" in _refusal(gap)
    # a rank reading only [0, 10) of the gapped tensor is refused too: the whole tiling is checked
    assert "unwritten" in _refusal(gap, {"w": (0, 10)})
    twice = _write_ranks(tmp_path / "twice", shapes, {"w": x.reshape(4, 6)}, {"w@12:24": x[12:]})
    assert "overlap" in _refusal(twice)


@pytest.mark.parametrize("key, shapes, value, says", [
    ("w@0:x", {"w": [4, 6]}, np.zeros(24, np.float32), "no element range"),
    ("w@12:0", {"w": [4, 6]}, np.zeros(24, np.float32), "no element range"),
    ("w@-1:23", {"w": [4, 6]}, np.zeros(24, np.float32), "no element range"),
    ("w@0:24", {"w": [1000000, 1000000, 1000000]}, np.zeros(24, np.float32), "unwritten"),  # absurd whole shape
    ("w@0:24", {"w": [4, "6"]}, np.zeros(24, np.float32), "not a list of whole numbers"),
    ("w@0:24", {"w": [4, -6]}, np.zeros(24, np.float32), "not a list of whole numbers"),
    ("w@0:24", {"w": 24}, np.zeros(24, np.float32), "not a list of whole numbers"),
    ("w@0:30", {"w": [4, 6]}, np.zeros(30, np.float32), "lies past"),
    ("w@0:24", {"w": [4, 6]}, np.zeros(20, np.float32), "not the 24 its name says"),
    ("w@0:24", ["w"], np.zeros(24, np.float32), "not a table of shapes"),
])
def test_hostile_ranges_and_shapes_are_one_line_refusals(tmp_path, key, shapes, value, says):
    assert says in _refusal(_write_ranks(tmp_path / "c", shapes, {key: value}))


def test_deep_or_broken_shape_metadata_is_one_line(tmp_path):
    from safetensors.numpy import save_file

    for i, text in enumerate(["[" * 100000, "{not json"]):
        d = tmp_path / f"c{i}"
        d.mkdir()
        save_file({"w@0:4": np.zeros(4, np.float32)}, str(d / "model-00000-of-00001.safetensors"), {"shapes": text})
        assert "shape metadata" in _refusal(d)
    (tmp_path / "c0" / "model-00000-of-00001.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": [1, 2]}")
    assert "cannot read model-00000-of-00001.safetensors" in _refusal(tmp_path / "c0")


def test_a_whole_file_is_recut_to_slices_that_end_inside_a_row(tmp_path):
    """A whole-file checkpoint (ZeRO-0/1/2, one process) resumed at ZeRO-3 on 3 or 5 ranks: each
    rank's slice starts and ends inside a row of a 2-D or 3-D weight (rows of 7 and 12)."""
    from safetensors.numpy import save_file

    from mspretrain.checkpoint.model_shards import read_pieces

    whole = {"a": np.arange(35, dtype=np.float32).reshape(5, 7), "b": np.arange(6, dtype=np.float16),
             "c": np.arange(48, dtype=np.float32).reshape(4, 3, 4)}
    tmp_path.mkdir(exist_ok=True)
    save_file(whole, str(tmp_path / "model.safetensors"))
    assert slice_bounds(35, 3, 1) == (12, 24) and slice_bounds(48, 5, 2)[0] % 12  # ends inside rows
    for world in (3, 5):
        for rank in range(world):
            wanted = {k: slice_bounds(v.size, world, rank) for k, v in whole.items()}
            got = read_pieces(tmp_path, wanted)
            for k, (a, b) in wanted.items():
                assert got[k].dtype == whole[k].dtype
                assert np.array_equal(got[k], whole[k].reshape(-1)[a:b]), (world, rank, k)


def test_optimizer_slices_that_overlap_and_leave_a_gap_are_refused():
    """The optimizer state's reader (step/state_codec.py) checks coverage the same way."""
    from types import SimpleNamespace

    from mspretrain.errors import UserError
    from mspretrain.step.state_codec import OptimizerState

    me = SimpleNamespace(o=SimpleNamespace(own=[0], bounds=[(4, 20)], split=[True]), params=(None,))
    x = np.arange(24, dtype=np.float32)
    ok = {"exp_avg.w@0:12": x[:12], "exp_avg.w@12:24": x[12:]}
    assert np.array_equal(OptimizerState._assemble(me, ok, "exp_avg.w", 0), x[4:20])
    for bad, says in [({"exp_avg.w@0:14": x[:14], "exp_avg.w@12:22": x[12:22]}, "overlap"),
                      ({"exp_avg.w@0:10": x[:10], "exp_avg.w@12:24": x[12:]}, "[10, 12) unwritten"),
                      ({"exp_avg.w@0:12": x[:12], "exp_avg.w@12:24": x[12:20]}, "not the 12 its name says"),
                      ({"exp_avg.w@0:1.5": x[:12]}, "no element range")]:
        with pytest.raises(UserError) as e:
            OptimizerState._assemble(me, bad, "exp_avg.w", 0)
        assert says in str(e.value) and "\n" not in str(e.value)


def test_from_pytorch_md_reads_per_rank_slices_and_whole_files(zero3_checkpoint, tmp_path):
    """docs/from-pytorch.md's `read_weights`, run as the page prints it, on a ZeRO-3 checkpoint
    (per-rank slices joined) and on a whole-file one: the whole weights, bit for bit."""
    import re

    from safetensors.numpy import save_file

    doc = (Path(__file__).resolve().parents[2] / "docs" / "from-pytorch.md").read_text(encoding="utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def read_weights" in b]
    code = code.replace('weights = read_weights("runs/mine/checkpoints/step_000040")', "")  # the page's example path
    space: dict = {}
    exec(compile(code, "from-pytorch.md", "exec"), space)
    run, whole = zero3_checkpoint
    for ckpt in (run / "checkpoints" / "step_000002", tmp_path / "whole"):
        if ckpt.name == "whole":
            ckpt.mkdir()
            save_file(whole, str(ckpt / "model.safetensors"))
        got = space["read_weights"](str(ckpt))
        assert sorted(got) == sorted(whole)
        for k in whole:
            assert got[k].shape == whole[k].shape and np.array_equal(got[k], whole[k]), (ckpt.name, k)


def test_export_and_eval_refuse_per_rank_files_that_overlap_and_leave_a_gap(zero3_checkpoint, tmp_path, capsys):
    """Rank 1's file rewritten (its manifest entry too, as a hostile or buggy writer would) so
    that its first slice of the bias starts 2 elements early and ends 2 early: the lengths still
    sum to the whole, which the old reader accepted (export exit 0, 2 elements never written).
    Now `export` and `eval` refuse in one line, exit 2, writing nothing."""
    import hashlib

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from tests.helpers.cli import assert_refusal, cli

    run, whole = zero3_checkpoint
    ckpt = run / "checkpoints" / "step_000002"
    f1 = ckpt / "model-00001-of-00002.safetensors"
    with safe_open(str(f1), framework="numpy") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    n = whole["layers.0.attn.wqkv.bias"].size
    key = f"layers.0.attn.wqkv.bias@{n // 2}:{n}"
    flat = whole["layers.0.attn.wqkv.bias"].reshape(-1)
    tensors[f"layers.0.attn.wqkv.bias@{n // 2 - 2}:{n - 2}"] = flat[n // 2 - 2:n - 2].copy()
    del tensors[key]
    save_file(tensors, str(f1), meta)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][f1.name] = {"sha256": hashlib.sha256(f1.read_bytes()).hexdigest(), "bytes": f1.stat().st_size}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = cli(capsys, "export", run, "--format", "hf", "--out", tmp_path / "hf", "--quiet")
    assert_refusal(rc, err, "overlap at elements")
    assert not (tmp_path / "hf").exists()
    rc, _, err = cli(capsys, "eval", run)
    assert rc == 2 and "overlap at elements" in err and "Traceback" not in err
