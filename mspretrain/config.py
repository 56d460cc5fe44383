"""Configuration: frozen dataclasses are the schema, TOML files are instances.

Design choices:
- One dataclass per TOML section; the section name is the field name on `Config`.
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
import functools
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import tomli_w

from mspretrain.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (pyproject: tomli; python_version < "3.11")
    import tomli as tomllib


INT_LIMIT = 2**63  # integer keys must fit an int64 (see _Section.__post_init__)
SEED_LIMIT = 2**32  # numpy's legacy seeding and MindSpore's set_seed take seeds in [0, 2**32)
EVAL_MAX_BATCH = 4096  # sequences per evaluation forward pass: far above any device's memory for a real model


def _fail(key: str, problem: str, fix: str) -> None:
    raise UserError(f"{key} {problem}", fix)


def _cap(section: Any, caps: dict[str, float], why: str) -> None:
    """Refuse values above a sane ceiling: a key that drives an allocation (n_layers=1e8 asks
    `plan` for terabytes of tables) or an update size (lr=1e308 trains to inf in one step) is a
    typo, not a setting; the ceilings sit far above any real model (a 1T-parameter Llama stays
    inside every one)."""
    for name, cap in caps.items():
        v = getattr(section, name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:
            key = f"{section.SECTION}.{name}"
            _fail(key, f"= {v:g} is above the limit of {cap:g} ({why})", f"check {key} for a typo (see docs/config-reference.md)")


def _check_seed(section: Any, name: str) -> None:
    """A seed is a non-negative integer below 2**32 (numpy.random.seed and MindSpore's set_seed
    raise on anything else, after the run dir is made)."""
    v = getattr(section, name)
    if not 0 <= v < SEED_LIMIT:
        key = f"{section.SECTION}.{name}"
        _fail(key, f"= {v} is not a seed between 0 and {SEED_LIMIT - 1}", f"give {key} a non-negative integer, e.g. {key}=1234")


def _floor(section: Any, floors: dict[str, float], why: str) -> None:
    """Refuse positive values below what float32 keeps: norm_eps=1e-300 passes `> 0` and is 0.0 on
    the device (a division by zero waiting for an all-zero row)."""
    for name, floor in floors.items():
        v = getattr(section, name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < floor:
            key = f"{section.SECTION}.{name}"
            _fail(key, f"= {v:g} is below the floor of {floor:g} ({why})", f"check {key} for a typo (see docs/config-reference.md)")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The allowed values of a `Literal` field (or of the items of a tuple of them); () if free."""
    typ = _hints(cls)[name]
    if get_origin(typ) is tuple:
        typ = get_args(typ)[0]
    return get_args(typ) if get_origin(typ) is Literal else ()


class _Section:
    """What every section checks, then the section's own rules (`check`).

    The finite-number check loops over the schema, so a new float key cannot skip it: NaN passes
    `x < 0`-style range checks (every comparison with NaN is False), and a NaN weight decay
    writes NaN weights into checkpoints that verify.
    """

    SECTION = ""  # the TOML section name, for the keys in error messages

    def __post_init__(self) -> None:
        for f in fields(self):
            key, value = f"{self.SECTION}.{f.name}", getattr(self, f.name)
            items = value if isinstance(value, tuple) else (value,)
            for v in items:
                if isinstance(v, float) and not math.isfinite(v):
                    _fail(key, f"= {v} is not a finite number", f"give {key} a finite value (see docs/config-reference.md)")
                # TOML and Python ints are unbounded; every integer key ends in a numpy or
                # MindSpore int64 (a step counter, a seed, a shape), where 1e20 overflows with a
                # traceback deep in a run (or runs "forever"). No key has a use for such a value.
                if isinstance(v, int) and not isinstance(v, bool) and not -INT_LIMIT < v < INT_LIMIT:
                    _fail(key, f"= {v} does not fit in 64 bits", f"check {key} for a typo (see docs/config-reference.md)")
            allowed = choices(type(self), f.name)
            for v in items if allowed else ():
                if v not in allowed:
                    _fail(key, f"= {v!r} is not one of {', '.join(allowed)}", f"set {key} to one of: {', '.join(allowed)}")
        self.check()

    def check(self) -> None:
        """The section's own rules: its keys alone and how they combine within the section."""


