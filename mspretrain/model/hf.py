"""Bridge to Hugging Face model folders of the families in mspretrain/families.py (Llama-2/3,
Qwen2/2.5, Qwen3, Mistral): config.json and safetensors, both directions.

Design choices:
- Only safetensors are read, never pickle: `.bin`/`.pt` weights are refused in one line. The
  files are untrusted input: the `safetensors` library's own parser reads them (it bounds the
  header by the file size and 100 MB, and checks every tensor's dtype x shape against its byte
  range, contiguously and without overlap), and `ml_dtypes` gives numpy a bfloat16, so bf16/fp16
  shards become fp32 without torch. It replaced a hand-written header reader that trusted the
  header (a length of 2^62 was a MemoryError) and was slower: 0.92 s vs 1.55 s and 874 vs
  936 MB peak RSS for a 256 MB bf16 file, measured on the 2-core box. Sharded folders follow
  their index json.
- config.json is untrusted too: every field we use is type-checked (an int is not a bool),
  sizes must be positive and consistent, floats finite, `rope_scaling` null or plain.
- Names and shapes both ways are the parameter table's (model/params.py): one to one except the
  fusions (q/k/v_proj rows concatenate into `attn.wqkv`, gate/up_proj into `mlp.w13`, an MoE
  layer's per-expert tensors stack). Both sides use the rotate-half RoPE layout: nothing is permuted.
- Anything we cannot represent exactly (other activations, an MLP or o_proj bias, RoPE scaling
  other than llama3's, per-layer sliding windows, mixtures of experts other than Qwen3-MoE) is refused rather than
  approximated: a silently different model is worse
  than an error.
- Export writes fp32 weights with the `{"format": "pt"}` metadata transformers expects, a
  `config.json` readable by transformers 4.x and 5.x (both `rope_theta` and `rope_parameters`)
  and `generation_config.json`.
- The tokenizer files are not read or written here: that needs `data/tokenizer`, and data and
  model are siblings in layer 2 that do not import each other. `checkpoint/hf_folder.py`
  (layer 3) joins the two for `convert` and `export`.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.families import NAMES, described
from mspretrain.families import family as family_of
from mspretrain.fsutil import TEXT_CAP, read_json, read_regular_bytes_check
from mspretrain.model import hf_moe, params

_ST_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # read as fp32
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old HF checkpoints saved the RoPE buffer; it is a constant


# --------------------------------------------------------------------------- config

def _int_field(hf: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    v = hf.get(key)
    if v is None:
        if default is None:
            raise UserError(f"{source} has no integer {key}", "pass the config.json written by transformers for this model")
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise UserError(f"{source}: {key} = {v!r} is not a positive integer", "pass the config.json written by transformers for this model")
    return v


def _float_field(hf: dict[str, Any], key: str, source: str, default: float) -> float:
    v = hf.get(key, default)
    if v is None:
        v = default
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 1 << 1000:
        v = math.inf  # an integer past float's range (float() would raise OverflowError)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise UserError(f"{source}: {key} = {v!r} is not a positive finite number", "pass the config.json written by transformers for this model")
    return float(v)


def _dict_field(hf: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    v = hf.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise UserError(f"{source}: {key} = {v!r} is not an object or null", "pass the config.json written by transformers for this model")
    return v


# The HF architectures we read and write, their switches and config.json defaults: one row each in
# mspretrain/families.py (every family is our decoder block plus switches, model/decoder.py).
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _refuse(source: str, what: str) -> None:
    raise UserError(f"{source}: {what}", f"only {described()} (full or sliding-window "
                    "attention, plain or llama3 RoPE) convert; see docs/design.md")


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, llama3 scaling keys or {}) from rope_parameters (transformers 5) or rope_scaling (4.x)."""
    rope = _dict_field(hf, "rope_parameters", source)
    scaling = _dict_field(hf, "rope_scaling", source)
    found: dict[str, Any] = {}
    for key, d in (("rope_parameters", rope), ("rope_scaling", scaling)):
        for name in ("rope_type", "type"):
            kind = d.get(name)
            if kind is None:
                continue
            if not isinstance(kind, str):  # e.g. a list: one line naming the field, not a TypeError
                _refuse(source, f"{key}.{name} = {kind!r} is not a RoPE type name")
            if kind not in ("default", "llama3"):
                _refuse(source, f"{key}.{name} = {kind!r}: RoPE type {kind!r} is not supported")
            if kind == "llama3":
                found = d
        if d and not any(d.get(n) is not None for n in ("rope_type", "type")) and set(d) - {"rope_theta"}:
            _refuse(source, f"{key} = {d!r} names no rope_type")  # scaling of an unknown kind is not plain RoPE
    if rope and scaling and _rope_meaning(rope) != _rope_meaning(scaling):
        # transformers 4.x reads rope_scaling (and the top-level rope_theta); 5.x lets a non-empty
        # rope_scaling replace rope_parameters in some paths and reads rope_parameters in others
        # (modeling_rope_utils.py `convert_rope_params_to_dict`, configuration_utils.py's
        # `rope_scaling` property): a folder whose two disagree has no one reading, so it is refused
        _refuse(source, f"rope_parameters {_rope_meaning(rope)} and rope_scaling {_rope_meaning(scaling)} "
                        "disagree (transformers versions read different ones)")
    thetas = {_float_field(d, "rope_theta", source, 1.0) for d in (hf, rope, scaling) if d.get("rope_theta") is not None}
    if len(thetas) > 1:
        _refuse(source, f"rope_theta has {len(thetas)} values ({', '.join(f'{t:g}' for t in sorted(thetas))}) at the top level, "
                        "in rope_parameters and in rope_scaling (transformers 4.x reads the top-level one, 5.x rope_parameters')")
    theta = _float_field(rope, "rope_theta", source, _float_field(hf, "rope_theta", source, 10000.0))
    if found:
        for name in _LLAMA3_KEYS:
            if name not in found:
                _refuse(source, f"llama3 RoPE scaling has no {name}")
        _float_field(found, "factor", source, 1.0)
        _float_field(found, "low_freq_factor", source, 1.0)
        _float_field(found, "high_freq_factor", source, 1.0)
        _int_field(found, "original_max_position_embeddings", source)
    return theta, found


