"""Configuration: frozen dataclasses are the schema, TOML files are instances.

Design choices:
- One dataclass per TOML section; the section name is the field name on `Config`.
- Every value is checked before any compute (`validate`), with a message naming the key and
  the fix. Unknown keys are errors, never silently ignored.
- `key=value` overrides from the command line are parsed as TOML values (`lr=3e-4`,
  `tie_embeddings=true`, `warmup_steps="auto"`), falling back to a bare string.
- Values that depend on other values (ffn_dim, n_kv_heads, micro_batch) are resolved once into
  the saved config so a run dir always shows the numbers that ran.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import tomli_w

from mspretrain.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    """Architecture only: no batch size, no parallel layout, no paths."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = same as n_heads (no grouped-query attention)
    vocab_size: int = 0  # 0 = take the tokenizer's vocabulary size from the data dir
    ffn_dim: int = 0  # 0 = Llama's rule: 2/3 * 4 * dim rounded up to a multiple of multiple_of
    multiple_of: int = 32
    max_seq_len: int = 2048  # length of the RoPE tables
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass(frozen=True)
class PrepareConfig:
    """How `prepare` turns raw text into shards (cleaning rules are switchable one by one)."""

    vocab_size: int = 8000
    character_coverage: float = 0.9995
    tokenizer_sample_chars: int = 20_000_000  # bounded sample the tokenizer is trained on
    valid_fraction: float = 0.01
    doc_per_line: bool = False
    text_field: str = "text"
    min_chars: int = 8
    strip_html: bool = True
    remove_urls: bool = True
    remove_emails: bool = True
    drop_control: bool = True
    normalize_whitespace: bool = True
    nfkc: bool = True
    t2s: bool = False
    char_whitelist: bool = False
    max_dup_line_fraction: float = 0.3  # Gopher: share of lines that are duplicates of another
    max_top_ngram_fraction: float = 0.2  # Gopher: share of chars covered by the top 2-gram
    near_dedup: bool = False
    near_dedup_threshold: float = 0.8
    seed: int = 1234


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = 64
    # Corpus mixing: weighted data dirs, e.g. sources = [{path = "a/", weight = 0.7}, {path = "b/",
    # weight = 0.3}], all tokenized with the --data dir's tokenizer. Empty = the --data dir alone.
    sources: tuple = ()
    reset_attention_at_eos: bool = False
    token_dtype: str = "int32"  # int64 for the Ascend gather issue in the field report


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it
    decay_embeddings: bool = False
    lr_scaling: str = "none"  # "none" | "sqrt": lr * sqrt(global_batch / 32)
    z_loss: float = 0.0
    # ZeRO-1: each data-parallel rank keeps the Adam moments (and fp32 masters) of the parameters
    # it owns (about 1/N of them), updates those and all-gathers them; no effect with one rank.
    shard_optimizer: bool = False
    # ZeRO-2 (implies shard_optimizer): a rank also keeps the fp32 gradient-accumulation buffers
    # only for what it owns; every micro-batch's gradients are reduce-scattered into them. Saves
    # 4 bytes x (N-1)/N per parameter, costs one reduction per micro-batch instead of one per step.
    shard_gradients: bool = False
    # Cap of one collective's flat buffer in MB (a transient copy): gradients and parameters cross
    # ranks in a few buckets instead of one collective per parameter. 0 = one per parameter.
    bucket_mb: float = 256.0