@dataclass(frozen=True)
class ModelConfig(_Section):
    """Architecture only: no batch size, no parallel layout, no paths."""

    SECTION = "model"

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
    family: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"  # the HF architecture read by `convert` and written by `export` (issue 31)
    head_dim: int = 0  # 0 = dim / n_heads; Qwen3 gives it explicitly
    qkv_bias: bool = False  # bias on the q/k/v projections (Qwen2/2.5), never on o
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3)
    sliding_window: int = 0  # 0 = full attention; else a key is visible iff query - key < sliding_window (Mistral)
    rope_scaling: Literal["none", "llama3"] = "none"  # llama3: Llama-3.1's frequency rescaling, as transformers
    rope_factor: float = 8.0  # llama3 scaling: factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low_freq_factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high_freq_factor
    rope_original_max_len: int = 8192  # llama3 scaling: original_max_position_embeddings

    @property
    def head_size(self) -> int:
        """The attention head size: `head_dim`, or dim / n_heads when it is 0."""
        return self.head_dim or self.dim // self.n_heads

    def check(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of", "rope_original_max_len"):
            if getattr(self, name) <= 0:
                _fail(f"model.{name}", f"= {getattr(self, name)} must be positive", f"set model.{name} to a positive integer")
        for name in ("n_kv_heads", "vocab_size", "ffn_dim", "head_dim", "sliding_window"):
            if getattr(self, name) < 0:
                _fail(f"model.{name}", f"= {getattr(self, name)} must not be negative", f"set model.{name} to 0 (automatic) or a positive integer")
        if self.dim % self.n_heads and not self.head_dim:
            _fail("model.n_heads", f"= {self.n_heads} does not divide model.dim = {self.dim}",
                  "choose n_heads so that dim / n_heads is a whole number (e.g. dim 64, n_heads 4), or set model.head_dim")
        if self.head_size % 2:
            _fail("model.head_dim" if self.head_dim else "model.dim", f"gives an odd head size {self.head_size}",
                  "RoPE needs an even head size: change dim, n_heads or head_dim")
        # Each family holds exactly what transformers' class of that name builds, so export can write it.
        wants = {"llama": (False, False, False), "mistral": (False, False, None),
                 "qwen2": (True, False, False), "qwen3": (False, True, False)}[self.family]
        for key, have, want in (("qkv_bias", self.qkv_bias, wants[0]), ("qk_norm", self.qk_norm, wants[1]),
                                ("sliding_window", bool(self.sliding_window), wants[2])):
            if want is not None and have != want:
                _fail(f"model.{key}", f"= {getattr(self, key)!r} is not what model.family = {self.family} has",
                      "qwen2 has qkv_bias, qwen3 has qk_norm, only mistral has a sliding_window; llama has none of them")
        if self.rope_scaling == "llama3":
            for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
                if not getattr(self, name) > 0:
                    _fail(f"model.{name}", f"= {getattr(self, name)} must be positive", "use Llama-3.1's values: 8, 1, 4")
            if not self.rope_high_freq_factor > self.rope_low_freq_factor:
                _fail("model.rope_high_freq_factor", f"= {self.rope_high_freq_factor} must exceed rope_low_freq_factor = {self.rope_low_freq_factor}",
                      "use Llama-3.1's values: low 1, high 4")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            _fail("model.n_kv_heads", f"= {kv} does not divide model.n_heads = {self.n_heads}", "choose n_kv_heads among the divisors of n_heads")
        if not self.rope_theta > 0:
            _fail("model.rope_theta", f"= {self.rope_theta} must be positive", "the Llama-2 value is 10000")
        if not self.norm_eps > 0:
            _fail("model.norm_eps", f"= {self.norm_eps} must be positive", "the Llama-2 value is 1e-5")
        if not self.init_std > 0:
            _fail("model.init_std", f"= {self.init_std} must be positive", "the Llama value is 0.02")
        # max_seq_len: the RoPE tables are max_seq_len x head_size; 2^30 positions is 100x the longest
        # context released (10M), and train's memory check judges what a machine holds below that.
        _cap(self, {"dim": 1 << 16, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024, "vocab_size": 1 << 22,
                    "ffn_dim": 1 << 18, "multiple_of": 1 << 16, "rope_theta": 1e12, "head_dim": 1 << 12,
                    "max_seq_len": 1 << 30, "rope_original_max_len": 1 << 30, "sliding_window": 1 << 30,
                    "rope_factor": 1e4, "rope_low_freq_factor": 1e4, "rope_high_freq_factor": 1e4,
                    "norm_eps": 1.0, "init_std": 10.0}, "a model shape no device holds")
        _floor(self, {"norm_eps": 1e-12, "init_std": 1e-8}, "float32 rounds it to 0, or to weights of 0")


def _check_fractions(c: "PrepareConfig") -> None:
    """The quality filters that keep a fraction (`data/rescore.py`): in range, and not given
    together with the fixed threshold they replace."""
    f = c.quality_top_fraction
    if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f <= 1):
        _fail("prepare.quality_top_fraction", f"= {f} is outside (0, 1]", "the share of documents to keep, e.g. 0.3; 0 = off")
    if f and c.quality_threshold != 0.5:
        _fail("prepare.quality_top_fraction", "and prepare.quality_threshold are both given", "keep by a threshold or by a fraction, not both")
    if f and not c.quality_model:
        _fail("prepare.quality_top_fraction", "is set but prepare.quality_model is not", "train one with `mspretrain quality train` first")
    q = c.ppl_quantiles
    if not q:
        return
    if len(q) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in q) or not 0 <= q[0] < q[1] <= 1 \
            or tuple(q) == (0, 1):
        _fail("prepare.ppl_quantiles", f"= {list(q)} is not [lo, hi] with 0 <= lo < hi <= 1 (and not [0, 1])",
              "e.g. [0, 0.6] keeps the 60 % least perplexing")
    if c.ppl_min > 0 or c.ppl_max > 0:
        _fail("prepare.ppl_quantiles", "and prepare.ppl_min / ppl_max are both given", "keep a band by perplexity or by quantile, not both")
    if not (c.lm_model or c.lm_reference):
        _fail("prepare.ppl_quantiles", "is set but prepare.lm_model is not", "train one with `mspretrain quality lm REFERENCE... --out lm.npz`")


