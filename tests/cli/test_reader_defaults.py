"""Readers of external files with their optional keys left out: the defaults they fill in are the
source of truth's, not ours. Every other test writes files that spell out every key, so a wrong
default for a key that older files omit would otherwise pass everything and silently change a model.

- HF config.json: transformers' own LlamaConfig, fed the same dict;
- C-Eval / CMMLU CSV: the layouts their repositories publish (C-Eval: `id,question,A,B,C,D,answer`,
  plus `explanation` in dev; CMMLU: an unnamed index column, `Question`, ..., `Answer`);
- a sentencepiece tokenizer without BOS/EOS/PAD: sentencepiece's own processor's ids;
- a data dir manifest with only the required keys: no tokenizer check to skip the id scan, no bpc;
- a TOML config with most keys absent: the dataclass defaults (docs/config-reference.md is checked
  against those in tests/docs/test_docs.py).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import fields

import numpy as np
import pytest

from mspretrain.errors import UserError

REQUIRED_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 32, "intermediate_size": 160, "vocab_size": 300}
# every optional key at a value that is NOT transformers' default, so dropping it changes the model
OPTIONAL_HF = {"num_key_value_heads": 2, "max_position_embeddings": 96, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
               "initializer_range": 0.01, "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False,
               "mlp_bias": False, "head_dim": 16, "rope_scaling": None}
# each family's own optional keys on top (a sliding window only Mistral has); every family's reader
# is checked against its own transformers config class (families.py: Qwen3's head_dim 128, the
# key/value heads' 32 of Qwen2/3 and 8 of Mistral)
FAMILY_HF = {"llama": ("LlamaConfig", {}), "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
             "qwen3": ("Qwen3Config", {"use_sliding_window": False}), "mistral": ("MistralConfig", {"sliding_window": 8})}


def _family_hf(family: str) -> tuple[dict, dict]:
    from mspretrain.families import family as row

    required = {**REQUIRED_HF, "architectures": [row(family).hf_class], "model_type": family}
    return required, {**OPTIONAL_HF, **FAMILY_HF[family][1]}


def _transformers_view(hf: dict, family: str = "llama") -> dict:
    """What transformers builds from `hf`, in our field names."""
    import transformers

    c = getattr(transformers, FAMILY_HF[family][0]).from_dict(dict(hf))
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    window = getattr(c, "sliding_window", None) or 0
    return {"n_kv_heads": c.num_key_value_heads, "max_seq_len": c.max_position_embeddings, "norm_eps": c.rms_norm_eps,
            "tie_embeddings": c.tie_word_embeddings, "init_std": c.initializer_range, "rope_theta": float(theta),
            "dim": c.hidden_size, "n_layers": c.num_hidden_layers, "n_heads": c.num_attention_heads,
            "ffn_dim": c.intermediate_size, "vocab_size": c.vocab_size,
            # the attention's own reading (modeling_*.py: `getattr(config, "head_dim", None) or hidden // heads`)
            "head_size": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            # Mistral's window; one at least the context is full attention (ours says 0)
            "sliding_window": 0 if family != "mistral" or window >= c.max_position_embeddings else window}


@pytest.mark.parametrize("family", list(FAMILY_HF))
@pytest.mark.parametrize("drop", ["(none)", *OPTIONAL_HF, "sliding_window", "(all)", "architectures", "model_type"])
def test_hf_config_defaults_are_transformers_defaults(family, drop):
    from mspretrain.model.hf import config_from_hf

    required, optional = _family_hf(family)
    hf = {**required, **optional}
    if drop == "(all)":
        hf = dict(required)
    elif drop == "model_type" and family != "llama":
        pytest.skip("a config.json without model_type is read as llama, as transformers' AutoConfig cannot read it at all")
    elif drop != "(none)":
        hf.pop(drop, None)
    ours = config_from_hf(hf)
    want = _transformers_view(hf, family)
    got = {k: getattr(ours, k) for k in want}
    assert got == pytest.approx(want), (family, drop)
    if drop == "(all)":  # the defaults really were exercised: transformers' values, not the file's
        kv, ctx, head = {"llama": (32, 2048, 8), "qwen2": (32, 32768, 8), "qwen3": (32, 32768, 128), "mistral": (8, 131072, 8)}[family]
        assert (got["n_kv_heads"], got["max_seq_len"], got["head_size"], got["tie_embeddings"]) == (kv, ctx, head, False)
        assert got["sliding_window"] == (4096 if family == "mistral" else 0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_a_kv_head_default_that_does_not_divide_the_heads_is_refused(family):
    """transformers fills an absent num_key_value_heads with its class default (32 or 8), not the
    head count: with 4 heads that is no model, so it is one line naming the default."""
    from mspretrain.model.hf import config_from_hf

    required, _ = _family_hf(family)
    with pytest.raises(UserError) as e:
        config_from_hf({**required, "num_attention_heads": 4, "hidden_size": 64})
    assert "Config's default) does not divide num_attention_heads 4" in e.value.cause
    assert config_from_hf({**required, "num_attention_heads": 4, "hidden_size": 64, "num_key_value_heads": None}).n_kv_heads == 4


def test_hf_config_rope_theta_of_transformers_5_wins_over_a_missing_top_level_key():
    from mspretrain.model.hf import config_from_hf

    hf = {**REQUIRED_HF, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert config_from_hf(hf).rope_theta == _transformers_view(hf)["rope_theta"] == 1e6


# --------------------------------------------------------------------------- C-Eval / CMMLU files

CEVAL_VAL = "id,question,A,B,C,D,answer\n0,一加一等于几？,一,二,三,四,B\n"
CEVAL_DEV = "id,question,A,B,C,D,answer,explanation\n0,二加二等于几？,四,二,三,五,A,1. 二加二是四\n"
CEVAL_NO_ID = "question,A,B,C,D,answer\n一加一等于几？,一,二,三,四,B\n"
CMMLU = ",Question,A,B,C,D,Answer\n0,一加一等于几？,一,二,三,四,B\n"


@pytest.mark.parametrize("text,label,first", [(CEVAL_VAL, 1, "一"), (CEVAL_DEV, 0, "四"), (CEVAL_NO_ID, 1, "一"), (CMMLU, 1, "一")],
                         ids=["ceval_val", "ceval_dev_explanation", "no_id_column", "cmmlu_index_column"])
def test_ceval_and_cmmlu_layouts_with_and_without_optional_columns(tmp_path, text, label, first):
    from mspretrain.eval.choices import CEVAL_ANSWER_CUE, read_choices

    p = tmp_path / "f.csv"
    p.write_text(text, encoding="utf-8")
    (item,) = read_choices(p)
    assert item.label == label and item.choices[0] == first and len(item.choices) == 4
    assert item.context.endswith(CEVAL_ANSWER_CUE) and "explanation" not in item.context and "1. " not in item.context


def test_ceval_test_split_without_answers_is_refused_in_one_line(tmp_path):
    """C-Eval's test split has no `answer` column: accuracy cannot be computed, so it is refused."""
    from mspretrain.eval.choices import read_choices

    p = tmp_path / "test.csv"
    p.write_text("id,question,A,B,C,D\n0,一加一等于几？,一,二,三,四\n", encoding="utf-8")
    with pytest.raises(UserError, match="missing answer"):
        read_choices(p)


