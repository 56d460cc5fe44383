"""Continued pretraining from published weights: init sources (an HF
Llama folder made here with transformers, its converted checkpoint, a run dir), the vocabulary
resize against an independent reference, the one-line refusals, and the parameter groups."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest
import sentencepiece as spm
import torch
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from mspretrain.checkpoint.init_source import load_init, plan_init
from mspretrain.cli import main
from mspretrain.config.schema import ModelConfig
from mspretrain.model.groups import param_groups, trainable_mask
from mspretrain.model.resize import resize_vocab
from tests.conftest import TINY
from tests.helpers.cli import assert_refusal, assert_user_error, cli
from tests.helpers.hf import HF_VOCAB, tiny_hf_llama, train_tokenizer

V = HF_VOCAB

CHARS = [chr(c) for c in range(0x4E00, 0x4E00 + 40)]  # the base tokenizer's characters (test_hf_bridge)
NEW_PIECES = ["一丁", "万丈", "下丌", "下丌不"]  # pieces the base lacks (BPE: each a merge of two symbols)
CONTROL_PIECE = "<ctl_new>"  # decodes to "": its rows fall back to the overall mean


def tiny_model() -> ModelConfig:
    from mspretrain.config import schema as cfgmod

    return cfgmod.load(TINY).model


def extend_tokenizer(base: Path, out: Path, pieces: list[str], control: list[str] = ()) -> Path:
    """Chinese-LLaMA's merge: the base proto with pieces appended (base ids unchanged)."""
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(base.read_bytes())
    have = {p.piece for p in proto.pieces}
    low = min(p.score for p in proto.pieces)
    for k, text in enumerate(pieces):
        assert text not in have
        proto.pieces.add(piece=text, score=low - 1 - k, type=sp_pb2.ModelProto.SentencePiece.NORMAL)
    for text in control:
        proto.pieces.add(piece=text, score=0.0, type=sp_pb2.ModelProto.SentencePiece.CONTROL)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(proto.SerializeToString())
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """An HF folder (weights, config.json, tokenizer.model), its converted checkpoint, an extended tokenizer."""
    root = tmp_path_factory.mktemp("init_from")
    tok = train_tokenizer(root / "tok" / "tokenizer.model", V)
    hf_dir = root / "hf"
    model = tiny_hf_llama()
    model.save_pretrained(hf_dir)
    shutil.copy(tok, hf_dir / "tokenizer.model")
    ckpt = root / "converted"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(ckpt), "--quiet"]) == 0
    ext = extend_tokenizer(tok, root / "ext" / "tokenizer.model", NEW_PIECES, [CONTROL_PIECE])
    return {"root": root, "tok": tok, "hf": hf_dir, "model": model, "ckpt": ckpt, "ext": ext}


# --------------------------------------------------------------------------- sources

def test_hf_folder_equals_its_converted_checkpoint_bit_for_bit(src):
    a, b = load_init(src["hf"]), load_init(src["ckpt"])
    assert (a.kind, b.kind) == ("hf", "checkpoint")
    assert a.config == b.config and a.config.vocab_size == V
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype == np.float32
        assert np.array_equal(a.tensors[k], b.tensors[k]), k
    # the weights are HF's own tensors (an independent read through torch)
    sd = src["model"].state_dict()
    assert np.array_equal(a.tensors["embed.weight"], sd["model.embed_tokens.weight"].numpy())
    assert np.array_equal(a.tensors["layers.1.attn.wo.weight"], sd["model.layers.1.self_attn.o_proj.weight"].numpy())
    import hashlib

    assert a.files == {"model.safetensors": hashlib.sha256((src["hf"] / "model.safetensors").read_bytes()).hexdigest()}
    assert b.files == {"model.safetensors": hashlib.sha256((src["ckpt"] / "model.safetensors").read_bytes()).hexdigest()}
    assert a.tokenizer_path is not None and b.tokenizer_path is not None


def test_same_vocabulary_keeps_the_tensors(src):
    plan = plan_init(load_init(src["hf"]), tiny_model(), src["tok"])
    assert plan.model.vocab_size == V and plan.meta["resized"] is None
    assert plan.meta["files"] == load_init(src["hf"]).files and plan.meta["kind"] == "hf"
    assert plan.model.rope_theta == 10000.0 and plan.model.ffn_dim == 96 and plan.model.max_seq_len == 128


# --------------------------------------------------------------------------- resize