@dataclass(frozen=True)
class PrepareConfig(_Section):
    """How `prepare` turns raw text into shards (cleaning rules are switchable one by one)."""

    SECTION = "prepare"

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
    # Model-based quality filters (issue 39; docs/operators.md "Quality filtering"), each off by default.
    quality_model: str = ""  # classifier from `mspretrain quality train`; "" = off
    quality_threshold: float = 0.5  # drop documents whose classifier score (P(positive), 0-1) is below this
    quality_top_fraction: float = 0.0  # instead: keep this fraction (0-1] of the classifier's candidates, best first; 0 = off
    lm_model: str = ""  # character n-gram model from `mspretrain quality lm`, for perplexity bands; "" = off
    lm_reference: tuple = ()  # instead: reference text files/dirs/globs prepare counts that model from (written as lm.npz)
    ppl_min: float = 0.0  # drop documents whose perplexity is below this (0 = no lower bound)
    ppl_max: float = 0.0  # drop documents whose perplexity is above this (0 = no upper bound)
    ppl_quantiles: tuple = ()  # instead: [lo, hi], keep the perplexity band between these quantiles (e.g. [0, 0.6])
    min_zh_prob: float = 0.0  # drop documents whose P(Chinese) by py3langid is below this (0 = off)
    decontam: tuple = ()  # eval sets (C-Eval/CMMLU .csv / .jsonl files or dirs): drop documents sharing an n-gram with them
    decontam_ngram: int = 13  # n of the character n-grams decontamination matches (after normalising)

    def check(self) -> None:
        if self.vocab_size < 256 + 4:
            _fail("prepare.vocab_size", f"= {self.vocab_size} is too small", "byte fallback alone needs 260 pieces; use 8000-32000 for Chinese")
        if not 0 < self.character_coverage <= 1:
            _fail("prepare.character_coverage", f"= {self.character_coverage} is outside (0, 1]", "the Llama value is 0.9995")
        if not 0 <= self.valid_fraction < 1:
            _fail("prepare.valid_fraction", f"= {self.valid_fraction} is outside [0, 1)", "use e.g. 0.01")
        if not 0 < self.near_dedup_threshold <= 1:
            _fail("prepare.near_dedup_threshold", f"= {self.near_dedup_threshold} is outside (0, 1]", "use e.g. 0.8")
        for name in ("max_dup_line_fraction", "max_top_ngram_fraction"):
            if not 0 < getattr(self, name) <= 1:
                _fail(f"prepare.{name}", f"= {getattr(self, name)} is outside (0, 1]", "use 1 to switch the filter off")
        if self.min_chars < 0:
            _fail("prepare.min_chars", f"= {self.min_chars} must not be negative", "use 0 to keep every document")
        if self.tokenizer_sample_chars <= 0:
            _fail("prepare.tokenizer_sample_chars", f"= {self.tokenizer_sample_chars} must be positive", "the default is 20000000")
        _check_seed(self, "seed")
        for name in ("quality_threshold", "min_zh_prob"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1):
                _fail(f"prepare.{name}", f"= {v} is outside [0, 1]", "it is a probability; e.g. 0.5")
        for name in ("ppl_min", "ppl_max"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")):
                _fail(f"prepare.{name}", f"= {v} must be a finite number >= 0", "0 = no bound; see the perplexities with prepare --inspect")
        if self.ppl_min > 0 and self.ppl_max > 0 and self.ppl_min >= self.ppl_max:
            _fail("prepare.ppl_min", f"= {self.ppl_min} is not below prepare.ppl_max = {self.ppl_max}", "the band kept is [ppl_min, ppl_max]")
        _check_fractions(self)
        if self.lm_model and self.lm_reference:
            _fail("prepare.lm_reference", "and prepare.lm_model are both given", "name the model file or the reference text, not both")
        if not all(isinstance(x, str) and x.strip() for x in self.lm_reference):
            _fail("prepare.lm_reference", "must be a list of file, directory or glob names", 'e.g. prepare.lm_reference = ["baike/"]')
        if (self.ppl_min > 0 or self.ppl_max > 0) and not (self.lm_model or self.lm_reference):
            _fail("prepare.ppl_max" if self.ppl_max > 0 else "prepare.ppl_min", "is set but prepare.lm_model is not",
                  "train one with `mspretrain quality lm REFERENCE... --out lm.npz` and set prepare.lm_model")
        for name in ("quality_model", "lm_model"):
            if not isinstance(getattr(self, name), str):
                _fail(f"prepare.{name}", "must be a file name (a string)", 'e.g. prepare.quality_model = "quality.npz"')
        if not all(isinstance(x, str) and x.strip() for x in self.decontam):
            _fail("prepare.decontam", "must be a list of file or directory names", 'e.g. prepare.decontam = ["ceval/val"]')
        if not 5 <= self.decontam_ngram <= 64:
            _fail("prepare.decontam_ngram", f"= {self.decontam_ngram} is outside [5, 64]", "13 is the usual n")
        # SentencePiece parses its options as int32; the model section's vocabulary ceiling applies.
        _cap(self, {"vocab_size": 1 << 22, "tokenizer_sample_chars": 1 << 40}, "more than any tokenizer trainer takes")


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION = "data"

    seq_len: int = 64
    # Corpus mixing: weighted data dirs, e.g. sources = [{path = "a/", weight = 0.7}, {path = "b/",
    # weight = 0.3}], all tokenized with the --data dir's tokenizer. Empty = the --data dir alone.
    sources: tuple = ()
    reset_attention_at_eos: bool = False
    token_dtype: Literal["int32", "int64"] = "int32"  # int64 for the Ascend gather issue in the field report

    def check(self) -> None:
        if self.seq_len <= 0:
            _fail("data.seq_len", f"= {self.seq_len} must be positive", "set data.seq_len to e.g. 64 (tests) or 2048 (production)")
        for i, src in enumerate(self.sources):
            if not isinstance(src, dict) or "path" not in src or set(src) - {"path", "weight"}:
                _fail(f"data.sources[{i}]", "must be a table {path = \"DIR\", weight = W}",
                      'write data.sources = [{path = "a/", weight = 0.7}, {path = "b/", weight = 0.3}]')
            if not isinstance(src["path"], str) or not src["path"].strip():
                _fail(f"data.sources[{i}].path", f"= {src['path']!r} is not a directory name", 'quote it: {path = "data/a", weight = 0.7}')
            w = src.get("weight", 1.0)
            # capped: weights are relative, and two weights of 1e308 sum to inf (every share then 0)
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not (0 < w <= 1e12):
                _fail(f"data.sources[{i}].weight", "must be a positive number up to 1e12", "weights are relative, e.g. 0.7 and 0.3")


@dataclass(frozen=True)
class OptimConfig(_Section):
    SECTION = "optim"

    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it
    decay_embeddings: bool = False
    lr_scaling: Literal["none", "sqrt"] = "none"  # "none" | "sqrt": lr * sqrt(global_batch / 32)
    z_loss: float = 0.0
    # ZeRO-1: each data-parallel rank keeps the Adam moments (and fp32 masters) of the parameters
    # it owns (about 1/N of them), updates those and all-gathers them; no effect with one rank.
    shard_optimizer: bool = False
    # ZeRO-2 (implies shard_optimizer): a rank also keeps the fp32 gradient-accumulation buffers
    # only for what it owns; every micro-batch's gradients are reduce-scattered into them. Saves
    # 4 bytes x (N-1)/N per parameter, costs one reduction per micro-batch instead of one per step.
    shard_gradients: bool = False
    # ZeRO-3 (implies shard_gradients): a rank also keeps only a slice (1/N) of every trained
    # weight; a layer's weights are gathered right before use and freed after, gradients are
    # reduce-scattered into the slices. Costs a gather per weight in the forward and a
    # reduce-scatter in the backward of every micro-batch (train/zero3.py).
    shard_parameters: bool = False
    # Cap of one collective's flat buffer in MB (a transient copy): gradients and parameters cross
    # ranks in a few buckets instead of one collective per parameter. 0 = one per parameter.
    # "auto": 256 on Ascend, 32 on CPU (train/layout.py `bucket_mb_for` says why).
    bucket_mb: Union[float, str] = "auto"
    # With sharding: a parameter of at least this many MB (4 bytes an element) is cut into one
    # slice per rank instead of going whole to one owner, so each rank holds 1/N of its Adam
    # moments, master and gradient buffer (a 151 K-row lm_head). 0 = never. "auto": the bucket
    # cap (such a parameter has a collective of its own anyway; none with bucket_mb = 0;
    # train/layout.py says more).
    split_mb: Union[float, str] = "auto"

    def check(self) -> None:
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            _fail("optim.lr", f"= {self.lr} must be a non-negative number", "the usual range is 1e-4 to 1e-3")
        if self.weight_decay < 0:
            _fail("optim.weight_decay", f"= {self.weight_decay} must not be negative", "the Llama value is 0.1")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"optim.{name}", f"= {getattr(self, name)} is outside [0, 1)", "Llama uses beta1 0.9, beta2 0.95")
        if not self.eps > 0:
            _fail("optim.eps", f"= {self.eps} must be positive", "the Llama value is 1e-8")
        if self.grad_clip < 0:
            _fail("optim.grad_clip", f"= {self.grad_clip} must not be negative", "use 1.0, or 0 to disable clipping")
        if self.z_loss < 0:
            _fail("optim.z_loss", f"= {self.z_loss} must not be negative", "use 0 (off) or e.g. 1e-4")
        if isinstance(self.bucket_mb, str):
            if self.bucket_mb != "auto":
                _fail("optim.bucket_mb", f"= {self.bucket_mb!r} is neither a number nor \"auto\"",
                      'write optim.bucket_mb=64 (MB), 0 for one collective per parameter, or optim.bucket_mb="auto"')
        elif not (self.bucket_mb >= 0 and math.isfinite(self.bucket_mb)):
            _fail("optim.bucket_mb", f"= {self.bucket_mb} must be a non-negative number", "use e.g. 256, or 0 for one collective per parameter")
        else:
            _cap(self, {"bucket_mb": 1 << 20}, "a bucket larger than any device")
        if isinstance(self.split_mb, str):
            if self.split_mb != "auto":
                _fail("optim.split_mb", f"= {self.split_mb!r} is neither a number nor \"auto\"",
                      'write optim.split_mb=256 (MB), 0 to keep every parameter whole, or optim.split_mb="auto"')
        elif not (self.split_mb >= 0 and math.isfinite(self.split_mb)):
            _fail("optim.split_mb", f"= {self.split_mb} must be a non-negative number", "use e.g. 256, or 0 to keep every parameter whole")
        _cap(self, {"lr": 10.0, "weight_decay": 10.0, "eps": 1.0, "grad_clip": 1e6, "z_loss": 1.0},
             "an update this size makes the weights inf in a step")
        _floor(self, {"eps": 1e-30}, "float32 rounds it to 0: Adam then divides by 0 for a parameter with no gradient")


