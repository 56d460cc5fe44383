"""checkpoint/model.load_model, the one road from a checkpoint to a model: the weights come back
exactly (logits equal the model that was saved), the vocabulary is read from the weights, the
tokenizer is found and checked, and every bad checkpoint is one UserError."""
from __future__ import annotations

import shutil
from dataclasses import replace

import mindspore as ms
import numpy as np
import pytest

from mspretrain.checkpoint.model import load_model
from mspretrain.checkpoint.store import resolve_checkpoint, write_weights_only_checkpoint
from mspretrain.config.schema import Config, ModelConfig, resolve_model
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.model.decoder import Decoder, state_numpy


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("ckmodel")
    tok = tiny_data / "tokenizer.model"
    vocab = Tokenizer.load(tok).vocab_size
    cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, ffn_dim=96, max_seq_len=64))
    model = Decoder(cfg, seed=5)
    state = state_numpy(model)
    # vocab_size 0 (automatic) in the saved config: the loader must take it from the weights
    auto = replace(Config(), model=replace(cfg, vocab_size=0))
    ck = write_weights_only_checkpoint(root / "ck", state, auto, tokenizer_path=tok)
    bare = write_weights_only_checkpoint(root / "bare", state, auto)
    return root, model, state, ck, bare, tok


def test_loads_the_saved_weights_with_its_tokenizer(saved):
    _, model, _, ck, _, tok = saved
    loaded = load_model(ck)
    assert loaded.config.model.vocab_size == model.cfg.vocab_size and loaded.ref.dir == ck and loaded.ref.step == 0
    assert loaded.tokenizer is not None and loaded.tokenizer.sha256() == Tokenizer.load(tok).sha256()
    assert loaded.model.dtype_name == "fp32" and not loaded.model.training
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 19)).astype(np.int32))
    np.testing.assert_array_equal(loaded.model(tokens).asnumpy(), model(tokens).asnumpy())


def test_resolved_ref_dtype_and_device_are_honoured(saved):
    _, _, _, ck, _, _ = saved
    ref = resolve_checkpoint(ck)
    loaded = load_model(ref, dtype="fp16", device="cpu")
    assert loaded.ref is ref and loaded.model.dtype_name == "fp16" and not loaded.model.use_flash


def test_tokenizer_missing_or_of_another_size_is_refused(saved):
    root, model, state, _, bare, tok = saved
    with pytest.raises(UserError, match="no tokenizer found"):
        load_model(bare)
    assert load_model(bare, need_tokenizer=False, device="cpu").tokenizer is None
    # a model 8 rows smaller than the tokenizer next to it (ids it cannot embed): refused even where it is optional
    shrunk = dict(state)
    for k in ("embed.weight", "lm_head.weight"):
        shrunk[k] = state[k][:-8]
    small = write_weights_only_checkpoint(root / "small", shrunk, Config(), tokenizer_path=tok)
    for need in (True, False):
        with pytest.raises(UserError, match="pieces but the model has vocab"):
            load_model(small, need_tokenizer=need, device="cpu")
    # 8 rows more than the tokenizer's pieces is a padded embedding (Qwen2.5: 152,064 rows, 151,665 tokens): loads
    grown = dict(state)
    for k in ("embed.weight", "lm_head.weight"):
        grown[k] = np.concatenate([state[k], np.zeros((8, state[k].shape[1]), np.float32)])
    auto = replace(Config(), model=replace(model.cfg, vocab_size=0))  # the vocabulary from the weights
    big = write_weights_only_checkpoint(root / "big", grown, auto, tokenizer_path=tok)
    assert load_model(big, device="cpu").config.model.vocab_size == state["embed.weight"].shape[0] + 8


def test_not_a_model_checkpoint_is_refused(saved):
    root, _, state, _, _, _ = saved
    ck = write_weights_only_checkpoint(root / "noembed", {k: v for k, v in state.items() if k != "embed.weight"}, Config())
    with pytest.raises(UserError, match="no embed.weight"):
        load_model(ck, need_tokenizer=False)
    with pytest.raises(UserError, match="does not exist"):
        load_model(root / "nowhere")
    broken = root / "broken"
    shutil.copytree(saved[3], broken)
    (broken / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="does not verify"):
        load_model(broken)
