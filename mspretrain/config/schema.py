"""Configuration: frozen dataclasses are the schema, TOML files are instances.

Design choices:
- One dataclass per TOML section; the section name is the field name on `Config`. The sections
  live in `mspretrain/config/sections/` by subject (model, prepare and data, the run's training sections,
  the observing ones); this module joins them into `Config`, reads and writes TOML, resolves the
  automatic model fields and holds the rules across sections.
- Each section checks itself when it is built (`__post_init__`): a config that exists is valid,
  whether it came from a file, a `key=value` override or `dataclasses.replace`. Every error names
  the key and the fix. Unknown keys are errors, never silently ignored. Choices are `Literal`
  types, so the schema is the one list of allowed values.
- Rules that span sections or depend on the job (the device, a training budget) are small named
  functions (`check_seq_len`, `check_device`, `check_budget`) called where they apply;
  `validate` runs the ones a training run needs.
- `key=value` overrides from the command line are parsed as TOML values (`lr=3e-4`,
  `tie_embeddings=true`, `warmup_steps="auto"`), falling back to a bare string. The file and all
  overrides of a section are applied in one step, so the order of overrides never matters.
- Values that depend on other values (ffn_dim, n_kv_heads, micro_batch) are resolved once into
  the saved config so a run dir always shows the numbers that ran.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w

from mspretrain.config.sections.base import fail, hints
from mspretrain.config.sections.model import ModelConfig
from mspretrain.config.sections.observe import CostConfig, DeviceConfig, EvalConfig, MetricsConfig, ProfileConfig, SpikeConfig
from mspretrain.config.sections.prepare import DataConfig, PrepareConfig
from mspretrain.config.sections.train import CheckpointConfig, OptimConfig, ParallelConfig, PrecisionConfig, ScheduleConfig, TrainConfig
from mspretrain.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (pyproject: tomli; python_version < "3.11")
    import tomli as tomllib


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(Config))
# Keys that earlier versions wrote into run dirs and checkpoints: ignored when read, so old runs resume.
RETIRED: frozenset[str] = frozenset({"data.prefetch"})


# --------------------------------------------------------------------------- loading

def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check one value against its annotated type; ints are accepted where floats are.

    Allowed values of `Literal` fields are the section's own check (the same message whether the
    value came from TOML, an override or `replace`), so here a Literal only passes the value on.
    """
    origin = get_origin(typ)
    if origin is Literal:
        return value
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
    if typ is tuple or origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(value)
        example = '["embeddings", "lm_head"]' if key == "train.trainable" else "[...]"
        raise UserError(f"{key} = {value!r} is not a list", f"write {key} as a TOML array, e.g. {key}={example}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{key} = {value!r} is not a string", f'quote it: {key}="..."')
    return value


def _section_from_dict(section: str, cls: type, values: dict[str, Any], base: Any) -> Any:
    types = hints(cls)
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
        updates[key] = _coerce(f"{section}.{key}", value, types[key])
    return replace(base, **updates)  # one replace: the section checks itself on the final values


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
    """Read a TOML config (or start from defaults) and apply `section.key=value` overrides.

    The file's values and the overrides are merged first and each section is built once, so an
    override may fix what the file alone would get wrong (and the order of overrides does not
    matter for rules that combine keys, such as precision.param_dtype with precision.dtype).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            from mspretrain.fsutil import why_not  # fsutil imports errors only; no cycle

            raise UserError(f"config file {p} {why_not(p)}", "pass --config with a path to a .toml file, e.g. configs/tiny.toml")
        from mspretrain.fsutil import read_regular_bytes  # fsutil imports errors only; no cycle

        data = read_regular_bytes(p, 16 << 20, "config file", "pass --config with a path to a .toml file, e.g. configs/tiny.toml")
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"config file {p} is not valid TOML: {exc}", "fix the syntax (key = value, strings in quotes)") from None
        except RecursionError:
            raise UserError(f"config file {p} nests arrays or tables too deeply", "a config holds sections of key = value lines") from None
    return from_dict(_merge(raw, overrides))


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


def _merge(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`raw` with the overrides laid over it (the last one of a key wins)."""
    merged = dict(raw)
    for text in overrides:
        section, name, value = parse_override(text)
        table = merged.get(section, {})
        if isinstance(table, dict):  # a non-table section is reported by from_dict
            merged[section] = {**table, name: value}
    return merged


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """`cfg` with `section.key=value` overrides; each section is rebuilt once with all of its overrides."""
    return from_dict(_merge({}, overrides), cfg)


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
    from mspretrain.fsutil import atomic_write

    atomic_write(path, text)  # a reader (or a crash) never sees half a config


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


# --------------------------------------------------------------------------- rules across sections
# Each section has checked its own keys when it was built; these rules need more than one section
# or a fact about the job, and are called where they apply.