@dataclass(frozen=True)
class ParallelConfig(_Section):
    SECTION = "parallel"

    # Tensor parallel (Megatron-style, model/parallel.py): this many ranks split every layer's
    # matrices, the embedding and the lm_head among them. The world (msrun's worker count) is
    # tp x data-parallel ranks, tp ranks adjacent (ranks 0..tp-1 are the first tp group). 1 = off.
    tp: int = 1

    def check(self) -> None:
        if self.tp < 1:
            _fail("parallel.tp", f"= {self.tp} must be at least 1", "use 1 (off) or the ranks that split each layer, e.g. 2, 4 or 8")
        _cap(self, {"tp": 1024}, "more tensor-parallel ranks than any model has heads")


@dataclass(frozen=True)
class ScheduleConfig(_Section):
    SECTION = "schedule"

    kind: Literal["cosine", "two_phase", "wsd", "constant"] = "cosine"  # "cosine" | "two_phase" | "wsd" | "constant"
    warmup_steps: Union[int, str] = "auto"  # int or "auto" (field report formula on data tokens)
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # WSD: last share of steps spent decaying
    peak_ratio: float = 1.2  # two_phase: second phase rises to peak_ratio * lr

    def check(self) -> None:
        if isinstance(self.warmup_steps, str):
            if self.warmup_steps != "auto":
                _fail("schedule.warmup_steps", f"= {self.warmup_steps!r} is neither an integer nor \"auto\"",
                      'write schedule.warmup_steps=100 or schedule.warmup_steps="auto"')
        elif self.warmup_steps < 0:
            _fail("schedule.warmup_steps", f"= {self.warmup_steps} must not be negative", "use 0 for no warm-up")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("schedule.min_lr_ratio", f"= {self.min_lr_ratio} is outside [0, 1]", "use e.g. 0.1")
        if not 0 < self.decay_fraction <= 1:
            _fail("schedule.decay_fraction", f"= {self.decay_fraction} is outside (0, 1]", "use e.g. 0.2")
        if self.peak_ratio < 1:
            _fail("schedule.peak_ratio", f"= {self.peak_ratio} must be at least 1", "the field report uses 1.2")
        _cap(self, {"peak_ratio": 100.0}, "an lr peak this far above optim.lr diverges")


