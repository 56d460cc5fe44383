"""`mspretrain tokenizer extend`: base pieces keep their ids, new Chinese pieces are appended and
pay off on held-out text, tokenizer.json encodes as tokenizer.model does, prepare uses it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from mspretrain.cli import main
from tests.conftest import TINY, make_poems

ADD = 300
WORDS = ("the quick brown fox jumps over lazy dog and then runs into a forest where many tall trees grow "
         "under bright sky while old friends talk about rain wind river mountain city road home").split()


def _english(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[i] for i in rng.integers(len(WORDS), size=16)) + f" {i}." for i in range(n)]


def _proto(path: Path):
    m = pb.ModelProto()
    m.ParseFromString(path.read_bytes())
    return m


def _sp(path: Path):
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(path.read_bytes())
    return sp


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A base tokenizer trained on English with a little Chinese, a Chinese corpus, and the
    extended tokenizer the command writes from it."""
    from mspretrain.data.tokenizer import train_sentencepiece

    d = tmp_path_factory.mktemp("extend")
    zh_lines = [line for poem in make_poems(2000, seed=5) for line in poem.split("\n")]
    (d / "zh.txt").write_text("\n".join(zh_lines) + "\n", encoding="utf-8")
    (d / "base").mkdir()
    train_sentencepiece(_english(3000, 0) + zh_lines[:20], d / "base", 400)
    base = d / "base" / "tokenizer.model"
    out = d / "ext"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["tokenizer", "extend", str(base), "--train", str(d / "zh.txt"), "--add", str(ADD), "--out", str(out)])
    assert rc == 0
    return {"dir": d, "base": base, "out": out, "zh": zh_lines, "stdout": buf.getvalue()}


def test_base_pieces_keep_ids_scores_types(made):
    base, ext = _proto(made["base"]), _proto(made["out"] / "tokenizer.model")
    assert len(ext.pieces) == len(base.pieces) + ADD
    for i, (a, b) in enumerate(zip(base.pieces, ext.pieces)):
        assert (a.piece, a.score, a.type) == (b.piece, b.score, b.type), i
    assert ext.normalizer_spec == base.normalizer_spec


def test_new_pieces_are_appended_chinese_and_new(made):
    base, ext = _proto(made["base"]), _proto(made["out"] / "tokenizer.model")
    have = {p.piece for p in base.pieces}
    new = list(ext.pieces)[len(base.pieces):]
    assert len({p.piece for p in new}) == ADD and not {p.piece for p in new} & have
    assert all(p.type == pb.ModelProto.SentencePiece.NORMAL for p in new)
    assert sum(any("\u4e00" <= c <= "\u9fff" for c in p.piece) for p in new) >= ADD * 0.9
    # Scores continue below the base (base merges keep priority; tokenizer.json ranks by score).
    lowest = min(p.score for p in base.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL)
    assert all(b.score < a.score for a, b in zip(new, new[1:])) and new[0].score < lowest
    # Every new piece can actually be produced: it is what SentencePiece gives for its own string.
    sp = _sp(made["out"] / "tokenizer.model")
    formed = sum(sp.EncodeAsIds(p.piece) == [len(base.pieces) + k] for k, p in enumerate(new))
    assert formed >= ADD * 0.9, formed


def test_chinese_chars_per_token_improves_on_held_out(made):
    held = [line for i, line in enumerate(made["zh"]) if line.strip() and i % 20 == 19]
    chars = sum(map(len, held))
    before = chars / sum(map(len, _sp(made["base"]).Encode(held)))
    after = chars / sum(map(len, _sp(made["out"] / "tokenizer.model").Encode(held)))
    assert after > 1.5 * before, (before, after)
    # The command printed the same figures (it holds out every 20th line too).
    m = re.search(r"chars per token on the held-out slice \(([\d,]+) documents.*\): ([\d.]+) before, ([\d.]+) after", made["stdout"])
    assert m, made["stdout"]
    assert int(m.group(1).replace(",", "")) == len(held)
    assert float(m.group(2)) == pytest.approx(before, abs=1e-3) and float(m.group(3)) == pytest.approx(after, abs=1e-3)


def test_text_without_new_strings_encodes_as_before(made):
    ext = _proto(made["out"] / "tokenizer.model")
    new = [p.piece.replace("▁", " ") for p in list(ext.pieces)[len(_proto(made["base"]).pieces):]]
    texts = _english(200, 9) + ["hello world 2024", "  spaces  and\ttabs\n", "😀 emoji ü"]
    texts = [t for t in texts if not any(n in t for n in new)]
    assert len(texts) > 150
    a, b = _sp(made["base"]), _sp(made["out"] / "tokenizer.model")
    assert [a.EncodeAsIds(t) for t in texts] == [b.EncodeAsIds(t) for t in texts]