def test_resize_keeps_base_rows_and_new_rows_are_the_split_means(src):
    init = load_init(src["hf"])
    plan = plan_init(init, tiny_model(), src["ext"])
    n_new = len(NEW_PIECES) + 1
    assert plan.model.vocab_size == V + n_new
    base_sp, ext_sp = spm.SentencePieceProcessor(), spm.SentencePieceProcessor()
    base_sp.Load(str(src["tok"]))
    ext_sp.Load(str(src["ext"]))
    sd = src["model"].state_dict()
    for ours, theirs in (("embed.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        hf = sd[theirs].numpy().astype(np.float64)
        got = plan.tensors[ours]
        assert got.shape == (V + n_new, 64) and got.dtype == np.float32
        assert np.array_equal(got[:V], sd[theirs].numpy())  # base rows bit-identical to the HF weights
        for k, text in enumerate(NEW_PIECES):
            ids = base_sp.EncodeAsIds(text)
            assert ids and ext_sp.EncodeAsIds(text) == [V + k]  # the extension is used whole
            np.testing.assert_array_equal(got[V + k], hf[ids].mean(axis=0).astype(np.float32), err_msg=f"{ours} {text}")
        np.testing.assert_array_equal(got[V + n_new - 1], hf.mean(axis=0).astype(np.float32))  # the control piece
    assert plan.meta["resized"] == {"base_vocab": V, "vocab": V + n_new, "split_mean": len(NEW_PIECES), "overall_mean": 1,
                                    "overall_mean_ids": [V + n_new - 1]}
    # every other tensor is passed through unchanged
    assert all(plan.tensors[k] is init.tensors[k] for k in init.tensors if k not in ("embed.weight", "lm_head.weight"))


def test_resize_tied_and_special_ids():
    emb = np.arange(12, dtype=np.float32).reshape(4, 3)
    out, rec = resize_vocab({"embed.weight": emb, "norm.weight": np.ones(3, np.float32)}, 6, [[1, 2], [0, 9]], unusable={0})
    assert "lm_head.weight" not in out and np.array_equal(out["embed.weight"][:4], emb)
    np.testing.assert_array_equal(out["embed.weight"][4], emb[1:3].mean(axis=0))
    np.testing.assert_array_equal(out["embed.weight"][5], emb.mean(axis=0))  # 0 is unusable, 9 outside the base vocab
    assert (rec["split_mean"], rec["overall_mean"], rec["overall_mean_ids"]) == (1, 1, [5])


# --------------------------------------------------------------------------- refusals


def test_refusals_are_one_line(src):
    root = src["root"]
    init = load_init(src["hf"])
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(src["tok"].read_bytes())
    del proto.pieces[V - 5:]  # the base tokenizer less its last 5 pieces
    small = root / "small" / "tokenizer.model"
    small.parent.mkdir()
    small.write_bytes(proto.SerializeToString())
    assert_user_error(lambda: plan_init(init, tiny_model(), small), "shrinking", str(V - 5), str(V))
    reordered = extend_tokenizer(src["tok"], root / "reordered" / "tokenizer.model", NEW_PIECES)
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(reordered.read_bytes())
    proto.pieces[300].piece, proto.pieces[301].piece = proto.pieces[301].piece, proto.pieces[300].piece
    reordered.write_bytes(proto.SerializeToString())
    assert_user_error(lambda: plan_init(init, tiny_model(), reordered), "does not extend the init model's tokenizer", "id 300")
    assert_user_error(lambda: plan_init(init, replace(tiny_model(), dim=128), src["tok"]), "model.dim = 128", "64")
    assert_user_error(lambda: plan_init(init, replace(tiny_model(), n_kv_heads=4), src["tok"]), "model.n_kv_heads = 4", "2")
    assert_user_error(lambda: load_init(root / "nowhere"), "does not exist")
    nocfg = root / "nocfg"
    shutil.copytree(src["hf"], nocfg)
    (nocfg / "config.json").unlink()
    assert_user_error(lambda: load_init(nocfg), "no config.json")
    bad = root / "bad_st"
    shutil.copytree(src["hf"], bad)
    raw = bytearray((bad / "model.safetensors").read_bytes())
    raw[8:16] = b"{{{{{{{{"  # a header that is not JSON
    (bad / "model.safetensors").write_bytes(bytes(raw))
    assert_user_error(lambda: load_init(bad), "not a valid safetensors file")
    corrupt = root / "corrupt_ckpt"
    shutil.copytree(src["ckpt"], corrupt)
    raw = bytearray((corrupt / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF  # same size, other bytes: only the SHA-256 sees it
    (corrupt / "model.safetensors").write_bytes(bytes(raw))
    assert_user_error(lambda: load_init(corrupt), "does not verify", "sha256 mismatch")
    # no tokenizer with the init weights: new pieces cannot be split
    notok = root / "notok"
    shutil.copytree(src["hf"], notok)
    (notok / "tokenizer.model").unlink()
    assert_user_error(lambda: plan_init(load_init(notok), tiny_model(), src["ext"]), "without a tokenizer")
    # ... and a data tokenizer of the same size: nothing shows it is the weights' own
    assert_user_error(lambda: plan_init(load_init(notok), tiny_model(), src["tok"]), "without a tokenizer", "same size")
    # NaN / inf weights and integer tensors are refused naming the tensor
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(src["hf"] / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    for label, value, words in (("nan", np.float32("nan"), "NaN or infinite"), ("inf", np.float32("inf"), "NaN or infinite")):
        damaged = root / f"damaged_{label}"
        shutil.copytree(src["hf"], damaged)
        w = dict(weights)
        w[name] = w[name].copy()
        w[name][3, 5] = value
        save_file(w, str(damaged / "model.safetensors"), metadata={"format": "pt"})
        assert_user_error(lambda d=damaged: load_init(d), name, words)
    for dtype in (np.int8, np.int32, np.bool_):
        damaged = root / f"damaged_{np.dtype(dtype).name}"
        shutil.copytree(src["hf"], damaged)
        save_file({**weights, name: weights[name].astype(dtype)}, str(damaged / "model.safetensors"), metadata={"format": "pt"})
        assert_user_error(lambda d=damaged: load_init(d), name, "not a floating-point weight")
    # a FIFO named model.safetensors is refused at once (opening it would block forever)
    fifo = root / "fifo"
    shutil.copytree(src["hf"], fifo)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    assert_user_error(lambda: load_init(fifo), "not a regular file")


# --------------------------------------------------------------------------- groups

def test_parameter_groups_cover_the_llama_names():
    from mspretrain.model.hf import our_shapes

    names = list(our_shapes(replace(tiny_model(), vocab_size=64, n_kv_heads=2, ffn_dim=96)))
    want = {"embed.weight": "embeddings", "lm_head.weight": "lm_head", "norm.weight": "norms",
            "layers.0.attn_norm.weight": "norms", "layers.1.mlp_norm.weight": "norms",
            "layers.0.attn.wqkv.weight": "attention", "layers.1.attn.wo.weight": "attention",
            "layers.0.mlp.w13.weight": "mlp", "layers.1.mlp.w2.weight": "mlp"}
    assert set(want) <= set(names)
    for n in names:
        assert len(param_groups(n)) == 1
    for n, g in want.items():
        assert param_groups(n) == {g}
    assert trainable_mask(names, ("all",)) == [True] * len(names)
    mask = dict(zip(names, trainable_mask(names, ("embeddings", "lm_head"))))
    assert {n for n, m in mask.items() if m} == {"embed.weight", "lm_head.weight"}
    # tied: the embedding is the lm_head, trained when either group is
    assert trainable_mask(["embed.weight", "norm.weight"], ["lm_head"], tied=True) == [True, False]
    assert_user_error(lambda: trainable_mask(["embed.weight", "norm.weight"], ["lm_head"], tied=False), "selects no parameter")
    with pytest.raises(ValueError):
        param_groups("proj.weight")


# --------------------------------------------------------------------------- before the trainer

def _data_dir(root: Path, tok: Path, name: str) -> Path:
    """What init_for_run reads of a data dir: its tokenizer."""
    d = root / name
    d.mkdir(exist_ok=True)
    shutil.copy(tok, d / "tokenizer.model")
    return d


def test_explicit_model_keys():
    from mspretrain.checkpoint.init_source import explicit_model_keys

    assert explicit_model_keys(TINY) == {"dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"}
    assert explicit_model_keys(None, ["model.rope_theta=5e5", "train.max_steps=3"]) == {"rope_theta"}
    assert "vocab_size" in explicit_model_keys(None, preset=True)


def test_init_for_run_loads_the_hf_model_before_step_zero(src, tmp_path):
    """The hook makes our Llama compute the HF model: same loss on text both tokenizers encode alike
    (same vocabulary), and, grown to the extended vocabulary, the base logits of HF and a loss equal
    to HF's own model resized with the same new rows."""
    import mindspore as ms

    from mspretrain.checkpoint.init_source import explicit_model_keys, init_for_run
    from mspretrain.config import schema as cfgmod
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.model.loss import token_nll

    cfg = cfgmod.load(TINY)
    text = "七丈三上下万不与丐丑专且丕世丘丙业丛东丝丞"
    base_sp = spm.SentencePieceProcessor(model_file=str(src["tok"]))
    ids = base_sp.EncodeAsIds(text)
    assert spm.SentencePieceProcessor(model_file=str(src["ext"])).EncodeAsIds(text) == ids and len(ids) > 8
    hf = src["model"]
    for tok, n_new in ((src["tok"], 0), (src["ext"], len(NEW_PIECES) + 1)):
        data = _data_dir(tmp_path, tok, f"data{n_new}")
        logs: list[str] = []
        run_cfg, hook, meta = init_for_run(src["hf"], cfg, data, tmp_path / f"run{n_new}", explicit=explicit_model_keys(TINY), log=logs.append)
        assert run_cfg.model.vocab_size == V + n_new and meta["files"] and (meta["resized"] is None) == (n_new == 0)
        assert run_cfg.train == cfg.train and run_cfg.optim == cfg.optim
        model = Decoder(run_cfg.model, seed=99)
        hook(model)
        weights = state_numpy(model)
        assert np.array_equal(weights["layers.0.mlp.w13.weight"],
                              np.concatenate([hf.state_dict()[f"model.layers.0.mlp.{p}_proj.weight"].numpy() for p in ("gate", "up")]))
        x = np.array([ids], np.int32)
        logits = model(ms.Tensor(x)).asnumpy()
        nll, _ = token_nll(ms.Tensor(logits[:, :-1]), ms.Tensor(x[:, 1:]))
        ours = float(nll.asnumpy().mean())
        ref_model = hf
        if n_new:
            ref_model = tiny_hf_llama()  # the same seed: HF's weights, then resized with our new rows
            ref_model.resize_token_embeddings(V + n_new)
            with torch.no_grad():
                ref_model.model.embed_tokens.weight[V:] = torch.tensor(weights["embed.weight"][V:])
                ref_model.lm_head.weight[V:] = torch.tensor(weights["lm_head.weight"][V:])
        with torch.no_grad():
            out = ref_model(torch.tensor(x).long(), labels=torch.tensor(x).long())
            base = hf(torch.tensor(x).long()).logits.numpy()
        assert abs(ours - float(out.loss)) <= 1e-5, (n_new, ours, float(out.loss))
        assert np.abs(logits[..., :V] - base).max() <= 1e-4


def test_init_for_run_on_a_run_dir_with_checkpoints(src, tmp_path):
    from mspretrain.checkpoint.init_source import init_for_run
    from mspretrain.config import schema as cfgmod

    run = tmp_path / "run"
    shutil.copytree(src["ckpt"], run / "checkpoints" / "step_000005")
    shutil.copy(src["ckpt"] / "config.toml", run / "config.toml")
    cfg = cfgmod.load(TINY)
    data = _data_dir(tmp_path, src["tok"], "data")
    assert_user_error(lambda: init_for_run(src["hf"], cfg, data, run, log=lambda s: None), "already has checkpoints", "step_000005")
    logs: list[str] = []
    run_cfg, hook, meta = init_for_run(src["hf"], cfg, data, run, allow_config_change=True, log=logs.append)
    assert hook is None and meta is None and run_cfg.model == load_init(src["ckpt"]).config
    assert "resumes" in logs[0]
    # without --init-from: an ordinary run is left to the trainer; a run that began from init
    # weights resumes with its saved model config and keeps its record
    assert init_for_run(None, cfg, data, run, log=logs.append) == (cfg, None, None)
    record = {"path": "x", "files": {"model.safetensors": "0" * 64}, "resized": None}
    (run / "run_meta.json").write_text(json.dumps({"data_dir": str(data), "init_from": record}))
    run_cfg, hook, meta = init_for_run(None, cfg, data, run, explicit={"dim", "n_layers"}, log=logs.append)
    assert run_cfg.model == load_init(src["ckpt"]).config and hook is None and meta == record
    assert_user_error(lambda: init_for_run(None, replace(cfg, model=replace(cfg.model, n_layers=3)), data, run, explicit={"n_layers"}),
             "model.n_layers = 3", f"the run in {run} has 2")


# --------------------------------------------------------------------------- train --init-from

@pytest.fixture(scope="module")
def ext_data(src):
    """A data dir prepared with the extended tokenizer (text of the base characters and the new pieces)."""
    import random

    from mspretrain.config import schema as cfgmod
    from mspretrain.prepare.prepare import prepare

    rng = random.Random(3)
    words = CHARS + NEW_PIECES
    docs = ["".join(rng.choice(words) for _ in range(rng.randint(15, 40))) for _ in range(400)]
    corpus = src["root"] / "corpus.txt"
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    out = src["root"] / "data_ext"
    prepare([str(corpus)], out, cfgmod.load(TINY).prepare, tokenizer=str(src["ext"]), workers=1, log=lambda s: None)
    return out


@pytest.mark.slow  # three training runs of its own (28 s of make test-fast)
def test_train_init_from_two_stages(src, ext_data, capsys):
    """Stage 1 from the HF folder (grown vocabulary, embeddings + lm_head only), resumed without
    --init-from, then stage 2 (everything) from the stage-1 run; misuse is one line, exit 2."""
    from safetensors.numpy import load_file

    root = src["root"]
    s1, s2 = root / "stage1", root / "stage2"
    base = ["--config", TINY, "--data", ext_data, "--quiet", "checkpoint.every=1", "checkpoint.keep_last=5"]
    rc, _, err = cli(capsys, "train", *base, "--run", s1, "--init-from", src["hf"], "train.max_steps=3",
                      'train.trainable=["embeddings", "lm_head"]')
    assert rc == 0, err
    meta = json.loads((s1 / "run_meta.json").read_text())["init_from"]
    assert meta["kind"] == "hf" and meta["files"] == load_init(src["hf"]).files
    assert meta["resized"]["base_vocab"] == V and meta["resized"]["vocab"] == V + len(NEW_PIECES) + 1
    init = plan_init(load_init(src["hf"]), tiny_model(), src["ext"]).tensors
    last = s1 / "checkpoints" / "step_000003"
    weights, optim = load_file(str(last / "model.safetensors")), load_file(str(last / "optimizer.safetensors"))
    assert weights.keys() == init.keys()
    for name, value in init.items():
        if name in ("embed.weight", "lm_head.weight"):
            assert not np.array_equal(weights[name], value), name
        else:
            assert np.array_equal(weights[name], value), f"frozen {name} changed"
    assert set(optim) == {"opt_step"} | {f"{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in ("embed.weight", "lm_head.weight")}

    # misuse: --init-from on a run dir with checkpoints; a missing source; a checkpoint that fails verification
    assert_refusal(*cli(capsys, "train", *base, "--run", s1, "--init-from", src["hf"], "train.max_steps=4")[::2], "already has checkpoints")
    assert_refusal(*cli(capsys, "train", *base, "--run", root / "new1", "--init-from", root / "nowhere")[::2], "does not exist")
    corrupt = root / "corrupt_stage1"
    shutil.copytree(last, corrupt)
    raw = bytearray((corrupt / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(raw))
    assert_refusal(*cli(capsys, "train", *base, "--run", root / "new2", "--init-from", corrupt)[::2], "does not verify")
    assert_refusal(*cli(capsys, "train", *base, "--run", root / "new3", "--init-from", src["hf"], "model.n_layers=3")[::2], "model.n_layers = 3")
    assert not (root / "new1").exists() and not (root / "new2").exists() and not (root / "new3").exists()

    # the same command without --init-from resumes stage 1 with its saved model config and record
    rc, _, err = cli(capsys, "train", *base, "--run", s1, "train.max_steps=4", 'train.trainable=["embeddings", "lm_head"]')
    assert rc == 0, err
    assert "resumed from step_000003" in (s1 / "train.log").read_text()
    assert json.loads((s1 / "run_meta.json").read_text())["init_from"] == meta
    assert np.array_equal(load_file(str(s1 / "checkpoints" / "step_000004" / "model.safetensors"))["norm.weight"], init["norm.weight"])

    # stage 2: a new run from the stage-1 run dir (its newest checkpoint), every group trained
    rc, _, err = cli(capsys, "train", *base, "--run", s2, "--init-from", s1, "train.max_steps=1", "schedule.warmup_steps=0")
    assert rc == 0, err
    meta2 = json.loads((s2 / "run_meta.json").read_text())["init_from"]
    assert meta2["kind"] == "checkpoint" and meta2["dir"].endswith("step_000004") and meta2["resized"] is None
    optim2 = load_file(str(s2 / "checkpoints" / "step_000001" / "optimizer.safetensors"))
    assert int(optim2["opt_step"].reshape(-1)[0]) == 1 and len(optim2) == 1 + 2 * len(init)  # a fresh optimizer for every parameter