# The parameter groups `train.trainable` can name (issue 20's stage-1 training: embeddings, lm_head).
ParamGroup = Literal["all", "embeddings", "attention", "mlp", "norms", "lm_head"]


@dataclass(frozen=True)
class TrainConfig(_Section):
    SECTION = "train"

    max_steps: int = 0  # 0 = not set; at least one of max_steps / max_tokens is needed
    max_tokens: int = 0
    global_batch: int = 8  # sequences per optimizer step, over all ranks and micro-batches
    micro_batch: int = 0  # 0 = global_batch / world size (no accumulation)
    seed: int = 1234
    log_every: int = 10
    mode: Literal["jit", "pynative"] = "jit"  # "jit" | "pynative"
    # Recompute each decoder layer's activations in the backward pass instead of keeping them:
    # activation memory drops to one layer's worth plus each layer's input, for ~1/3 more compute.
    recompute: bool = False
    # Parameter groups the optimizer updates; the rest stay frozen. "all" (alone) = every
    # parameter; else any of "embeddings", "attention", "mlp", "norms", "lm_head", e.g.
    # ["embeddings", "lm_head"] for the first stage of continued pretraining on a new vocabulary.
    trainable: tuple[ParamGroup, ...] = ("all",)

    def check(self) -> None:
        if self.max_steps < 0 or self.max_tokens < 0:
            _fail("train.max_steps", "and train.max_tokens must not be negative", "give a positive step or token budget")
        if self.global_batch <= 0:
            _fail("train.global_batch", f"= {self.global_batch} must be positive", "set train.global_batch to e.g. 8")
        if self.micro_batch < 0:
            _fail("train.micro_batch", f"= {self.micro_batch} must not be negative", "use 0 for global_batch / world size")
        if self.micro_batch and self.global_batch % self.micro_batch:
            _fail("train.global_batch", f"= {self.global_batch} is not divisible by train.micro_batch = {self.micro_batch}",
                  "make global_batch a multiple of micro_batch")
        if self.log_every <= 0:
            _fail("train.log_every", f"= {self.log_every} must be positive", "use e.g. 10")
        _cap(self, {"global_batch": 1 << 24, "micro_batch": 1 << 20}, "batch buffers no host holds")
        _cap(self, {"max_steps": 10**12, "max_tokens": 10**16}, "a budget no run reaches: 1e16 tokens is 100x any released model's")
        _check_seed(self, "seed")
        groups = list(self.trainable)
        if not groups:
            _fail("train.trainable", "is empty: nothing would train", 'use train.trainable=["all"], or name parameter groups')
        if len(set(groups)) != len(groups):
            _fail("train.trainable", f"= {groups} names a group twice", "name each parameter group once")
        if "all" in groups and len(groups) > 1:
            _fail("train.trainable", f"= {groups} mixes \"all\" with other groups",
                  'use train.trainable=["all"] alone, or list only the groups to train')