# --------------------------------------------------------------------------- tokenizer files

def test_sentencepiece_model_without_bos_eos_pad_reports_sentencepieces_ids(tmp_path):
    import sentencepiece as spm

    from mspretrain.data.tokenizer import Tokenizer

    spm.SentencePieceTrainer.Train(sentence_iterator=iter(["春风明月", "江南山水", "花落日夜"] * 20),
                                   model_prefix=str(tmp_path / "t"), vocab_size=20, model_type="char",
                                   bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "t.model"))
    tok = Tokenizer.load(tmp_path / "t.model")
    assert tok.special_ids() == {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (-1, -1, -1)
    assert tok.encode("春风") == sp.encode("春风")


# --------------------------------------------------------------------------- data dir manifests

def test_manifest_with_only_the_required_keys(tmp_path, tiny_data):
    """An older or hand-made manifest: no tokenizer_sha256 (the id scan still runs), no
    chars_per_token (no bpc, rather than bits per *token* under the name bpc)."""
    from mspretrain.data.manifest import REQUIRED_MANIFEST_KEYS, check_data_dir, read_manifest
    from mspretrain.data.shards import IndexedDataset

    d = tmp_path / "data"
    shutil.copytree(tiny_data, d)
    full = json.loads((d / "manifest.json").read_text())
    minimal = {k: full[k] for k in REQUIRED_MANIFEST_KEYS}
    assert set(full) - set(minimal) >= {"tokenizer_sha256", "chars_per_token"}
    (d / "manifest.json").write_text(json.dumps(minimal))
    assert read_manifest(d) == minimal
    check_data_dir(d, minimal)  # passes: the tokens are in the vocabulary
    top = int(np.asarray(IndexedDataset(d / "train").tokens).max())
    with pytest.raises(UserError, match="vocab"):
        check_data_dir(d, {**minimal, "vocab_size": top})  # the largest id is out of range: still found


# --------------------------------------------------------------------------- TOML configs

def test_toml_with_one_key_per_section_leaves_every_other_field_at_its_default(tmp_path):
    from mspretrain.config import schema as cfgmod

    base = cfgmod.Config()
    p = tmp_path / "c.toml"
    p.write_text("[model]\ndim = 128\n[train]\nmax_steps = 7\n[optim]\nlr = 0.5\n", encoding="utf-8")
    got = cfgmod.load(p)
    assert (got.model.dim, got.train.max_steps, got.optim.lr) == (128, 7, 0.5)
    changed = {("model", "dim"), ("train", "max_steps"), ("optim", "lr")}
    for section in fields(base):
        want, have = getattr(base, section.name), getattr(got, section.name)
        for f in fields(want):
            if (section.name, f.name) not in changed:
                assert getattr(have, f.name) == getattr(want, f.name), f"{section.name}.{f.name}"
    assert cfgmod.load(tmp_path / "c.toml", ["schedule.kind=constant"]).schedule.kind == "constant"
    empty = tmp_path / "empty.toml"
    empty.write_text("", encoding="utf-8")
    assert cfgmod.load(empty) == base
