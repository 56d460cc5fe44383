"""Config schema: TOML instances, key=value overrides, and errors that name the key and the fix."""
from pathlib import Path

import pytest

from mspretrain import config as cfgmod
from mspretrain.errors import UserError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_validates(path):
    cfg = cfgmod.load(path)
    cfgmod.validate(cfg, device="ascend" if cfg.device.target == "ascend" else "cpu")
    assert cfgmod.load(None, []) == cfgmod.Config()


def test_llama2_7b_shapes():
    m = cfgmod.load(Path(__file__).resolve().parents[1] / "configs" / "llama2-7b.toml").model
    assert (m.dim, m.n_layers, m.n_heads, m.ffn_dim, m.vocab_size) == (4096, 32, 32, 11008, 32000)


def test_overrides_parse_toml_values():
    cfg = cfgmod.load(None, ["train.max_steps=50", "optim.lr=3e-4", "model.tie_embeddings=true",
                             'schedule.warmup_steps="auto"', "precision.dtype=fp16", "schedule.warmup_steps=7"])
    assert cfg.train.max_steps == 50 and cfg.optim.lr == 3e-4 and cfg.model.tie_embeddings is True
    assert cfg.precision.dtype == "fp16" and cfg.schedule.warmup_steps == 7


def test_resolved_config_round_trips(tmp_path):
    cfg = cfgmod.load(None, ["train.max_steps=5", 'data.sources=[{path="a", weight=0.5}]'])
    cfgmod.save(cfg, tmp_path / "c.toml")
    assert cfgmod.load(tmp_path / "c.toml") == cfg
    m = cfgmod.resolve_model(cfg.model, 1000)
    assert m.n_kv_heads == m.n_heads and m.ffn_dim == cfgmod.llama_ffn_dim(m.dim, m.multiple_of) and m.vocab_size == 1000


@pytest.mark.parametrize("override, message", [
    ("model.bogus=1", "unknown config key model.bogus"),
    ("bogus.key=1", "unknown config section"),
    ("train.max_steps=ten", "not a whole number"),
    ("model.n_heads=5", "does not divide model.dim"),
    ("model.n_kv_heads=3", "does not divide model.n_heads"),
    ("data.seq_len=0", "must be positive"),
    ("optim.lr=-1", "non-negative"),
    ("precision.dtype=fp8", "is not one of"),
    ("schedule.warmup_steps=\"soon\"", "neither an integer"),
    ("train.global_batch=6", "not divisible by train.micro_batch"),
])
def test_bad_values_are_rejected_with_the_key(override, message):
    with pytest.raises(UserError) as err:
        cfg = cfgmod.load(None, ["train.max_steps=5", "train.micro_batch=4", "train.global_batch=8", override])
        cfgmod.validate(cfg, device="cpu")
    assert message in str(err.value) and err.value.fix


def test_bf16_is_refused_on_cpu_only():
    cfg = cfgmod.load(None, ["train.max_steps=5", "precision.dtype=bf16"])
    with pytest.raises(UserError, match="bf16 is not supported on CPU"):
        cfgmod.validate(cfg, device="cpu")
    cfgmod.validate(cfg, device="ascend")


def test_budget_is_required_and_micro_batches_split():
    with pytest.raises(UserError, match="both missing"):
        cfgmod.validate(cfgmod.Config(), device="cpu")
    cfg = cfgmod.load(None, ["train.max_steps=5", "train.global_batch=16", "train.micro_batch=2"])
    assert cfgmod.micro_batches(cfg, 4) == (2, 2)
    with pytest.raises(UserError, match="not divisible by 3 ranks"):
        cfgmod.micro_batches(cfg, 3)


def test_malformed_file_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 4", encoding="utf-8")
    with pytest.raises(UserError, match="not valid TOML"):
        cfgmod.load(bad)
    with pytest.raises(UserError, match="does not exist"):
        cfgmod.load(tmp_path / "missing.toml")
