"""Our C BPE encoder (mspretrain/data/_bpe.c) against SentencePiece, the reference: the same ids
for every text, and SentencePiece itself for every model shape the C encoder does not cover."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from sentencepiece import sentencepiece_model_pb2

from mspretrain.data.tokenizer import Tokenizer, train_sentencepiece
from mspretrain.errors import UserError
from tests.conftest import make_poems

EXTRA = "abcxyz ABC 0123456789 .,!?-_/ \t\n\r\x00 ＡＢ１２　😀🀄𠮷 é\u0301 \ufffd\uffff ▁ 龘靐齉"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    texts = make_poems(300, seed=11) + ["hello world 2024 abc abc abc", "Python 3.11 和 MindSpore 2.10"] * 20
    t, _ = train_sentencepiece(texts, tmp_path_factory.mktemp("bpe"), 900)
    return t


def texts_to_check(n: int = 3000) -> list[str]:
    """Poems, and random strings over the poems' characters plus spaces, Latin, digits, control
    characters, astral and unknown characters: runs of equal characters exercise the ties."""
    rng = random.Random(0)
    poems = make_poems(400, seed=12)
    pool = list(dict.fromkeys("".join(poems[:50]))) + list(EXTRA)
    fixed = ["", " ", "  ", "a", "aaaaaaaaaaaaaaaa", "的的的的的的的的的的", "  leading and trailing  ", "\x00\x00", "😀", EXTRA]
    rand = ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 80))) for _ in range(n)]
    return fixed + poems + rand + [p.replace("\n", " ") * 20 for p in poems[:20]]


def reference(tok: Tokenizer, texts: list[str]) -> tuple[list[int], list[int]]:
    """SentencePiece's own ids, one public call per text, with the EOS prepare appends."""
    ids = [list(tok._sp.EncodeAsIds(t)) + [tok.eos_id] for t in texts]
    return [i for x in ids for i in x], [len(x) for x in ids]


def _built_or_buildable() -> bool:
    """False only where the extension is missing and there is no C compiler to build it: the
    README supports installing without one (prepare then uses SentencePiece's encoder)."""
    import shutil
    import sysconfig

    try:
        from mspretrain.data import _bpe  # noqa: F401

        return True
    except ImportError:
        cc = (sysconfig.get_config_var("CC") or "cc").split()
        return bool(cc) and shutil.which(cc[0]) is not None


NEEDS_EXTENSION = pytest.mark.skipif(not _built_or_buildable(), reason="no C compiler here: the C encoder is optional and was not built")


@NEEDS_EXTENSION
def test_the_extension_is_built():
    # The build is optional (pip succeeds without a compiler), so a broken build would only
    # show as a slower prepare; on a machine with a compiler it must be there.
    from mspretrain.data import _bpe  # noqa: F401


@NEEDS_EXTENSION
def test_same_ids_as_sentencepiece(tok):
    assert tok._bpe_encoder() is not None  # the model prepare trains is one the C encoder covers
    texts = texts_to_check()
    flat, lengths = tok.encode_flat(texts, tok.eos_id, np.dtype(np.uint16))
    want_flat, want_lengths = reference(tok, texts)
    assert flat.dtype == np.uint16 and lengths.dtype == np.int32
    assert lengths.tolist() == want_lengths
    assert flat.tolist() == want_flat


def test_empty_batch(tok):
    flat, lengths = tok.encode_flat([], tok.eos_id, np.dtype(np.uint16))
    assert flat.size == 0 and lengths.size == 0


def _variant(tok: Tokenizer, tmp_path: Path, edit) -> Tokenizer:
    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(tok.path.read_bytes())
    edit(m)
    p = tmp_path / "variant.model"
    p.write_bytes(m.SerializeToString())
    return Tokenizer.load(p)


def _dummy_prefix(m):
    m.normalizer_spec.add_dummy_prefix = True


def _user_defined(m):
    m.pieces[-1].type = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED


def _unigram(m):  # the same pieces, segmented by SentencePiece's unigram (Viterbi) algorithm
    m.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.UNIGRAM


@pytest.mark.parametrize("edit", [_dummy_prefix, _user_defined, _unigram])
def test_other_model_shapes_go_to_sentencepiece(tok, tmp_path, edit):
    variant = _variant(tok, tmp_path, edit)
    assert variant._bpe_encoder() is None
    texts = texts_to_check(300)
    flat, lengths = variant.encode_flat(texts, variant.eos_id, np.dtype(np.uint16))
    want_flat, want_lengths = reference(variant, texts)
    assert lengths.tolist() == want_lengths and flat.tolist() == want_flat


def test_environment_switch(tok, monkeypatch):
    monkeypatch.setenv("MSPRETRAIN_BPE", "sentencepiece")
    plain = Tokenizer.load(tok.path)
    assert plain._bpe_encoder() is None
    texts = texts_to_check(200)
    for got, want in zip(plain.encode_flat(texts, tok.eos_id, np.dtype(np.uint16)),
                         tok.encode_flat(texts, tok.eos_id, np.dtype(np.uint16))):
        np.testing.assert_array_equal(got, want)


def test_id_that_does_not_fit_the_dtype(tok):
    with pytest.raises(ValueError, match="does not fit"):
        tok.encode_flat(["床前明月光"], 300, np.dtype(np.uint8))


def test_unknown_switch_value_is_an_error(tok, monkeypatch):
    monkeypatch.setenv("MSPRETRAIN_BPE", "fast")
    with pytest.raises(UserError, match="MSPRETRAIN_BPE=fast is not an encoder choice"):
        Tokenizer.load(tok.path).encode_flat(["床前明月光"], tok.eos_id, np.dtype(np.uint16))
