"""Config schema: TOML instances, key=value overrides, and errors that name the key and the fix."""
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from mspretrain import budget
from mspretrain.config import schema as cfgmod
from mspretrain.config.sections.base import choices
from mspretrain.errors import UserError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_validates(path):
    cfg = cfgmod.load(path)
    cfgmod.validate(cfg, device="ascend" if cfg.device.target == "ascend" else "cpu")
    assert cfgmod.load(None, []) == cfgmod.Config()


def test_llama2_7b_shapes():
    m = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / "llama2-7b.toml").model
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
    assert budget.micro_batches(cfg, 4) == (2, 2)
    with pytest.raises(UserError, match="not divisible by 3 ranks"):
        budget.micro_batches(cfg, 3)


def test_malformed_file_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 4", encoding="utf-8")
    with pytest.raises(UserError, match="not valid TOML"):
        cfgmod.load(bad)
    with pytest.raises(UserError, match="does not exist"):
        cfgmod.load(tmp_path / "missing.toml")


# The accepted values before the schema moved them into `Literal` types: the set must not change.
OLD_CHOICES = {
    "data.token_dtype": ("int32", "int64"),
    "optim.lr_scaling": ("none", "sqrt"),
    "optim.moment_dtype": ("fp32", "bf16"),
    "schedule.kind": ("cosine", "two_phase", "wsd", "constant"),
    "train.mode": ("jit", "pynative"),
    "precision.dtype": ("fp32", "fp16", "bf16"),
    "precision.loss_scale": ("auto", "dynamic", "static", "none"),
    "precision.allreduce_dtype": ("fp32", "fp16"),
    "precision.param_dtype": ("fp32", "compute"),
    "checkpoint.on_error": ("stop", "continue"),
    "device.target": ("auto", "cpu", "ascend"),
    "device.jit_level": ("O0", "O1"),
    "spike.action": ("warn", "rewind"),
    "train.trainable": ("all", "embeddings", "attention", "mlp", "norms", "lm_head"),
    "model.family": ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe"),
    "model.rope_scaling": ("none", "llama3"),
}


def test_choices_are_the_literal_types():
    base = cfgmod.Config()
    found = {f"{s}.{f.name}": choices(type(getattr(base, s)), f.name)
             for s in cfgmod.SECTIONS for f in fields(getattr(base, s)) if choices(type(getattr(base, s)), f.name)}
    assert found == OLD_CHOICES
    for key, allowed in OLD_CHOICES.items():
        value = '["bogus"]' if key == "train.trainable" else "bogus"
        with pytest.raises(UserError, match=f"{key}.* is not one of {', '.join(allowed)}"):
            cfgmod.load(None, [f"{key}={value}"])


def test_each_section_checks_itself_when_built():
    """Not only through `validate`: a section built directly or by `replace` is checked too."""
    with pytest.raises(UserError, match="model.n_heads = 5 does not divide model.dim"):
        cfgmod.ModelConfig(n_heads=5)
    with pytest.raises(UserError, match="optim.weight_decay = nan is not a finite number"):
        replace(cfgmod.OptimConfig(), weight_decay=float("nan"))
    with pytest.raises(UserError, match="precision.dtype = 'fp8' is not one of"):
        cfgmod.PrecisionConfig(dtype="fp8")
    with pytest.raises(UserError, match="prepare.vocab_size = 100 is too small"):
        cfgmod.PrepareConfig(vocab_size=100)
    # a replace that stays valid keeps working, and the rules of the whole run wait for `validate`
    cfg = replace(cfgmod.Config(), data=cfgmod.DataConfig(seq_len=4096))
    with pytest.raises(UserError, match="exceeds model.max_seq_len"):
        cfgmod.validate(cfg, budget=False)


def test_overrides_of_one_section_apply_together_in_any_order():
    # param_dtype=compute alone is invalid with the default fp32; with fp16 in the same command it is not
    for overrides in (["precision.param_dtype=compute", "precision.dtype=fp16"],
                      ["precision.dtype=fp16", "precision.param_dtype=compute"]):
        cfg = cfgmod.load(None, overrides)
        assert (cfg.precision.dtype, cfg.precision.param_dtype) == ("fp16", "compute")
    assert cfgmod.load(None, ["model.n_heads=6", "model.dim=96"]).model.n_heads == 6
    assert cfgmod.apply_overrides(cfgmod.Config(), ["train.max_steps=3", "train.max_steps=4"]).train.max_steps == 4
    with pytest.raises(UserError, match="precision.param_dtype = compute only applies"):
        cfgmod.load(None, ["precision.dtype=fp16", "precision.param_dtype=compute", "precision.dtype=fp32"])


