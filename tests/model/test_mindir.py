"""MINDIR export: one export with dynamic batch/sequence reproduces the training model's logits;
the command creates nested output dirs, writes export.json, prints the diff, and refuses bad input."""
from __future__ import annotations

import json
import os
from dataclasses import replace

os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mspretrain.checkpoint.store import write_weights_only_checkpoint
from mspretrain.cli import main
from mspretrain.config.schema import Config, ModelConfig, resolve_model
from mspretrain.errors import UserError
from mspretrain.model.decoder import Decoder, load_numpy, state_numpy
from mspretrain.model.mindir import verify_mindir

V = 256


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("mindir")
    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96, max_seq_len=64))
    model = Decoder(cfg, seed=3)
    ck = write_weights_only_checkpoint(root / "ck", state_numpy(model), replace(Config(), model=cfg))
    out = root / "nested" / "not" / "yet" / "there"
    rc = main(["export", str(ck), "--format", "mindir", "--out", str(out)])
    assert rc == 0
    return root, ck, out, model


def test_export_writes_files_and_metadata(exported, capsys):
    _, _, out, model = exported
    assert sorted(p.name for p in out.iterdir()) == [".mspretrain-output.json", "export.json", "model.mindir"]  # + the set's marker
    meta = json.loads((out / "export.json").read_text())
    assert meta["vocab_size"] == V and meta["dtype"] == "fp32" and meta["eos_id"] == -1  # no tokenizer in this ckpt
    assert [i["name"] for i in meta["inputs"]] == ["tokens"] and meta["inputs"][0]["dtype"] == "int32"
    assert meta["verified_max_abs_diff"] <= 1e-5


def test_one_export_matches_training_logits_at_two_lengths(exported):
    _, _, out, model = exported
    graph = nn.GraphCell(ms.load(str(out / "model.mindir")))
    for shape in [(3, 21), (1, 50)]:
        tok = ms.Tensor(np.random.default_rng(sum(shape)).integers(0, V, shape).astype(np.int32))
        a, b = graph(tok).asnumpy(), model(tok).asnumpy()
        assert a.shape == (*shape, V)
        assert np.abs(a - b).max() <= 1e-5


def test_verification_catches_a_different_model(exported):
    _, _, out, model = exported
    other = Decoder(model.cfg, seed=4)
    with pytest.raises(UserError, match="differ"):
        verify_mindir(other, out / "model.mindir")
    state = state_numpy(model)
    load_numpy(other, state)
    assert verify_mindir(other, out / "model.mindir") <= 1e-5


def test_command_prints_diff_and_refuses_bad_input(exported, capsys):
    root, ck, out, _ = exported
    capsys.readouterr()
    rc = main(["export", str(ck), "--format", "mindir", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "not empty" in err and "Traceback" not in err
    rc = main(["export", str(ck), "--format", "mindir", "--out", str(out), "--overwrite", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0 and "max abs diff" in captured.out
    rc = main(["export", str(root / "nested"), "--format", "mindir", "--out", str(root / "z")])
    err = capsys.readouterr().err
    assert rc == 2 and "no verified checkpoint" in err.splitlines()[0]
    rc = main(["export", str(ck), "--format", "MINDIR2", "--out", str(root / "z")])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown export format" in err.splitlines()[0] and not (root / "z").exists()