@dataclass(frozen=True)
class PrecisionConfig(_Section):
    SECTION = "precision"

    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"  # "fp32" | "fp16" | "bf16"
    # "auto" (dynamic for fp16, none otherwise) | "dynamic" | "static" | "none"
    loss_scale: Literal["auto", "dynamic", "static", "none"] = "auto"
    init_scale: float = 64.0  # the field report's starting scale
    scale_warmup_to: float = 0.0  # 0 = no linear warm-up of the scale
    scale_warmup_steps: int = 0
    growth_interval: int = 1000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    # Data-parallel gradient all-reduce in fp16 halves the bytes on the wire (the field report's
    # Ascend setting); lm_head's gradient always stays fp32. Loss-scaled, so overflow is caught.
    allreduce_dtype: Literal["fp32", "fp16"] = "fp32"  # "fp32" | "fp16"
    # "fp32": parameters are the fp32 master weights, cast to `dtype` at use. "compute": the
    # decoder layers' matrices are stored in `dtype`, and fp32 master copies
    # live with the optimizer state (sharded with it under optim.shard_optimizer): 2 instead of
    # 4 bytes per parameter on every device. Same numbers either way: the matmuls read the same
    # rounded weights.
    param_dtype: Literal["fp32", "compute"] = "fp32"  # "fp32" | "compute"

    def check(self) -> None:
        if self.scale_warmup_to < 0:
            _fail("precision.scale_warmup_to", f"= {self.scale_warmup_to} must not be negative", "use 0 (no warm-up of the scale) or e.g. 1024")
        if not self.init_scale > 0:
            _fail("precision.init_scale", f"= {self.init_scale} must be positive", "the field report uses 64")
        if not 0 < self.min_scale <= self.max_scale:
            _fail("precision.min_scale", f"= {self.min_scale} must be positive and at most max_scale", "use e.g. min_scale 1, max_scale 16777216")
        # The loss scale is a float32 on the device: above ~3.4e38 it is inf, and every step overflows.
        _cap(self, {"init_scale": 2.0**64, "max_scale": 2.0**64, "scale_warmup_to": 2.0**64}, "a loss scale that overflows float32 gradients")
        if self.growth_interval <= 0:
            _fail("precision.growth_interval", f"= {self.growth_interval} must be positive", "use e.g. 1000")
        if self.scale_warmup_to and self.scale_warmup_steps <= 0:
            _fail("precision.scale_warmup_steps", "must be positive when scale_warmup_to is set", "the field report warms 64 -> 1024 over 500 steps")
        scaled = self.loss_scale in ("dynamic", "static") or (self.loss_scale == "auto" and self.dtype == "fp16")
        if self.allreduce_dtype == "fp16" and not scaled:
            # Unscaled per-rank gradients of a large model's mean loss (~1e-6) sit below fp16's normal
            # range (6.1e-5): on the wire they flush to zero or keep a few bits.
            _fail("precision.allreduce_dtype", f"= fp16 needs loss scaling, which is off here (dtype {self.dtype}, loss_scale {self.loss_scale})",
                  "use precision.allreduce_dtype=fp32, or turn loss scaling on (precision.loss_scale=dynamic)")
        if self.param_dtype == "compute" and self.dtype == "fp32":
            _fail("precision.param_dtype", "= compute only applies to fp16/bf16 compute (with dtype fp32 the parameters are fp32 already)",
                  "set precision.dtype=fp16 (or bf16 on Ascend), or leave precision.param_dtype=fp32")


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    SECTION = "checkpoint"

    every: int = 100
    keep_last: int = 3
    keep_every: int = 0  # also keep every keep_every-th step forever; 0 = off
    async_save: bool = True
    on_error: Literal["stop", "continue"] = "stop"  # "stop" | "continue"

    def check(self) -> None:
        if self.every < 0 or self.keep_last < 1 or self.keep_every < 0:
            _fail("checkpoint.keep_last", "must be at least 1 (and every/keep_every not negative)",
                  "use e.g. checkpoint.every=100 checkpoint.keep_last=3")