@dataclass(frozen=True)
class ScheduleConfig:
    kind: str = "cosine"  # "cosine" | "two_phase" | "wsd" | "constant"
    warmup_steps: Union[int, str] = "auto"  # int or "auto" (field report formula on data tokens)
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # WSD: last share of steps spent decaying
    peak_ratio: float = 1.2  # two_phase: second phase rises to peak_ratio * lr


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 0  # 0 = not set; at least one of max_steps / max_tokens is needed
    max_tokens: int = 0
    global_batch: int = 8  # sequences per optimizer step, over all ranks and micro-batches
    micro_batch: int = 0  # 0 = global_batch / world size (no accumulation)
    seed: int = 1234
    log_every: int = 10
    mode: str = "jit"  # "jit" | "pynative"
    # Recompute each decoder layer's activations in the backward pass instead of keeping them:
    # activation memory drops to one layer's worth plus each layer's input, for ~1/3 more compute.
    recompute: bool = False


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp32"  # "fp32" | "fp16" | "bf16"
    loss_scale: str = "auto"  # "auto" (dynamic for fp16, none otherwise) | "dynamic" | "static" | "none"
    init_scale: float = 64.0  # the field report's starting scale
    scale_warmup_to: float = 0.0  # 0 = no linear warm-up of the scale
    scale_warmup_steps: int = 0
    growth_interval: int = 1000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    # Data-parallel gradient all-reduce in fp16 halves the bytes on the wire (the field report's
    # Ascend setting); lm_head's gradient always stays fp32. Loss-scaled, so overflow is caught.
    allreduce_dtype: str = "fp32"  # "fp32" | "fp16"
    # "fp32": parameters are the fp32 master weights, cast to `dtype` at use. "compute": the
    # decoder layers' matrices are stored in `dtype`, and fp32 master copies
    # live with the optimizer state (sharded with it under optim.shard_optimizer): 2 instead of
    # 4 bytes per parameter on every device. Same numbers either way: the matmuls read the same
    # rounded weights.
    param_dtype: str = "fp32"  # "fp32" | "compute"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100
    keep_last: int = 3
    keep_every: int = 0  # also keep every keep_every-th step forever; 0 = off
    async_save: bool = True
    on_error: str = "stop"  # "stop" | "continue"


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # 0 = only at the end
    max_tokens: int = 200_000
    batch_size: int = 8


@dataclass(frozen=True)
class DeviceConfig:
    target: str = "auto"  # "auto" | "cpu" | "ascend"
    threads: int = 0  # 0 = all cores
    cpu_quota: float = 0.0  # percent of all cores for the training process (cgroup v2); 0 = off
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = from the built-in table / measured
    # mindspore.set_deterministic: reproducible kernels and (on Ascend) HCCL_DETERMINISTIC=true with
    # serial kernel compilation, which costs step and compile time there. On by default; on
    # Ascend it is the user's choice (false for speed once a run is known to be healthy).
    deterministic: bool = True
    # "O1" (Ascend only): graph-kernel fusion through ms.jit's jit_level; "O0" is what MindSpore
    # Transformers trains with on 910B. The old enable_graph_kernel flag is deprecated in 2.10.
    jit_level: str = "O0"
    # Usable device memory in GB: 0 = the default (58 on Ascend 910B, the cap MindSpore
    # Transformers' 910B pretraining templates give max_device_memory; the machine's RAM on CPU).
    # `plan` compares its modelled peak with it, and on Ascend it is MindSpore's max_device_memory.
    max_device_memory: float = 0.0


@dataclass(frozen=True)
class MetricsConfig:
    """Each metric is sampled at its own interval (in steps), as the field report recommends."""

    loss_every: int = 1
    lr_every: int = 1
    loss_scale_every: int = 1
    grad_norm_every: int = 50
    memory_every: int = 200
    throughput_every: int = 10
    tensorboard: bool = True


@dataclass(frozen=True)
class SpikeConfig:
    window: int = 50  # rolling window of the loss mean
    threshold: float = 0.3  # flag a loss this far above the rolling mean (the field report's bar)
    grad_norm_factor: float = 5.0  # flag a grad norm this many times the rolling median
    action: str = "warn"  # "warn" | "rewind"
    rewind_skip: int = 0  # batches to skip after a rewind; 0 = as many as the steps rewound
    max_nonfinite: int = 10  # stop after this many non-finite losses in a row


@dataclass(frozen=True)
class CostConfig:
    price_per_device_hour: float = 0.0  # in your currency; 0 = no cost figures


@dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""  # e.g. "10-20": run the MindSpore profiler for those steps


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(Config))
# Keys that earlier versions wrote into run dirs and checkpoints: ignored when read, so old runs resume.
RETIRED: frozenset[str] = frozenset({"data.prefetch"})
CHOICES: dict[str, tuple[str, ...]] = {
    "data.token_dtype": ("int32", "int64"),
    "optim.lr_scaling": ("none", "sqrt"),
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
}


# --------------------------------------------------------------------------- loading

