"""Byte-level BPE tokenizers (Qwen2/2.5, Qwen3, Llama-3 ship one as tokenizer.json) and vocabularies
above 65,535: special ids from the file (a Qwen tokenizer has no BOS), prepare with the
`tokenizers` library into int32 shards (Megatron dtype code 4), the loader and a train run on ids
above 65,535, and `tokenizer extend`'s one-line refusal of a byte-level BPE."""
from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mspretrain.data.tokenizer import Tokenizer
from tests.conftest import TINY, make_poems
from tests.helpers.cli import assert_refusal, cli

# Two training runs on a 66,001-token vocabulary (~60 s of CPU): `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

RESERVED = 65_400  # unreachable filler entries, as Llama-3's reserved tokens: every merge id lands above 65,535


def byte_bpe(path: Path, style: str) -> Path:
    """A byte-level BPE tokenizer.json trained here with `tokenizers` on the test poems, its merged
    tokens renumbered above 65,535; style "qwen": <|endoftext|> only (no BOS), "llama3":
    <|begin_of_text|> and <|end_of_text|>."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(make_poems(300), trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    doc = json.loads(tok.to_str())
    vocab = doc["model"]["vocab"]
    assert all(i < 256 for t, i in vocab.items() if len(t) == 1)
    new = {t: i for t, i in vocab.items() if i < 256}
    new.update({f"<r{k}>": 256 + k for k in range(RESERVED)})
    new.update({t: i + RESERVED for t, i in vocab.items() if i >= 256})
    doc["model"]["vocab"] = new
    specials = ["<|endoftext|>"] if style == "qwen" else ["<|begin_of_text|>", "<|end_of_text|>"]
    doc["added_tokens"] = [{"id": len(new) + k, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for k, s in enumerate(specials)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytebpe")
    return {style: byte_bpe(root / style / "tokenizer.json", style) for style in ("qwen", "llama3")} | {"root": root}


def test_special_tokens_come_from_the_file(big):
    qwen, llama3 = Tokenizer.load(big["qwen"]), Tokenizer.load(big["llama3"])
    assert qwen.vocab_size == llama3.vocab_size - 1 > 65_535
    assert qwen.bos_id == -1 and qwen.eos_id == qwen.vocab_size - 1  # Qwen: no BOS, <|endoftext|> ends documents
    assert (llama3.bos_id, llama3.eos_id) == (llama3.vocab_size - 2, llama3.vocab_size - 1)
    text = "第1首\n春眠不觉晓，处处闻啼鸟。"
    ids = qwen.encode(text)
    assert max(ids) > 65_535 and qwen.decode(ids) == text
    assert qwen.encode_batch([text, text]) == [ids, ids]


def test_vocab_above_65535_round_trips_prepare_int32_shards_loader_and_train(big, capsys):
    from mspretrain.data.loader import Loader  # noqa: F401  (the train run below reads through it)

    root = big["root"]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(make_poems(300, seed=5)) + "\n", encoding="utf-8")
    data, run = root / "data", root / "run"
    rc, _, err = cli(capsys, "prepare", corpus, "--out", data, "--tokenizer", big["qwen"], "--config", TINY, "--workers", "2")
    assert rc == 0, err
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["token_dtype"] == "int32", manifest
    idx = sorted(data.glob("**/*.idx"))
    assert idx, list(data.iterdir())
    for f in idx:
        head = f.read_bytes()[:18]
        assert head[:9] == b"MMIDIDX\x00\x00" and head[17] == 4  # Megatron's dtype code 4 = int32
    ids = np.concatenate([np.fromfile(f.with_suffix(".bin"), dtype=np.int32) for f in idx])
    tok = Tokenizer.load(big["qwen"])
    assert ids.max() > 65_535 and ids.max() < tok.vocab_size and (ids == tok.eos_id).sum() >= 250
    rc, _, err = cli(capsys, "train", "--config", TINY, "--data", data, "--run", run, "--quiet", "train.max_steps=3",
                     "checkpoint.every=3", "eval.every=0")
    assert rc == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 2 and all(np.isfinite(losses))
    # a model of the tokenizer's size: the loss starts near ln(V) of a 65.7 K vocabulary
    assert abs(losses[0] - np.log(tok.vocab_size)) < 1.0


def test_tokenizer_extend_refuses_a_byte_level_bpe_in_one_line(big, capsys, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("春眠不觉晓\n", encoding="utf-8")
    rc, _, err = cli(capsys, "tokenizer", "extend", big["qwen"], "--train", corpus, "--add", "10", "--out", tmp_path / "o")
    assert_refusal(rc, err, "byte-level BPE")
    assert not (tmp_path / "o").exists()


def test_padded_qwen_embedding_converts_trains_from_init_and_exports(big, capsys):
    """Qwen2.5 ships 152,064 embedding rows for 151,665 tokens: a model with more rows than its
    tokenizer has pieces converts, trains with --init-from on data from its own tokenizer.json
    (every row kept, no resize), and exports a folder transformers loads."""
    import torch
    import transformers

    root = big["root"] / "padded"
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(make_poems(300), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    n_tok, rows = tok.get_vocab_size(), tok.get_vocab_size() + 64
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=rows, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|endoftext|>")))
    hf.save_pretrained(root / "hf")
    tok.save(str(root / "hf" / "tokenizer.json"))
    corpus = root / "c.txt"
    corpus.write_text("\n\n".join(make_poems(200, seed=3)) + "\n", encoding="utf-8")
    rc, out, err = cli(capsys, "convert", "--from-hf", root / "hf", "--out", root / "ck")
    assert rc == 0 and f"vocab {rows}" in out and "family qwen2" in out, err
    rc, _, err = cli(capsys, "prepare", corpus, "--out", root / "data", "--tokenizer", root / "hf" / "tokenizer.json", "--config", TINY)
    assert rc == 0, err
    rc, out, err = cli(capsys, "train", "--config", TINY, "--data", root / "data", "--run", root / "run", "--init-from", root / "hf",
                       "train.max_steps=3", "checkpoint.every=3", "eval.every=0")
    assert rc == 0, err
    assert f"vocab {rows}" in out and "->" not in out.split("initialising", 1)[1].splitlines()[0]  # no resize
    from mspretrain.config import schema as cfgmod

    assert cfgmod.load(root / "run" / "config.toml").model.vocab_size == rows
    rc, out, err = cli(capsys, "export", root / "run", "--format", "hf", "--out", root / "export")
    assert rc == 0 and "HF Qwen2" in out, err
    back = transformers.AutoModelForCausalLM.from_pretrained(root / "export")
    assert type(back).__name__ == "Qwen2ForCausalLM" and back.config.vocab_size == rows and back.config.tie_word_embeddings
    assert transformers.AutoTokenizer.from_pretrained(root / "export").eos_token == "<|endoftext|>"
    assert n_tok < rows
