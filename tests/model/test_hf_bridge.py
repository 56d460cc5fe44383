"""HF bridge: convert HF Llama folders (GQA, tied/untied, sharded, bf16) with logits/loss parity,
export back (transformers loads it cleanly, greedy generation agrees), round trip, bad inputs."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

os.environ.setdefault("GLOG_v", "3")

import mindspore as ms
import numpy as np
import pytest

# Plain imports, not importorskip: torch and transformers are pinned test dependencies
# (pyproject [test]); a missing one must fail collection loudly, not skip every parity test.
import torch
import transformers

from mspretrain.checkpoint.model import load_model
from mspretrain.checkpoint.store import read_model_tensors, resolve_checkpoint, write_weights_only_checkpoint
from mspretrain.config.schema import Config, ModelConfig, resolve_model
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.model.decoder import Decoder, state_numpy
from mspretrain.model.hf import read_safetensors
from mspretrain.model.loss import token_nll
from tests.helpers.cli import assert_refusal, cli
from tests.helpers.hf import HF_VOCAB, train_tokenizer

V = HF_VOCAB


def hf_llama(tied: bool, seed: int = 0, dtype=None):
    torch.manual_seed(seed)
    hc = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = transformers.LlamaForCausalLM(hc).eval()
    return model.to(dtype) if dtype is not None else model


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge")
    tok = train_tokenizer(root / "tok" / "tokenizer.model", V)
    return root, tok


@pytest.fixture(scope="module")
def hf_dirs(work):
    root, tok = work
    dirs = {}
    for tied in (False, True):
        d = root / f"hf_tied{int(tied)}"
        model = hf_llama(tied, seed=int(tied))
        model.save_pretrained(d)
        shutil.copy(tok, d / "tokenizer.model")
        dirs[tied] = (d, model)
    return dirs


# --------------------------------------------------------------------------- HF -> ours

@pytest.mark.parametrize("tied", [False, True])
def test_convert_matches_hf_logits_and_loss(hf_dirs, work, tied, capsys):
    root, _ = work
    d, hf = hf_dirs[tied]
    out = root / f"ckpt_tied{int(tied)}"
    rc, stdout, err = cli(capsys, "convert", "--from-hf", d, "--out", out)
    assert rc == 0, err
    loaded = load_model(out)
    model, ref = loaded.model, loaded.ref
    assert ref.config.model.tie_embeddings == tied and ref.tokenizer_path is not None
    assert ("lm_head.weight" in read_model_tensors(ref)) == (not tied)
    tok = np.random.default_rng(3).integers(0, V, (2, 33)).astype(np.int32)
    with torch.no_grad():
        ref_out = hf(torch.tensor(tok).long(), labels=torch.tensor(tok).long())
    logits = model(ms.Tensor(tok)).asnumpy()
    assert np.abs(logits - ref_out.logits.numpy()).max() <= 1e-4
    nll, _ = token_nll(ms.Tensor(logits[:, :-1]), ms.Tensor(tok[:, 1:]))
    assert abs(float(nll.asnumpy().mean()) - float(ref_out.loss)) <= 1e-5


def test_sharded_and_bf16_weights(hf_dirs, work, capsys):
    root, _ = work
    d, hf = hf_dirs[False]
    sharded = root / "hf_sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    rc, _, err = cli(capsys, "convert", "--from-hf", sharded, "--out", root / "ck_sharded")
    assert rc == 0, err
    rc, _, err = cli(capsys, "convert", "--from-hf", d, "--out", root / "ck_plain")
    assert rc == 0, err
    a = read_model_tensors(resolve_checkpoint(root / "ck_sharded"))
    b = read_model_tensors(resolve_checkpoint(root / "ck_plain"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # bf16 shards (numpy has no bf16): our reader widens them exactly like torch does.
    bf = root / "hf_bf16"
    hf_llama(False, dtype=torch.bfloat16).save_pretrained(bf)
    ours = read_safetensors(bf / "model.safetensors")
    theirs = hf_llama(False, dtype=torch.bfloat16).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert ours[name].dtype == np.float32 and np.array_equal(ours[name], theirs[name].float().numpy())


# --------------------------------------------------------------------------- ours -> HF -> ours

@pytest.fixture(scope="module")
def our_ckpt(work):
    root, tok = work
    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96,
                                    max_seq_len=64, rope_theta=5000.0, init_std=0.1))
    model = Decoder(cfg, seed=11)
    ck = write_weights_only_checkpoint(root / "ours", state_numpy(model), replace(Config(), model=cfg), tokenizer_path=tok)
    return ck, model, cfg


def greedy_ours(model: Decoder, prompt: list[int], n: int, eos: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        nxt = int(model(ms.Tensor(np.array([seq], np.int32))).asnumpy()[0, -1].argmax())
        seq.append(nxt)
        if nxt == eos:
            break
    return seq


def test_export_hf_loads_in_transformers_and_round_trips(our_ckpt, work, capsys):
    root, tok_path = work
    ck, model, cfg = our_ckpt
    out = root / "export_hf"
    rc, stdout, err = cli(capsys, "export", ck, "--format", "hf", "--out", out)
    assert rc == 0, err
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.model",
            "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in out.iterdir()}
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    prompt = [5, 17, 42, 99, 7]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0].tolist()
    assert theirs == greedy_ours(model, prompt, 12, eos=2)
    # The tokenizer loads with AutoTokenizer and encodes as ours does.
    at = transformers.AutoTokenizer.from_pretrained(out)
    ours_tok = Tokenizer.load(tok_path)
    for text in ["一丁七 hello 12。", " 两  空格", "abc\ndef 😀"]:
        assert at.encode(text, add_special_tokens=False) == ours_tok.encode(text)
    # And back: convert the export, tensors identical to the original checkpoint.
    rc, _, err = cli(capsys, "convert", "--from-hf", out, "--out", root / "back")
    assert rc == 0, err
    a, b = read_model_tensors(resolve_checkpoint(ck)), read_model_tensors(resolve_checkpoint(root / "back"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert resolve_checkpoint(root / "back").config.model == cfg


def test_export_refuses_non_empty_out_and_unknown_format(our_ckpt, work, capsys):
    root, _ = work
    ck, _, _ = our_ckpt
    busy = root / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert_refusal(*cli(capsys, "export", ck, "--format", "hf", "--out", busy)[::2], "did not write")
    assert (busy / "keep.txt").is_file()
    # --overwrite replaces only an earlier export: a user's file in --out is never deleted
    assert_refusal(*cli(capsys, "export", ck, "--format", "hf", "--out", busy, "--overwrite")[::2], "did not write")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    (busy / "keep.txt").unlink()
    rc, _, err = cli(capsys, "export", ck, "--format", "hf", "--out", busy, "--overwrite")
    assert rc == 0, err
    assert (busy / "config.json").is_file()
    assert_refusal(*cli(capsys, "export", ck, "--format", "hf", "--out", busy)[::2], "earlier `export` output")
    rc, _, err = cli(capsys, "export", ck, "--format", "hf", "--out", busy, "--overwrite")
    assert rc == 0, err
    assert_refusal(*cli(capsys, "export", ck, "--format", "onnx", "--out", root / "x")[::2], "unknown export format")
    assert_refusal(*cli(capsys, "export", root / "busy", "--format", "hf", "--out", root / "y")[::2], "no verified checkpoint")
    # a tokenizer of another size next to the weights: refused before anything is written
    odd = shutil.copytree(ck, root / "odd_tok")
    train_tokenizer(odd / "tokenizer.model", V + 20)
    odd_ck = write_weights_only_checkpoint(root / "odd_ck", read_model_tensors(resolve_checkpoint(ck)),
                                           resolve_checkpoint(ck).config, tokenizer_path=odd / "tokenizer.model")
    assert_refusal(*cli(capsys, "export", odd_ck, "--format", "hf", "--out", root / "z")[::2], "tokens but the model's vocab_size")
    assert not (root / "z").exists()


# --------------------------------------------------------------------------- bad HF inputs

def test_bad_hf_inputs_are_one_line_errors(hf_dirs, work, capsys):
    root, _ = work
    src, _ = hf_dirs[False]

    def variant(name, edit_cfg=None, drop=(), add=None):
        d = root / f"bad_{name}"
        shutil.copytree(src, d)
        for pattern in drop:
            for p in d.glob(pattern):
                p.unlink()
        if edit_cfg:
            cfg = json.loads((d / "config.json").read_text())
            edit_cfg(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if add:
            add(d)
        return d

    def run(d, needle):
        assert_refusal(*cli(capsys, "convert", "--from-hf", d, "--out", root / f"out_{d.name}")[::2], needle)
        assert not (root / f"out_{d.name}").exists()

    run(variant("nocfg", drop=["config.json"]), "no config.json")
    run(variant("gemma", edit_cfg=lambda c: c.update(architectures=["GemmaForCausalLM"], model_type="gemma")), "model_type 'gemma'")
    run(variant("arch", edit_cfg=lambda c: c.update(architectures=["MistralForCausalLM"])), "is not LlamaForCausalLM")
    run(variant("shape", edit_cfg=lambda c: c.update(intermediate_size=128)), "has shape")
    run(variant("bin", drop=["*.safetensors"], add=lambda d: (d / "pytorch_model.bin").write_bytes(b"not unpickled")), "safetensors")
    run(variant("vocab", drop=["tokenizer.model"], add=lambda d: train_tokenizer(d / "tokenizer.model", V + 20)), "tokens")
    run(root / "does_not_exist", "not a directory")