@dataclass(frozen=True)
class EvalConfig(_Section):
    SECTION = "eval"

    every: int = 0  # 0 = only at the end
    max_tokens: int = 200_000
    batch_size: int = 8
    # Multiple-choice JSONL file (one question with its choices and answer per line) scored during
    # training; "" = none.
    choices_file: str = ""
    choices_dev_file: str = ""  # JSONL of solved examples the few-shot prompts are drawn from; "" = none
    choices_shots: int = 0  # solved examples from choices_dev_file put before each question (0 = zero-shot)

    def check(self) -> None:
        if self.every < 0 or self.max_tokens < 0 or self.batch_size <= 0:
            _fail("eval.batch_size", "must be positive (and every/max_tokens not negative)", "use e.g. eval.batch_size=8")
        if self.choices_shots < 0:
            _fail("eval.choices_shots", f"= {self.choices_shots} must not be negative", "use 0 (zero-shot) or e.g. 5")
        # the batch's logits are allocated whole (eval.batch_size=1e8 asked numpy for 24.6 GiB of
        # tokens alone): the same ceiling as `mspretrain eval --batch-size`
        _cap(self, {"batch_size": EVAL_MAX_BATCH, "choices_shots": 1000}, "buffers no host holds")


@dataclass(frozen=True)
class DeviceConfig(_Section):
    SECTION = "device"

    target: Literal["auto", "cpu", "ascend"] = "auto"  # "auto" | "cpu" | "ascend"
    threads: int = 0  # 0 = all cores
    cpu_quota: float = 0.0  # percent of all cores for the training process (cgroup v2); 0 = off
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = from the built-in table / measured
    # mindspore.set_deterministic: reproducible kernels and (on Ascend) HCCL_DETERMINISTIC=true with
    # serial kernel compilation, which costs step and compile time there. On by default; on
    # Ascend it is the user's choice (false for speed once a run is known to be healthy).
    deterministic: bool = True
    # "O1" (Ascend only): graph-kernel fusion through ms.jit's jit_level; "O0" is what MindSpore
    # Transformers trains with on 910B. The old enable_graph_kernel flag is deprecated in 2.10.
    jit_level: Literal["O0", "O1"] = "O0"
    # Usable device memory in GB: 0 = the default (58 on Ascend 910B, the cap MindSpore
    # Transformers' 910B pretraining templates give max_device_memory; the machine's RAM on CPU).
    # `plan` compares its modelled peak with it, and on Ascend it is MindSpore's max_device_memory.
    max_device_memory: float = 0.0

    def check(self) -> None:
        if self.threads < 0:
            _fail("device.threads", f"= {self.threads} must not be negative", "use 0 for all cores")
        if self.peak_tflops < 0:
            _fail("device.peak_tflops", f"= {self.peak_tflops} must not be negative", "use 0 for the built-in table, or the device's peak TFLOPs")
        if self.max_device_memory < 0:
            _fail("device.max_device_memory", f"= {self.max_device_memory} must not be negative",
                  "use 0 for the default (58 GB on Ascend 910B), or the usable GB per device")
        _cap(self, {"threads": 1 << 16}, "more threads than any host has cores")
        _cap(self, {"max_device_memory": 1e5, "peak_tflops": 1e6}, "no device has this much")
        if not 0 <= self.cpu_quota <= 100:
            _fail("device.cpu_quota", f"= {self.cpu_quota} is outside [0, 100]", "give a percentage of all cores, e.g. 60 (0 = off)")


