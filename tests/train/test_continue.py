"""Continued pretraining end to end, through the command line: a published Llama (made here with transformers:
random init, a real SentencePiece tokenizer, safetensors) -> `convert --from-hf` -> `tokenizer
extend` -> `prepare --tokenizer` -> `train --init-from` stage 1 (embeddings and lm_head only) ->
stage 2 (everything, from the stage-1 run) -> `export --format hf` -> transformers loads it.

Checked against independent references: the first step's loss (computed before any update) is
transformers' loss of the HF model, its embeddings grown with the mean of the base rows of each
new piece's base-tokenizer split (computed here in float64), on the same batch; stage 1 leaves the
decoder bit-identical to the HF weights; the exported folder's logits are ours. The step-0 checks
on their own (the loss on text both tokenizers encode alike, base rows bit-identical) are
tests/model/test_init_from.py's, on the hook this command uses."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers

from mspretrain.cli import main
from tests.conftest import TINY
from tests.helpers.hf import HF_VOCAB, tiny_hf_llama, train_tokenizer

BASE_CHARS = [chr(c) for c in range(0x4E00, 0x4E00 + 40)]  # what the base tokenizer was trained on
ADD = 16


def _cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0, argv


def _corpus(path: Path) -> Path:
    """Documents made of a few dozen recurring 2-3 character words: pieces worth adding."""
    rng = random.Random(7)
    words = ["".join(rng.choice(BASE_CHARS) for _ in range(rng.choice((2, 3)))) for _ in range(30)]
    docs = ["".join(rng.choice(words) for _ in range(rng.randint(10, 30))) + "。" for _ in range(600)]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_continue_from_a_published_llama(tmp_path):
    from safetensors.numpy import load_file

    from mspretrain.checkpoint.model import load_model
    from mspretrain.data.loader import Loader

    # a "published" model: HF folder with safetensors weights and its tokenizer.model
    hf_dir = tmp_path / "published"
    published = tiny_hf_llama(seed=0)
    published.save_pretrained(hf_dir, safe_serialization=True)
    base_tok = train_tokenizer(tmp_path / "base" / "tokenizer.model", HF_VOCAB)
    shutil.copy(base_tok, hf_dir / "tokenizer.model")
    assert (hf_dir / "model.safetensors").is_file()

    converted, ext, data = tmp_path / "converted", tmp_path / "tok-zh", tmp_path / "data"
    s1, s2, out = tmp_path / "stage1", tmp_path / "stage2", tmp_path / "export"
    _cli("convert", "--from-hf", hf_dir, "--out", converted, "--quiet")
    corpus = _corpus(tmp_path / "zh.txt")
    _cli("tokenizer", "extend", base_tok, "--train", corpus, "--add", ADD, "--out", ext)
    _cli("prepare", corpus, "--out", data, "--tokenizer", ext / "tokenizer.model", "--config", TINY, "--quiet")
    base_sp, ext_sp = spm.SentencePieceProcessor(model_file=str(base_tok)), spm.SentencePieceProcessor(model_file=str(ext / "tokenizer.model"))
    vx = ext_sp.GetPieceSize()
    assert vx == HF_VOCAB + ADD and all(ext_sp.IdToPiece(i) == base_sp.IdToPiece(i) for i in range(HF_VOCAB))

    common = ["--config", TINY, "--data", data, "--quiet", "train.micro_batch=4", "train.log_every=1"]
    _cli("train", *common, "--run", s1, "--init-from", converted, "train.max_steps=3", "checkpoint.every=3",
         'train.trainable=["embeddings", "lm_head"]')
    _cli("train", *common, "--run", s2, "--init-from", s1, "train.max_steps=2", "checkpoint.every=2", "schedule.warmup_steps=0")
    _cli("export", s2, "--format", "hf", "--out", out)

    meta = json.loads((s1 / "run_meta.json").read_text())["init_from"]
    assert meta["kind"] == "checkpoint" and meta["resized"]["base_vocab"] == HF_VOCAB and meta["resized"]["vocab"] == vx
    assert meta["resized"]["split_mean"] == ADD and meta["resized"]["overall_mean"] == 0
    from mspretrain.forensics.report import build_report

    page = build_report(s1).read_text(encoding="utf-8")  # the report says where the weights came from
    assert meta["files"]["model.safetensors"] in page and f"{HF_VOCAB} -&gt; {vx}: {ADD} new rows" in page

    # Step 1's loss is the init model's: transformers' loss of the published model grown by the
    # independent reference rows, on the batch the loader gives step 1.
    sd = {k: v.numpy() for k, v in published.state_dict().items()}
    ref = tiny_hf_llama(seed=0)
    ref.resize_token_embeddings(vx)
    with torch.no_grad():
        for i in range(HF_VOCAB, vx):
            split = base_sp.EncodeAsIds(ext_sp.DecodeIds([i]))
            assert split, ext_sp.IdToPiece(i)
            for name, param in (("model.embed_tokens.weight", ref.model.embed_tokens.weight), ("lm_head.weight", ref.lm_head.weight)):
                param[i] = torch.tensor(sd[name].astype(np.float64)[split].mean(axis=0).astype(np.float32))
    batch = Loader([(data, 1.0)], split="train", seq_len=32, batch_size=4, seed=1234, log=lambda s: None).next_batch().tokens
    with torch.no_grad():
        want = float(ref(torch.tensor(batch.astype(np.int64)), labels=torch.tensor(batch.astype(np.int64))).loss)
    first = json.loads((s1 / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and abs(first["loss"] - want) <= 1e-5, (first["loss"], want)

    # Stage 1 trained only the embeddings and lm_head: the rest is the published weights, bit for bit.
    hf_names = load_file(str(converted / "model.safetensors"))
    stage1 = load_file(str(s1 / "checkpoints" / "step_000003" / "model.safetensors"))
    for name, value in hf_names.items():
        if name not in ("embed.weight", "lm_head.weight"):
            assert np.array_equal(stage1[name], value), f"frozen {name} changed"
    assert not np.array_equal(stage1["embed.weight"][:HF_VOCAB], hf_names["embed.weight"])
    stage2 = load_file(str(s2 / "checkpoints" / "step_000002" / "model.safetensors"))
    assert not np.array_equal(stage2["layers.0.attn.wo.weight"], hf_names["layers.0.attn.wo.weight"])  # stage 2 trains all

    # transformers loads the export: the same logits as ours, and the extended tokenizer
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load_model(s2)
    text = "".join(ext_sp.DecodeIds([i]) for i in range(HF_VOCAB, HF_VOCAB + 6)) + BASE_CHARS[0] + BASE_CHARS[5]
    ids = ours.tokenizer.encode(text)
    assert any(i >= HF_VOCAB for i in ids)
    at = transformers.AutoTokenizer.from_pretrained(out)
    assert at.encode(text, add_special_tokens=False) == ids
    import mindspore as ms

    mine = ours.model(ms.Tensor(np.array([ids], np.int32))).asnumpy()
    with torch.no_grad():
        hf_logits = theirs(torch.tensor([ids])).logits.numpy()
    assert hf_logits.shape == mine.shape == (1, len(ids), vx)
    assert np.abs(mine - hf_logits).max() <= 1e-4