def test_overrides_lay_over_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[precision]\ndtype = "fp16"\nparam_dtype = "compute"\n[train]\nmax_steps = 9\n', encoding="utf-8")
    cfg = cfgmod.load(path, ["precision.dtype=bf16", "train.global_batch=4"])
    assert (cfg.precision.dtype, cfg.precision.param_dtype, cfg.train.max_steps, cfg.train.global_batch) == ("bf16", "compute", 9, 4)
    with pytest.raises(UserError, match="param_dtype = compute only applies"):
        cfgmod.load(path, ["precision.dtype=fp32"])


def test_the_budget_is_a_training_rule_only():
    cfg = cfgmod.Config()  # no budget: a valid config for prepare and plan
    cfgmod.validate(cfg, device="cpu", budget=False)
    with pytest.raises(UserError, match="both missing"):
        cfgmod.check_budget(cfg.train)
    with pytest.raises(UserError, match="bf16 is not supported on CPU"):
        cfgmod.check_device(cfgmod.load(None, ["precision.dtype=bf16"]), "cpu")


@pytest.mark.parametrize("value, message", [
    ('["all", "mlp"]', 'mixes "all" with other groups'),
    ("[]", "is empty"),
    ('["mlp", "mlp"]', "names a group twice"),
    ('["embedding"]', "'embedding' is not one of all, embeddings"),
    ("embeddings", "is not a list"),
    ("[1]", "1 is not one of"),
])
def test_trainable_groups(value, message):
    assert cfgmod.Config().train.trainable == ("all",)
    cfg = cfgmod.load(None, ['train.trainable=["embeddings", "lm_head"]'])
    assert cfg.train.trainable == ("embeddings", "lm_head")
    with pytest.raises(UserError) as err:
        cfgmod.load(None, [f"train.trainable={value}"])
    assert message in str(err.value) and "train.trainable" in err.value.cause and "\n" not in str(err.value)


def test_new_eval_keys_round_trip(tmp_path):
    cfg = cfgmod.load(None, ["eval.choices_file=mc.jsonl", 'eval.choices_dev_file="dev.jsonl"', "eval.choices_shots=5",
                             'train.trainable=["embeddings", "lm_head"]'])
    assert (cfg.eval.choices_file, cfg.eval.choices_dev_file, cfg.eval.choices_shots) == ("mc.jsonl", "dev.jsonl", 5)
    cfgmod.save(cfg, tmp_path / "c.toml")
    assert cfgmod.load(tmp_path / "c.toml") == cfg
    with pytest.raises(UserError, match="eval.choices_shots = -1 must not be negative"):
        cfgmod.load(None, ["eval.choices_shots=-1"])


# A finder that makes `import tomllib` fail, as on Python 3.10 (which has no tomllib).
_NO_TOMLLIB = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "tomllib":
            raise ModuleNotFoundError("No module named 'tomllib'", name="tomllib")
        return None
sys.meta_path.insert(0, _Block())
from mspretrain.config import schema as config
assert "tomllib" not in sys.modules and config.tomllib.__name__ == "tomli", config.tomllib
cfg = config.load(sys.argv[1], ["optim.lr=1e-3", "precision.dtype=fp16"])
assert (cfg.train.max_steps, cfg.optim.lr, cfg.precision.dtype) == (7, 1e-3, "fp16"), cfg
try:
    config.load(sys.argv[2])
except config.UserError as exc:
    print(exc.cause)
"""


def test_config_loads_without_tomllib(tmp_path):
    """Python 3.10 has no tomllib: config falls back to tomli (pyproject: tomli; python_version < "3.11")."""
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("[train]\nmax_steps = 7\n", encoding="utf-8")
    bad.write_text("[train\n", encoding="utf-8")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-B", "-c", _NO_TOMLLIB, str(good), str(bad)], cwd=root, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert "is not valid TOML" in out.stdout