def test_tokenizer_json_encodes_like_the_model(made):
    from mspretrain.data.tokenizer import Tokenizer

    sample = made["zh"][:300] + _english(100, 3) + ["混合 text 与 123 数字", "  前后空格  ", "生僻字𠮷和😀", "a\nb\tc"]
    sp = _sp(made["out"] / "tokenizer.model")
    want = [sp.EncodeAsIds(t) for t in sample]
    hf = Tokenizer.load(made["out"] / "tokenizer.json")  # the `tokenizers` library underneath
    assert hf._hf is not None and hf.vocab_size == len(sp)
    assert [hf.encode(t) for t in sample] == want
    assert (hf.bos_id, hf.eos_id, hf.unk_id) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    assert [hf.decode(ids) for ids in want[:50]] == sample[:50]


def test_prepare_uses_the_extended_tokenizer(made, tmp_path):
    from mspretrain.data.shards import IndexedDataset
    from mspretrain.data.tokenizer import sha256_file

    tok = made["out"] / "tokenizer.model"
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(make_poems(200, seed=8)) + "\n", encoding="utf-8")
    out = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(out), "--tokenizer", str(tok), "--config", str(TINY), "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["vocab_size"] == len(_proto(made["base"]).pieces) + ADD
    assert manifest["tokenizer_sha256"] == sha256_file(tok)
    assert (out / "tokenizer.model").read_bytes() == tok.read_bytes()
    ids = np.asarray(IndexedDataset(out / "train").tokens)
    assert int(ids.max()) >= len(_proto(made["base"]).pieces)  # new pieces are used


def test_with_other_model_and_rerun_is_identical(made, tmp_path):
    out = tmp_path / "with"
    assert main(["tokenizer", "extend", str(made["base"]), "--with", str(made["out"] / "tokenizer.model"),
                 "--add", "50", "--out", str(out), "--quiet"]) == 0
    a, b = _proto(out / "tokenizer.model"), _proto(made["out"] / "tokenizer.model")
    assert [p.piece for p in a.pieces] == [p.piece for p in b.pieces][: len(a.pieces)] and len(a.pieces) == 400 + 50
    # Running again into its own output is allowed and gives the same bytes (deterministic).
    first = (out / "tokenizer.model").read_bytes()
    assert main(["tokenizer", "extend", str(made["base"]), "--with", str(made["out"] / "tokenizer.model"),
                 "--add", "50", "--out", str(out), "--quiet"]) == 0
    assert (out / "tokenizer.model").read_bytes() == first


def _fails(capsys, argv: list[str], match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("hint: "), err
    assert re.search(match, err[0]), err[0]


def test_errors_are_one_line(made, tmp_path, capsys):
    base, zh = str(made["base"]), str(made["dir"] / "zh.txt")
    out = str(tmp_path / "o")
    _fails(capsys, ["tokenizer", "extend", str(tmp_path / "missing.model"), "--train", zh, "--add", "5", "--out", out], "does not exist")
    _fails(capsys, ["tokenizer", "extend", zh, "--train", zh, "--add", "5", "--out", out], "is not a SentencePiece model")
    _fails(capsys, ["tokenizer", "extend", base, "--train", zh, "--add", "0", "--out", out], r"argument --add: 0 is outside \[1, ")
    _fails(capsys, ["tokenizer", "extend", base, "--train", zh, "--out", out], "--add N is required")
    small = tmp_path / "small.txt"
    small.write_text("\n".join(["春风又绿江南岸", "明月何时照我还"] * 30) + "\n", encoding="utf-8")
    _fails(capsys, ["tokenizer", "extend", base, "--train", str(small), "--add", "5000", "--out", out],
           r"yields only \d+ new pieces, fewer than --add 5000")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine", encoding="utf-8")
    _fails(capsys, ["tokenizer", "extend", base, "--train", zh, "--add", "5", "--out", str(busy)], "already holds files")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and (busy / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert not Path(out).exists()


def test_transformers_reads_the_extended_model_as_export_ships_it(made, tmp_path):
    """`export --format hf` copies tokenizer.model with a LlamaTokenizer config: transformers'
    own conversion (merges ranked by score) must encode like SentencePiece, new pieces included."""
    transformers = pytest.importorskip("transformers")
    import shutil

    shutil.copy(made["out"] / "tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False, "legacy": False,
         "add_prefix_space": False}), encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    sp = _sp(made["out"] / "tokenizer.model")
    sample = made["zh"][:200] + _english(50, 4) + ["  two spaces", "a\tb 春风"]
    assert [hf.encode(t, add_special_tokens=False) for t in sample] == [sp.EncodeAsIds(t) for t in sample]
    assert max(i for t in sample for i in sp.EncodeAsIds(t)) >= len(_proto(made["base"]).pieces)