def _rope_meaning(d: dict[str, Any]) -> tuple[Any, ...]:
    """What a RoPE dict says, for comparing rope_parameters with rope_scaling: its type and, for
    llama3, the scaling numbers (rope_theta is compared apart: a 4.x rope_scaling has none)."""
    kind = d.get("rope_type") or d.get("type") or "default"
    return (kind, *(d.get(k) for k in _LLAMA3_KEYS)) if kind == "llama3" else (kind,)


def config_from_hf(hf: Any, source: str = "config.json") -> ModelConfig:
    """A resolved ModelConfig from an HF config dict of a family of mspretrain/families.py; anything not
    representable exactly is refused in one line naming the field."""
    if not isinstance(hf, dict):
        raise UserError(f"{source} is a JSON {type(hf).__name__}, not an object", "pass the config.json written by transformers for this model")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UserError(f"{source}: architectures = {archs!r} is not a list of names", "pass the config.json written by transformers for this model")
    family = hf.get("model_type", "llama")
    if not isinstance(family, str) or family not in NAMES:
        raise UserError(f"{source}: model_type {family!r} is not supported (MoE and other architectures are not)",
                        f"convert {described('or')} checkpoints (model_type {', '.join(NAMES)})")
    fam = family_of(family)
    if archs and fam.hf_class not in archs:
        raise UserError(f"{source}: architectures {archs[0]!r} is not {fam.hf_class} (model_type {family!r})",
                        f"convert {described('or')} causal-LM checkpoints")
    dim, layers, heads, ffn, vocab = (_int_field(hf, k, source) for k in
                                      ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"))
    # an absent key is the config class's default (Qwen2/3: 32, Mistral: 8), not the head count;
    # an explicit null is the head count in every class
    kv = _int_field(hf, "num_key_value_heads", source, heads if "num_key_value_heads" in hf else fam.kv_heads_default or heads)
    max_pos = _int_field(hf, "max_position_embeddings", source, fam.max_position_default)
    head_dim = _int_field(hf, "head_dim", source, fam.head_dim_default or (dim // heads if dim % heads == 0 else -1))
    if head_dim % 2:
        raise UserError(f"{source}: head_dim {head_dim} (default hidden_size / num_attention_heads) is not a whole, even head size",
                        "pass the config.json written by transformers for this model")
    if heads % kv:
        raise UserError(f"{source}: num_key_value_heads {kv}" + ("" if "num_key_value_heads" in hf else f" ({fam.hf_class[:-11]}Config's default)")
                        + f" does not divide num_attention_heads {heads}",
                        "pass the config.json written by transformers for this model")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(source, f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if hf.get("mlp_bias"):
        _refuse(source, "mlp_bias = true is not supported")
    if fam.attention_bias_key and hf.get("attention_bias"):  # these put a bias on o_proj too
        _refuse(source, f"attention_bias = true is not supported for {family} (a bias on o_proj)")
    window = 0
    if fam.sliding_window:
        sw = hf.get("sliding_window", fam.sliding_window_default)  # the config class's default when the key is absent
        window = 0 if sw is None else _int_field({"sliding_window": sw}, "sliding_window", source)
        if window >= max_pos:
            window = 0  # never narrower than the sequence: full attention, exactly
    elif fam.per_layer_window:
        if hf.get("use_sliding_window"):
            _refuse(source, "use_sliding_window = true is not supported (Qwen's per-layer sliding window)")
        types = hf.get("layer_types")
        if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
            _refuse(source, f"layer_types = {types!r}: only full_attention layers are supported")
    for key in () if fam.moe else ("num_experts", "num_local_experts", "moe_intermediate_size"):
        if hf.get(key):
            _refuse(source, f"{key} = {hf[key]!r}: mixture-of-experts models are not supported")
    theta, llama3 = _rope(hf, source)
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise UserError(f"{source}: tie_word_embeddings = {tie!r} is not true or false",
                        "pass the config.json written by transformers for this model")
    extra: dict[str, Any] = {}
    if llama3:
        extra = {"rope_scaling": "llama3", "rope_factor": float(llama3["factor"]),
                 "rope_low_freq_factor": float(llama3["low_freq_factor"]),
                 "rope_high_freq_factor": float(llama3["high_freq_factor"]),
                 "rope_original_max_len": int(llama3["original_max_position_embeddings"])}
    if fam.moe:  # router and experts: model/hf_moe.py
        extra.update(hf_moe.config_from_hf(hf, source, _int_field))
    try:
        return ModelConfig(
            dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=vocab, ffn_dim=ffn, max_seq_len=max_pos,
            rope_theta=theta, norm_eps=_float_field(hf, "rms_norm_eps", source, 1e-6), tie_embeddings=tie,
            init_std=_float_field(hf, "initializer_range", source, 0.02), head_dim=0 if head_dim * heads == dim else head_dim,
            sliding_window=window, **fam.switches(), **extra)
    except UserError as exc:  # a value our config refuses: say which file it came from
        raise UserError(f"{source}: {exc.cause}", exc.fix) from None


def config_to_hf(m: ModelConfig, special_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """config.json for transformers' class of the model's family (fp32 weights), readable by 4.x and 5.x."""
    fam = family_of(m.family)
    ids = special_ids or {}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": m.rope_factor,
                "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_len}
    out: dict[str, Any] = {
        "architectures": [fam.hf_class], "model_type": m.family,
        "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_size,
        "vocab_size": m.vocab_size, "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": dict(rope) if m.rope_scaling != "none" else None,
        "rope_parameters": rope,
        "hidden_act": "silu", "attention_dropout": 0.0,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "use_cache": True, "torch_dtype": "float32", "dtype": "float32",
    }
    out.update(fam.export_keys)
    if fam.moe:
        out.update(hf_moe.config_to_hf(m))
    if fam.per_layer_window:
        out["max_window_layers"] = m.n_layers
    if not fam.head_dim_written and not m.head_dim:  # e.g. Qwen2Config has no head_dim key; its attention reads one only when present
        del out["head_dim"]
    if fam.sliding_window:
        out["sliding_window"] = m.sliding_window or None
    for name in ("bos", "eos", "pad"):
        if ids.get(name, -1) >= 0:
            out[f"{name}_token_id"] = ids[name]
    return out


# --------------------------------------------------------------------------- tensor names

def expected_hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a config: the parameter table's HF columns (model/params.py)."""
    return params.hf_shapes(m)


def hf_to_ours(tensors: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensor names/layout -> ours (fp32); checks every name and shape against the config."""
    if len(tensors) < 9 * m.n_layers + 2:  # before building the expected names: a huge n_layers is no memory bomb
        raise UserError(f"config.json says {m.n_layers} layers, but the HF weights hold only {len(tensors)} tensors",
                        "the weights and config.json do not belong together")
    shapes = expected_hf_shapes(m)
    extra = [k for k in tensors if k not in shapes and not k.endswith(_IGNORED_SUFFIXES)
             and not (m.tie_embeddings and k == "lm_head.weight")]  # some tied checkpoints store it twice
    if extra:
        raise UserError(f"unexpected tensor {extra[0]} in the HF weights", "the weights do not belong to a model of this config.json")
    for name, shape in shapes.items():
        if name not in tensors:
            raise UserError(f"HF weights have no tensor {name}", "the safetensors files are incomplete or belong to another config.json")
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"HF tensor {name} has shape {tuple(tensors[name].shape)}, config.json implies {shape}",
                            "the weights and config.json do not belong together")
    return params.from_hf(lambda k: np.asarray(tensors[k], dtype=np.float32), m)


def our_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for a resolved config (what the model cell holds)."""
    return dict(params.shapes(m))


def ours_to_hf(tensors: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """Our tensor names/layout -> HF's, splitting the fused projections and the expert stacks."""
    for name, shape in our_shapes(m).items():
        if name not in tensors:
            raise UserError(f"checkpoint has no tensor {name}", "the checkpoint and its config.toml do not match")
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"checkpoint tensor {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}",
                            "the checkpoint and its config.toml do not match")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.to_hf(tensors, m).items()}


# --------------------------------------------------------------------------- safetensors reading

def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy; floats become fp32 (bf16 included).

    Any malformed file (a lying header, offsets past the end, a shape that does not match its
    bytes, a header that is not an object...) is one `UserError`: the library validates the
    whole header when the file is opened, before a byte of tensor data is allocated.
    """
    import ml_dtypes  # noqa: F401  (registers numpy's bfloat16, which safetensors' numpy backend needs)
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    fix = "re-download or re-save the weights (save_pretrained(DIR, safe_serialization=True))"
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in _ST_DTYPES:
                    raise UserError(f"{path.name}: tensor {name} has unsupported dtype {dtype}", "save the weights as fp32, fp16 or bf16")
                arr = f.get_tensor(name)
                out[name] = arr.astype(np.float32) if dtype in _FLOAT_DTYPES else arr
    except SafetensorError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise UserError(f"{path} is not a valid safetensors file: {reason[:200]}", fix) from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}", fix) from None
    return out


def check_weights(tensors: dict[str, np.ndarray], source: str | Path) -> None:
    """Weights a model can start from: floating-point and finite. An int8/int32/bool tensor is a
    quantised or foreign file (cast to float it would train from its codes, not its weights),
    and one NaN or inf makes every later step NaN and is then saved into checkpoints that verify.
    Refused in one line naming the tensor; checked per tensor, so memory stays one bool per value."""
    for name, arr in tensors.items():
        if arr.dtype.kind != "f":
            raise UserError(f"{source}: tensor {name} is {arr.dtype}, not a floating-point weight (a quantised or foreign file?)",
                            "use fp32, fp16 or bf16 weights (dequantise first)")
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        if bad:
            raise UserError(f"{source}: tensor {name} holds {bad:,} NaN or infinite value(s)",
                            "the weights are damaged: re-download or re-export them")


def _regular(files: list[Path]) -> list[Path]:
    """Refuse a FIFO, device or socket named like a weight file: opening a FIFO blocks forever."""
    import stat as stat_mod

    for f in files:
        try:
            mode = f.stat().st_mode
        except OSError as e:
            raise UserError(f"cannot read {f}: {e.strerror or e}", "download every weight file of the model") from None
        if not stat_mod.S_ISREG(mode):
            raise UserError(f"{f} is not a regular file (a FIFO, device or socket)", "replace it with the real weight file")
    return files


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of an HF folder (via the index when sharded); refuses pickled weights."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        resave = "re-save the model with save_pretrained(safe_serialization=True)"
        doc = read_json(index, resave)
        if not isinstance(doc, dict) or "weight_map" not in doc:
            raise UserError(f"{index} is not a valid safetensors index (no weight_map)", resave)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and Path(v).name == v and v not in ("", ".", "..")
                                                       for v in weight_map.values()):
            raise UserError(f"{index} maps tensors to something other than file names in {hf_dir}",
                            "re-save the model with save_pretrained(safe_serialization=True)")
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.exists()]
        if missing:
            raise UserError(f"shard {missing[0].name} listed in {index.name} is missing", "download every shard of the model")
        return _regular(files)
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        return _regular(files)
    pickled = [p for p in sorted(hf_dir.iterdir()) if p.suffix in _PICKLE_SUFFIXES]
    if pickled:
        raise UserError(f"{hf_dir} has only pickled PyTorch weights ({pickled[0].name}): safetensors are required (pickles are never loaded)",
                        "provide safetensors: model.save_pretrained(DIR, safe_serialization=True), or download the .safetensors files")
    raise UserError(f"no *.safetensors weights in {hf_dir}", "pass an HF model folder with config.json and model*.safetensors")


def read_hf_dir(hf_dir: str | Path, check_tokenizer: Callable[[Path, ModelConfig], None] | None = None,
                ) -> tuple[ModelConfig, dict[str, np.ndarray], Path | None]:
    """(resolved ModelConfig, our tensors, tokenizer path or None) from an HF model folder.

    The tokenizer is found, not read: `check_tokenizer(path, config)` is called before the
    weights are read, so a mismatch is refused in a second instead of after gigabytes."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir} is not a directory", "pass the HF model folder (with config.json and *.safetensors)")
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{hf_dir} has no config.json", "pass an HF model folder saved with save_pretrained (config.json + *.safetensors)")
    hf_cfg = read_json(cfg_path, "re-save the model config")
    m = config_from_hf(hf_cfg, str(cfg_path))
    # lexists, not is_file: a FIFO, a directory or a dangling link named tokenizer.model is the
    # folder's tokenizer gone wrong, not "no tokenizer" (which convert accepts with a note).
    tok_path = next((hf_dir / n for n in ("tokenizer.model", "tokenizer.json") if os.path.lexists(hf_dir / n)), None)
    if tok_path is not None:
        read_regular_bytes_check(tok_path, TEXT_CAP, "tokenizer file", f"replace {tok_path} with the model's own tokenizer file")
    if tok_path is not None and check_tokenizer is not None:
        check_tokenizer(tok_path, m)
    tensors: dict[str, np.ndarray] = {}
    for f in weight_files(hf_dir):
        part = read_safetensors(f)
        check_weights(part, f.name)
        tensors.update(part)
    m = tied_as_transformers(m, tensors)
    return m, hf_to_ours(tensors, m), tok_path


def tied_as_transformers(m: ModelConfig, tensors: dict[str, np.ndarray]) -> ModelConfig:
    """The config as transformers loads a folder whose config.json ties the embeddings
    (transformers 5.x modeling_utils.py `PreTrainedModel.tie_weights` during from_pretrained):
    a folder holding both embed_tokens and its own, different lm_head.weight is loaded untied
    with both kept (dropping the lm_head changed every logit); one holding only lm_head.weight
    ties the embedding to it (`tensors` is renamed in place)."""
    if not m.tie_embeddings or "lm_head.weight" not in tensors:
        return m
    from dataclasses import replace

    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
        return m
    head = tensors["lm_head.weight"]
    if head.shape == embed.shape and np.array_equal(head, embed):
        return m
    return replace(m, tie_embeddings=False)


# --------------------------------------------------------------------------- writing

def write_hf_dir(out: str | Path, m: ModelConfig, tensors: dict[str, np.ndarray],
                 special_ids: dict[str, int] | None = None) -> Path:
    """Write the weights and configs of an HF model folder that `AutoModelForCausalLM.from_pretrained(out)`
    loads cleanly; `special_ids` (bos/eos/pad) go into config.json and generation_config.json."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = special_ids or {}
    save_file(ours_to_hf(tensors, m), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_to_hf(m, ids), indent=2), encoding="utf-8")
    gen = {"_from_model_config": True, **{f"{k}_token_id": ids[k] for k in ("bos", "eos", "pad") if ids.get(k, -1) >= 0}}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    return out