def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check one value against its annotated type; ints are accepted where floats are."""
    origin = get_origin(typ)
    if origin is Union:
        for option in get_args(typ):
            try:
                return _coerce(key, value, option)
            except UserError:
                continue
        names = " or ".join(getattr(t, "__name__", str(t)) for t in get_args(typ))
        raise UserError(f"{key} = {value!r} has the wrong type", f"give a {names}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key} = {value!r} is not a boolean", f"write {key}=true or {key}=false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"{key} = {value!r} is not a whole number", f"give {key} an integer, e.g. {key}=100")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UserError(f"{key} = {value!r} is not a number", f"give {key} a number, e.g. {key}=0.001")
    if typ is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(value)
        raise UserError(f"{key} = {value!r} is not a list", f"write {key} as a TOML array")
    if typ is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{key} = {value!r} is not a string", f'quote it: {key}="..."')
    return value


def _section_from_dict(section: str, cls: type, values: dict[str, Any], base: Any) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    updates = {}
    for key, value in values.items():
        if f"{section}.{key}" in RETIRED:
            continue
        if key not in known:
            # difflib's ratio, best first, ties by name: the same hint on every run (a set's order is not)
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {section}.{close[0]}?" if close else f"valid keys: {', '.join(sorted(known))}"
            raise UserError(f"unknown config key {section}.{key}", hint)
        updates[key] = _coerce(f"{section}.{key}", value, hints[key])
    return replace(base, **updates)


def from_dict(raw: dict[str, Any], base: Config | None = None) -> Config:
    """Build a Config from nested dicts (as read from TOML), on top of `base` or the defaults."""
    cfg = base or Config()
    for section, values in raw.items():
        if section not in SECTIONS:
            raise UserError(f"unknown config section [{section}]", f"valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise UserError(f"config section [{section}] is not a table", f"write it as [{section}] with key = value lines")
        cls = type(getattr(cfg, section))
        cfg = replace(cfg, **{section: _section_from_dict(section, cls, values, getattr(cfg, section))})
    return cfg


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config (or start from defaults) and apply `section.key=value` overrides."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist", "pass --config with a path to a .toml file, e.g. configs/tiny.toml")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {p} is not valid TOML: {exc}", "fix the syntax (key = value, strings in quotes)") from None
        cfg = from_dict(raw, cfg)
    return apply_overrides(cfg, overrides)


def parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form section.key=value", "write e.g. train.max_steps=50")
    key, _, value_text = text.partition("=")
    key = key.strip()
    if key.count(".") != 1:
        raise UserError(f"override key {key!r} must be section.key", f"sections: {', '.join(SECTIONS)}; e.g. train.max_steps=50")
    section, name = key.split(".")
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text  # a bare word such as fp16 or cosine
    return section, name, value


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    for text in overrides:
        section, name, value = parse_override(text)
        cfg = from_dict({section: {name: value}}, cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dumps(cfg: Config) -> str:
    return tomli_w.dumps(to_dict(cfg))


def save(cfg: Config, path: str | Path, notes: dict[str, str] | None = None) -> None:
    """Write `cfg` as TOML; `notes` ({"train.micro_batch": "text"}) become comments on those keys' lines."""
    text = dumps(cfg)
    if notes:
        lines, section = [], ""
        for line in text.splitlines():
            if line.startswith("["):
                section = line.strip("[]")
            key = line.split(" = ", 1)[0]
            note = notes.get(f"{section}.{key}") if " = " in line else None
            lines.append(f"{line}  # {note}" if note else line)
        text = "\n".join(lines) + "\n"
    Path(path).write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------- resolving

