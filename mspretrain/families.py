"""The model families in one table: what each HF architecture is as our decoder's switches.

Every family is the same decoder block (model/decoder.py) with named switches; a `Family` row says
which switches its transformers class has, the names it goes by in an HF folder, and the
config.json defaults and keys that differ between the classes. The config's checks
(config/sections/model.py), the HF bridge (model/hf.py: convert and export), the presets
(model/presets.py; through their switches the parameter table, model/params.py, gives the
parameter shapes, HF tensor names and FLOPs) and export's message read this table: a new family
is one row here plus its transformers facts.

Layer 0 (imports nothing of the project but errors): the config schema checks against it.
Facts are transformers' (configuration_*.py and modeling_*.py of each class, 4.x and 5.x).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mspretrain.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str  # model.family, and config.json's model_type
    label: str  # how messages name it ("HF Qwen3")
    hf_class: str  # config.json's architectures[0]
    versions: str  # the released models it covers, for messages
    qkv_bias: bool  # a bias on q/k/v_proj (never on o_proj)
    qk_norm: bool  # RMSNorm per head on q and k before RoPE
    # sliding window: True = the class has one (0 in our config = full attention), False = never
    sliding_window: bool
    max_position_default: int  # config class default of max_position_embeddings (a config.json may omit it)
    head_dim_default: int | None  # config class default of head_dim; None: hidden_size / num_attention_heads
    # config.json's attention_bias would put a bias on o_proj too (Llama, Qwen3): refused on read
    attention_bias_key: bool
    # Qwen's per-layer sliding window keys (use_sliding_window, layer_types, max_window_layers):
    # refused when on, written off
    per_layer_window: bool
    head_dim_written: bool  # False: the config class has no head_dim key; written only when explicit
    export_keys: tuple[tuple[str, Any], ...]  # fixed keys export adds to config.json, in this order
    sliding_window_default: int = 0  # the config class's sliding_window when config.json has no such key
    # the config class's num_key_value_heads when config.json has no such key; None: num_attention_heads
    # (LlamaConfig's None; Qwen2Config and Qwen3Config default to 32, MistralConfig to 8, in 4.x and 5.x)
    kv_heads_default: int | None = None
    moe: bool = False  # a mixture of experts (model/moe.py): model.num_experts > 0, router + experts per MoE layer
    shared_expert: bool = False  # MoE layers add a shared expert behind a sigmoid gate (model.shared_expert_ffn_dim > 0)

    def switches(self) -> dict[str, Any]:
        """The ModelConfig fields this family fixes (a preset or `convert` passes them on)."""
        return {"family": self.name, "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm}


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", "LlamaForCausalLM", "Llama-2/3", qkv_bias=False, qk_norm=False, sliding_window=False,
           max_position_default=2048, head_dim_default=None, attention_bias_key=True, per_layer_window=False,
           head_dim_written=True, export_keys=(("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1))),
    Family("qwen2", "Qwen2", "Qwen2ForCausalLM", "Qwen2/2.5", qkv_bias=True, qk_norm=False, sliding_window=False,
           max_position_default=32768, head_dim_default=None, attention_bias_key=False, per_layer_window=True,
           head_dim_written=False, export_keys=(("use_sliding_window", False), ("sliding_window", None)), kv_heads_default=32),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "Qwen3", qkv_bias=False, qk_norm=True, sliding_window=False,
           max_position_default=32768, head_dim_default=128, attention_bias_key=True, per_layer_window=True,
           head_dim_written=True, export_keys=(("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None)),
           kv_heads_default=32),
    Family("mistral", "Mistral", "MistralForCausalLM", "Mistral", qkv_bias=False, qk_norm=False, sliding_window=True,
           max_position_default=4096 * 32, head_dim_default=None, attention_bias_key=False, per_layer_window=False,
           head_dim_written=True, export_keys=(), sliding_window_default=4096, kv_heads_default=8),
    # transformers 5.x models/qwen3_moe: Qwen3's attention (QK-norm, no bias) with a sparse MoE block
    # (its config class has no head_dim key: hidden_size / num_attention_heads unless config.json gives one)
    Family("qwen3_moe", "Qwen3Moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", qkv_bias=False, qk_norm=True, sliding_window=False,
           max_position_default=32768, head_dim_default=None, attention_bias_key=True, per_layer_window=True,
           head_dim_written=False, export_keys=(("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None)),
           moe=True, kv_heads_default=4),
    # transformers 5.x models/qwen2_moe: Qwen2's attention (q/k/v bias: its config's qkv_bias) and a shared expert
    Family("qwen2_moe", "Qwen2Moe", "Qwen2MoeForCausalLM", "Qwen2-MoE", qkv_bias=True, qk_norm=False, sliding_window=False,
           max_position_default=32768, head_dim_default=None, attention_bias_key=False, per_layer_window=True,
           head_dim_written=False, export_keys=(("use_sliding_window", False), ("sliding_window", None), ("qkv_bias", True)),
           moe=True, shared_expert=True, kv_heads_default=16),
)
NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)


def family(name: str) -> Family:
    """The row of `name`; an unknown name is one line listing the families."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise UserError(f"model family {name!r} is not supported", f"use one of: {', '.join(NAMES)}")


def described(conjunction: str = "and") -> str:
    """`Llama-2/3, Qwen2/2.5, Qwen3 and Mistral`: the families for messages and docs."""
    names = [f.versions for f in FAMILIES]
    return ", ".join(names[:-1]) + f" {conjunction} " + names[-1]


def switch_hint() -> str:
    """Which family has which switch, for the config check's one-line fix."""
    has = [f"{f.name} has qkv_bias" for f in FAMILIES if f.qkv_bias] + [f"{f.name} has qk_norm" for f in FAMILIES if f.qk_norm]
    has += [f"only {f.name} has a sliding_window" for f in FAMILIES if f.sliding_window]
    plain = [f.name for f in FAMILIES if not (f.qkv_bias or f.qk_norm or f.sliding_window)]
    return ", ".join(has) + "; " + " and ".join(plain) + " " + ("has" if len(plain) == 1 else "have") + " none of them"