def check_seq_len(cfg: Config) -> None:
    """The training window fits the model's RoPE tables."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        fail("data.seq_len", f"= {cfg.data.seq_len} exceeds model.max_seq_len = {cfg.model.max_seq_len}",
              "raise model.max_seq_len or lower data.seq_len")


def check_device(cfg: Config, device: str) -> None:
    """What the resolved device ("cpu" or "ascend") cannot run."""
    if cfg.precision.dtype == "bf16" and device == "cpu":
        fail("precision.dtype", "= bf16 is not supported on CPU (MindSpore has no CPU bf16 kernels)",
              "use precision.dtype=fp32 (or fp16) on CPU; bf16 is for Ascend")


def check_parallel(cfg: Config) -> None:
    """What tensor parallel (`parallel.tp` > 1) does not compose with (the model's own limits are
    model/parallel.py `check_tp`, once its shape is resolved)."""
    if cfg.eval.harness_tasks and (cfg.parallel.tp > 1 or cfg.optim.shard_parameters):
        # the harness model scores whole-vocabulary logits and decodes with the KV cache (prefill/decode_step),
        # which a tensor-parallel model (split logits) and a ZeRO-3 one (sharded embedding) do not offer
        fail("eval.harness_tasks", "is not run during training with parallel.tp > 1 or optim.shard_parameters (ZeRO-3) yet",
             "score the checkpoints afterwards with `mspretrain eval RUN --tasks ...` (it runs data parallel under `launch`)")
    if cfg.parallel.tp == 1:
        return
    if cfg.optim.loss_chunk_tokens:
        fail("optim.loss_chunk_tokens", f"= {cfg.optim.loss_chunk_tokens} does not compose with parallel.tp = {cfg.parallel.tp} "
             "(its loss is vocabulary-parallel: the logits are split already)", "set optim.loss_chunk_tokens=0 with tensor parallel")
    if cfg.optim.shard_parameters:
        fail("optim.shard_parameters", f"(ZeRO-3) does not compose with parallel.tp = {cfg.parallel.tp} yet",
              "use optim.shard_gradients=true (ZeRO-2) with tensor parallel, or parallel.tp=1 with ZeRO-3")
    if not isinstance(cfg.optim.split_mb, str) and cfg.optim.split_mb > 0:
        fail("optim.split_mb", f"= {cfg.optim.split_mb:g} does not apply with parallel.tp > 1 "
              "(each tensor-parallel piece is owned whole by one data-parallel rank)",
              'remove optim.split_mb (or set it to "auto" or 0)')
    if cfg.eval.choices_file:
        fail("eval.choices_file", "is not scored with parallel.tp > 1 (the logits are split across the tp ranks)",
              "score the checkpoints afterwards with `mspretrain eval RUN --choices FILE` on one process")


def check_moe(cfg: Config) -> None:
    """A mixture of experts (model.num_experts > 0) trains with data parallel and any ZeRO level, or
    with expert parallel (`parallel.ep`, which needs one) and ZeRO-1/2; ZeRO-3 with expert parallel
    and tensor parallel over experts are issue 52's later items. That ep divides the data-parallel
    ranks is the parallel plan's rule (it knows the world)."""
    ep, experts = cfg.parallel.ep, cfg.model.num_experts
    if ep > 1:
        if experts <= 0:
            fail("parallel.ep", f"= {ep} needs a mixture-of-experts model (model.num_experts is {experts})",
                 "set parallel.ep=1 for a dense model")
        if experts % ep:
            fail("parallel.ep", f"= {ep} does not divide model.num_experts = {experts}",
                 "use a parallel.ep that divides the number of experts (each rank holds num_experts / ep)")
        for key, on in (("parallel.tp", cfg.parallel.tp > 1), ("model.capacity_factor", cfg.model.capacity_factor > 0),
                        ("model.router_bias_update_rate", cfg.model.router_bias_update_rate > 0),
                        ("train.ema_decay", cfg.train.ema_decay > 0)):  # the EMA of rank 0's weights would hold its experts only
            if on:
                fail(key, f"is not supported with expert parallel (parallel.ep = {ep}) yet",
                     f"unset {key}, or train with parallel.ep=1")
    if experts <= 0:
        return
    # ZeRO-1/2/3 compose with plain data parallel (the expert stacks are parameters like any other:
    # step/zero3.py gathers them per layer); ZeRO-1/2 with expert parallel (step/ep.py); ZeRO-3 with
    # expert parallel does not yet (the experts' slices over the edp group are not built)
    for key, on in (("parallel.tp", cfg.parallel.tp > 1), ("optim.shard_parameters", cfg.optim.shard_parameters and ep > 1)):
        if on:
            with_ep = f" and expert parallel (parallel.ep = {ep})" if key != "parallel.tp" else ""
            fail(key, f"is not supported with a mixture-of-experts model (model.num_experts = {experts}){with_ep} yet",
                 f"unset {key}: MoE models train with data parallel and any ZeRO (parallel.ep=1), or with expert "
                 "parallel (parallel.ep) and optim.shard_optimizer or optim.shard_gradients")


def check_budget(t: TrainConfig) -> None:
    """A training run needs to know when to stop (plan and prepare do not)."""
    if t.max_steps == 0 and t.max_tokens == 0:
        fail("train.max_steps", "and train.max_tokens are both missing", "set one of them, e.g. train.max_steps=100")


def validate(cfg: Config, *, device: str | None = None, budget: bool = True) -> None:
    """The rules across sections a run needs. `device` is the resolved target, if known;
    `budget=False` for jobs that do not train (plan takes its budget from --tokens or --data)."""
    check_seq_len(cfg)
    check_parallel(cfg)
    check_moe(cfg)
    if device is not None:
        check_device(cfg, device)
    if budget:
        check_budget(cfg.train)