@dataclass(frozen=True)
class MetricsConfig(_Section):
    """Each metric is sampled at its own interval (in steps), as the field report recommends."""

    SECTION = "metrics"

    loss_every: int = 1
    lr_every: int = 1
    loss_scale_every: int = 1
    grad_norm_every: int = 50
    memory_every: int = 200
    throughput_every: int = 10
    tensorboard: bool = True

    def check(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_every") and v <= 0:
                _fail(f"metrics.{f.name}", f"= {v} must be positive", "give an interval in steps, e.g. 1, 50 or 200")


@dataclass(frozen=True)
class SpikeConfig(_Section):
    SECTION = "spike"

    window: int = 50  # rolling window of the loss mean
    threshold: float = 0.3  # flag a loss this far above the rolling mean (the field report's bar)
    grad_norm_factor: float = 5.0  # flag a grad norm this many times the rolling median
    action: Literal["warn", "rewind"] = "warn"  # "warn" | "rewind"
    rewind_skip: int = 0  # batches to skip after a rewind; 0 = as many as the steps rewound
    max_nonfinite: int = 10  # stop after this many non-finite losses in a row

    def check(self) -> None:
        if not self.threshold > 0:
            _fail("spike.threshold", f"= {self.threshold} must be positive", "the field report's bar is 0.3 (a loss 0.3 above the rolling mean)")
        if self.window < 2 or self.max_nonfinite < 1 or self.rewind_skip < 0:
            _fail("spike.window", "needs window >= 2, threshold > 0, max_nonfinite >= 1, rewind_skip >= 0",
                  "the defaults are window 50, threshold 0.3, max_nonfinite 10")
        _cap(self, {"window": 1 << 20}, "a rolling window longer than any run's history")
        if not self.grad_norm_factor > 0:
            _fail("spike.grad_norm_factor", f"= {self.grad_norm_factor} must be positive", "the default is 5 (a grad norm 5x the rolling median)")


@dataclass(frozen=True)
class CostConfig(_Section):
    SECTION = "cost"

    price_per_device_hour: float = 0.0  # in your currency; 0 = no cost figures

    def check(self) -> None:
        if self.price_per_device_hour < 0:
            _fail("cost.price_per_device_hour", "must not be negative", "use 0 for no cost figures")
        _cap(self, {"price_per_device_hour": 1e9}, "a cost that overflows to inf over a run")


@dataclass(frozen=True)
class ProfileConfig(_Section):
    SECTION = "profile"

    steps: str = ""  # e.g. "10-20": run the MindSpore profiler for those steps

    def check(self) -> None:
        parse_step_range(self.steps)  # refused with the config, before a run dir is made


def parse_step_range(text: str) -> tuple[int, int] | None:
    """profile.steps: "10-20" -> (10, 20) (inclusive); "15" -> (15, 15); "" -> None."""
    text = (text or "").strip()
    if not text:
        return None
    m = re.fullmatch(r"([0-9]{1,12})\s*(?:-\s*([0-9]{1,12}))?", text)  # ASCII digits; steps fit train.max_steps' ceiling
    if not m:
        raise UserError(f"profile.steps = {text!r} is not a step range", 'write profile.steps="10-20" (inclusive) or "15"')
    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if first < 1 or last < first:
        raise UserError(f"profile.steps = {text!r} is empty or starts before step 1", 'use e.g. profile.steps="10-20"')
    return first, last


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
    hints = _hints(cls)
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
        _fail("data.seq_len", f"= {cfg.data.seq_len} exceeds model.max_seq_len = {cfg.model.max_seq_len}",
              "raise model.max_seq_len or lower data.seq_len")


def check_device(cfg: Config, device: str) -> None:
    """What the resolved device ("cpu" or "ascend") cannot run."""
    if cfg.precision.dtype == "bf16" and device == "cpu":
        _fail("precision.dtype", "= bf16 is not supported on CPU (MindSpore has no CPU bf16 kernels)",
              "use precision.dtype=fp32 (or fp16) on CPU; bf16 is for Ascend")


def check_parallel(cfg: Config) -> None:
    """What tensor parallel (`parallel.tp` > 1) does not compose with (the model's own limits are
    model/parallel.py `check_tp`, once its shape is resolved)."""
    if cfg.parallel.tp == 1:
        return
    if cfg.optim.shard_parameters:
        _fail("optim.shard_parameters", f"(ZeRO-3) does not compose with parallel.tp = {cfg.parallel.tp} yet",
              "use optim.shard_gradients=true (ZeRO-2) with tensor parallel, or parallel.tp=1 with ZeRO-3")
    if not isinstance(cfg.optim.split_mb, str) and cfg.optim.split_mb > 0:
        _fail("optim.split_mb", f"= {cfg.optim.split_mb:g} does not apply with parallel.tp > 1 "
              "(each tensor-parallel piece is owned whole by one data-parallel rank)",
              'remove optim.split_mb (or set it to "auto" or 0)')
    if cfg.eval.choices_file:
        _fail("eval.choices_file", "is not scored with parallel.tp > 1 (the logits are split across the tp ranks)",
              "score the checkpoints afterwards with `mspretrain eval RUN --choices FILE` on one process")


def check_budget(t: TrainConfig) -> None:
    """A training run needs to know when to stop (plan and prepare do not)."""
    if t.max_steps == 0 and t.max_tokens == 0:
        _fail("train.max_steps", "and train.max_tokens are both missing", "set one of them, e.g. train.max_steps=100")


def validate(cfg: Config, *, device: str | None = None, budget: bool = True) -> None:
    """The rules across sections a run needs. `device` is the resolved target, if known;
    `budget=False` for jobs that do not train (plan takes its budget from --tokens or --data)."""
    check_seq_len(cfg)
    check_parallel(cfg)
    if device is not None:
        check_device(cfg, device)
    if budget:
        check_budget(cfg.train)