def llama_ffn_dim(dim: int, multiple_of: int) -> int:
    """Llama's hidden size rule: 2/3 of 4*dim, rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def resolve_model(m: ModelConfig, vocab_size: int | None = None) -> ModelConfig:
    """Fill the 0 = automatic fields of the model config."""
    updates: dict[str, Any] = {}
    if m.n_kv_heads == 0:
        updates["n_kv_heads"] = m.n_heads
    if m.ffn_dim == 0:
        updates["ffn_dim"] = llama_ffn_dim(m.dim, m.multiple_of)
    if m.vocab_size == 0 and vocab_size:
        updates["vocab_size"] = vocab_size
    return replace(m, **updates)


# --------------------------------------------------------------------------- validation

def _fail(key: str, problem: str, fix: str) -> None:
    raise UserError(f"{key} {problem}", fix)


def validate(cfg: Config, *, device: str | None = None) -> None:
    """Reject impossible values before any compute. `device` is the resolved target, if known."""
    # Every float of every section, present and future: NaN/inf pass `x < 0`-style range checks
    # (every comparison with NaN is False), and a NaN weight decay writes NaN weights into
    # checkpoints that verify. One loop over the schema, so a new float key cannot skip it.
    for sec in fields(Config):
        for f in fields(getattr(cfg, sec.name)):
            value = getattr(getattr(cfg, sec.name), f.name)
            for v in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(v, float) and not math.isfinite(v):
                    _fail(f"{sec.name}.{f.name}", f"= {v} is not a finite number", f"give {sec.name}.{f.name} a finite value (see docs/config-reference.md)")
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            _fail(key, f"= {value!r} is not one of {', '.join(allowed)}", f"set {key} to one of: {', '.join(allowed)}")

    m = cfg.model
    for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
        if getattr(m, name) <= 0:
            _fail(f"model.{name}", f"= {getattr(m, name)} must be positive", f"set model.{name} to a positive integer")
    for name in ("n_kv_heads", "vocab_size", "ffn_dim"):
        if getattr(m, name) < 0:
            _fail(f"model.{name}", f"= {getattr(m, name)} must not be negative", f"set model.{name} to 0 (automatic) or a positive integer")
    if m.dim % m.n_heads:
        _fail("model.n_heads", f"= {m.n_heads} does not divide model.dim = {m.dim}", "choose n_heads so that dim / n_heads is a whole number (e.g. dim 64, n_heads 4)")
    if (m.dim // m.n_heads) % 2:
        _fail("model.dim", f"/ n_heads = {m.dim // m.n_heads} is odd", "RoPE needs an even head size: change dim or n_heads")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        _fail("model.n_kv_heads", f"= {kv} does not divide model.n_heads = {m.n_heads}", "choose n_kv_heads among the divisors of n_heads")
    if not m.rope_theta > 0:
        _fail("model.rope_theta", f"= {m.rope_theta} must be positive", "the Llama-2 value is 10000")
    if not m.norm_eps > 0:
        _fail("model.norm_eps", f"= {m.norm_eps} must be positive", "the Llama-2 value is 1e-5")
    if not m.init_std > 0:
        _fail("model.init_std", f"= {m.init_std} must be positive", "the Llama value is 0.02")

    d = cfg.data
    if d.seq_len <= 0:
        _fail("data.seq_len", f"= {d.seq_len} must be positive", "set data.seq_len to e.g. 64 (tests) or 2048 (production)")
    if d.seq_len > m.max_seq_len:
        _fail("data.seq_len", f"= {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}", "raise model.max_seq_len or lower data.seq_len")

    p = cfg.prepare
    if p.vocab_size < 256 + 4:
        _fail("prepare.vocab_size", f"= {p.vocab_size} is too small", "byte fallback alone needs 260 pieces; use 8000-32000 for Chinese")
    if not 0 < p.character_coverage <= 1:
        _fail("prepare.character_coverage", f"= {p.character_coverage} is outside (0, 1]", "the Llama value is 0.9995")
    if not 0 <= p.valid_fraction < 1:
        _fail("prepare.valid_fraction", f"= {p.valid_fraction} is outside [0, 1)", "use e.g. 0.01")
    if not 0 < p.near_dedup_threshold <= 1:
        _fail("prepare.near_dedup_threshold", f"= {p.near_dedup_threshold} is outside (0, 1]", "use e.g. 0.8")
    for name in ("max_dup_line_fraction", "max_top_ngram_fraction"):
        if not 0 < getattr(p, name) <= 1:
            _fail(f"prepare.{name}", f"= {getattr(p, name)} is outside (0, 1]", "use 1 to switch the filter off")
    if p.min_chars < 0:
        _fail("prepare.min_chars", f"= {p.min_chars} must not be negative", "use 0 to keep every document")

    o = cfg.optim
    if not (o.lr >= 0 and math.isfinite(o.lr)):
        _fail("optim.lr", f"= {o.lr} must be a non-negative number", "the usual range is 1e-4 to 1e-3")
    if o.weight_decay < 0:
        _fail("optim.weight_decay", f"= {o.weight_decay} must not be negative", "the Llama value is 0.1")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            _fail(f"optim.{name}", f"= {getattr(o, name)} is outside [0, 1)", "Llama uses beta1 0.9, beta2 0.95")
    if not o.eps > 0:
        _fail("optim.eps", f"= {o.eps} must be positive", "the Llama value is 1e-8")
    if o.grad_clip < 0:
        _fail("optim.grad_clip", f"= {o.grad_clip} must not be negative", "use 1.0, or 0 to disable clipping")
    if o.z_loss < 0:
        _fail("optim.z_loss", f"= {o.z_loss} must not be negative", "use 0 (off) or e.g. 1e-4")

    s = cfg.schedule
    if isinstance(s.warmup_steps, str):
        if s.warmup_steps != "auto":
            _fail("schedule.warmup_steps", f"= {s.warmup_steps!r} is neither an integer nor \"auto\"", 'write schedule.warmup_steps=100 or schedule.warmup_steps="auto"')
    elif s.warmup_steps < 0:
        _fail("schedule.warmup_steps", f"= {s.warmup_steps} must not be negative", "use 0 for no warm-up")
    if not 0 <= s.min_lr_ratio <= 1:
        _fail("schedule.min_lr_ratio", f"= {s.min_lr_ratio} is outside [0, 1]", "use e.g. 0.1")
    if not 0 < s.decay_fraction <= 1:
        _fail("schedule.decay_fraction", f"= {s.decay_fraction} is outside (0, 1]", "use e.g. 0.2")
    if s.peak_ratio < 1:
        _fail("schedule.peak_ratio", f"= {s.peak_ratio} must be at least 1", "the field report uses 1.2")

    t = cfg.train
    if t.max_steps < 0 or t.max_tokens < 0:
        _fail("train.max_steps", "and train.max_tokens must not be negative", "give a positive step or token budget")
    if t.max_steps == 0 and t.max_tokens == 0:
        _fail("train.max_steps", "and train.max_tokens are both missing", "set one of them, e.g. train.max_steps=100")
    if t.global_batch <= 0:
        _fail("train.global_batch", f"= {t.global_batch} must be positive", "set train.global_batch to e.g. 8")
    if t.micro_batch < 0:
        _fail("train.micro_batch", f"= {t.micro_batch} must not be negative", "use 0 for global_batch / world size")
    if t.micro_batch and t.global_batch % t.micro_batch:
        _fail("train.global_batch", f"= {t.global_batch} is not divisible by train.micro_batch = {t.micro_batch}", "make global_batch a multiple of micro_batch")
    if t.log_every <= 0:
        _fail("train.log_every", f"= {t.log_every} must be positive", "use e.g. 10")

    pr = cfg.precision
    if pr.dtype == "bf16" and device == "cpu":
        _fail("precision.dtype", "= bf16 is not supported on CPU (MindSpore has no CPU bf16 kernels)", "use precision.dtype=fp32 (or fp16) on CPU; bf16 is for Ascend")
    if pr.scale_warmup_to < 0:
        _fail("precision.scale_warmup_to", f"= {pr.scale_warmup_to} must not be negative", "use 0 (no warm-up of the scale) or e.g. 1024")
    if not pr.init_scale > 0:
        _fail("precision.init_scale", f"= {pr.init_scale} must be positive", "the field report uses 64")
    if not 0 < pr.min_scale <= pr.max_scale:
        _fail("precision.min_scale", f"= {pr.min_scale} must be positive and at most max_scale", "use e.g. min_scale 1, max_scale 16777216")
    if pr.growth_interval <= 0:
        _fail("precision.growth_interval", f"= {pr.growth_interval} must be positive", "use e.g. 1000")
    if pr.scale_warmup_to and pr.scale_warmup_steps <= 0:
        _fail("precision.scale_warmup_steps", "must be positive when scale_warmup_to is set", "the field report warms 64 -> 1024 over 500 steps")
    scaled = pr.loss_scale in ("dynamic", "static") or (pr.loss_scale == "auto" and pr.dtype == "fp16")
    if pr.allreduce_dtype == "fp16" and not scaled:
        # Unscaled per-rank gradients of a large model's mean loss (~1e-6) sit below fp16's normal
        # range (6.1e-5): on the wire they flush to zero or keep a few bits.
        _fail("precision.allreduce_dtype", f"= fp16 needs loss scaling, which is off here (dtype {pr.dtype}, loss_scale {pr.loss_scale})",
              "use precision.allreduce_dtype=fp32, or turn loss scaling on (precision.loss_scale=dynamic)")
    if pr.param_dtype == "compute" and pr.dtype == "fp32":
        _fail("precision.param_dtype", "= compute only applies to fp16/bf16 compute (with dtype fp32 the parameters are fp32 already)",
              "set precision.dtype=fp16 (or bf16 on Ascend), or leave precision.param_dtype=fp32")

    c = cfg.checkpoint
    if c.every < 0 or c.keep_last < 1 or c.keep_every < 0:
        _fail("checkpoint.keep_last", "must be at least 1 (and every/keep_every not negative)", "use e.g. checkpoint.every=100 checkpoint.keep_last=3")

    e = cfg.eval
    if e.every < 0 or e.max_tokens < 0 or e.batch_size <= 0:
        _fail("eval.batch_size", "must be positive (and every/max_tokens not negative)", "use e.g. eval.batch_size=8")
    if cfg.device.threads < 0:
        _fail("device.threads", f"= {cfg.device.threads} must not be negative", "use 0 for all cores")
    if cfg.device.peak_tflops < 0:
        _fail("device.peak_tflops", f"= {cfg.device.peak_tflops} must not be negative", "use 0 for the built-in table, or the device's peak TFLOPs")
    if cfg.device.max_device_memory < 0:
        _fail("device.max_device_memory", f"= {cfg.device.max_device_memory} must not be negative", "use 0 for the default (58 GB on Ascend 910B), or the usable GB per device")
    if cfg.optim.bucket_mb < 0:
        _fail("optim.bucket_mb", f"= {cfg.optim.bucket_mb} must not be negative", "use e.g. 256, or 0 for one collective per parameter")
    if not 0 <= cfg.device.cpu_quota <= 100:
        _fail("device.cpu_quota", f"= {cfg.device.cpu_quota} is outside [0, 100]", "give a percentage of all cores, e.g. 60 (0 = off)")
    for f in fields(MetricsConfig):
        v = getattr(cfg.metrics, f.name)
        if f.type in ("int", int) and v <= 0:
            _fail(f"metrics.{f.name}", f"= {v} must be positive", "give an interval in steps, e.g. 1, 50 or 200")
    sp = cfg.spike
    if not sp.threshold > 0:
        _fail("spike.threshold", f"= {sp.threshold} must be positive", "the field report's bar is 0.3 (a loss 0.3 above the rolling mean)")
    if sp.window < 2 or sp.threshold <= 0 or sp.max_nonfinite < 1 or sp.rewind_skip < 0:
        _fail("spike.window", "needs window >= 2, threshold > 0, max_nonfinite >= 1, rewind_skip >= 0", "the defaults are window 50, threshold 0.3, max_nonfinite 10")
    if not sp.grad_norm_factor > 0:
        _fail("spike.grad_norm_factor", f"= {sp.grad_norm_factor} must be positive", "the default is 5 (a grad norm 5x the rolling median)")
    for i, src in enumerate(cfg.data.sources):
        if not isinstance(src, dict) or "path" not in src or set(src) - {"path", "weight"}:
            _fail(f"data.sources[{i}]", "must be a table {path = \"DIR\", weight = W}", 'write data.sources = [{path = "a/", weight = 0.7}, {path = "b/", weight = 0.3}]')
        w = src.get("weight", 1.0)
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not (w > 0 and math.isfinite(w)):
            _fail(f"data.sources[{i}].weight", "must be a positive number", "weights are relative, e.g. 0.7 and 0.3")
    if cfg.cost.price_per_device_hour < 0:
        _fail("cost.price_per_device_hour", "must not be negative", "use 0 for no cost figures")


def micro_batches(cfg: Config, world_size: int) -> tuple[int, int]:
    """(micro_batch per rank, accumulation steps) for a world size; errors name the fix."""
    t = cfg.train
    if t.global_batch % world_size:
        raise UserError(f"train.global_batch = {t.global_batch} is not divisible by {world_size} ranks", "make global_batch a multiple of the number of devices")
    per_rank = t.global_batch // world_size
    mb = t.micro_batch or per_rank
    if per_rank % mb:
        raise UserError(
            f"train.global_batch = {t.global_batch} is not divisible by ranks ({world_size}) x micro_batch ({mb})",
            "make global_batch a multiple of world size x micro_batch")
    return mb, per_rank // mb
