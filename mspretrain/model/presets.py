"""Named model presets as plain constructors, and the analytic parameter count.

Design choices: a preset is a function returning a `ModelConfig` (architecture only), looked up
by name through one plain dict; there is no registry to extend. Presets meant for a data dir's own
tokenizer (`tiny`, `demo`) leave `vocab_size = 0` so it is taken from the data; the larger ones
use Llama's 32,000. `param_shapes` and `param_count` read the parameter table (model/params.py):
the count equals transformers' `num_parameters()` of the family's class (tied embeddings counted
once), checked against HF in the tests.
"""
from __future__ import annotations

import math
from typing import Callable

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.errors import UserError
from mspretrain.families import family
from mspretrain.model import params


def tiny() -> ModelConfig:
    """Unit tests and smoke runs: seconds per step on a laptop CPU."""
    return ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=0, vocab_size=0, max_seq_len=512)


def demo() -> ModelConfig:
    """The CPU demo (configs/demo.toml): ~5 M parameters with an 8 k vocabulary, grouped-query attention."""
    return ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=0, max_seq_len=256)


def gpt_125m() -> ModelConfig:
    """GPT-3 Small shape with the Llama block (~134 M with a 32 k vocabulary)."""
    return ModelConfig(dim=768, n_layers=12, n_heads=12, vocab_size=32000, max_seq_len=2048)


def gpt_350m() -> ModelConfig:
    """GPT-3 Medium shape with the Llama block (~370 M with a 32 k vocabulary)."""
    return ModelConfig(dim=1024, n_layers=24, n_heads=16, vocab_size=32000, max_seq_len=2048)


def llama_1b() -> ModelConfig:
    """TinyLlama-1.1B's shape: 22 layers, 4 KV heads."""
    return ModelConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, vocab_size=32000, max_seq_len=2048)


def llama2_7b() -> ModelConfig:
    """Meta's Llama-2-7B (6.74 B parameters)."""
    return ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000,
                       max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5)


def llama3_8b() -> ModelConfig:
    """Meta's Llama-3.1-8B (8.03 B parameters): 128,256 vocabulary, GQA 8, llama3 RoPE scaling."""
    return ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                       max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, rope_scaling="llama3",
                       rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192)


def qwen25_7b() -> ModelConfig:
    """Qwen2.5-7B (7.62 B parameters): q/k/v bias, 152,064-row embedding and untied lm_head, GQA 4."""
    return ModelConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
                       max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-6, **family("qwen2").switches())


def qwen3_8b() -> ModelConfig:
    """Qwen3-8B (8.19 B parameters): QK-norm, 151,936 vocabulary, GQA 8; head_dim 128 = 4096 / 32, so 0 (automatic)."""
    return ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=0, ffn_dim=12288, vocab_size=151936,
                       max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, **family("qwen3").switches())


def qwen3_14b() -> ModelConfig:
    """Qwen3-14B (14.77 B parameters): QK-norm, GQA 8, 151,936 vocabulary, untied lm_head (HF
    Qwen/Qwen3-14B config.json: hidden 5120, 40 layers, 40 heads, intermediate 17408, rms eps 1e-6);
    head_dim 128 = 5120 / 40, so 0 (automatic), as `convert` reads it."""
    return ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=0, ffn_dim=17408, vocab_size=151936,
                       max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, **family("qwen3").switches())


def qwen25_32b() -> ModelConfig:
    """Qwen2.5-32B (32.76 B parameters): q/k/v bias, GQA 8, 152,064-row embedding, untied lm_head (HF
    Qwen/Qwen2.5-32B config.json: hidden 5120, 64 layers, 40 heads, intermediate 27648, rms eps 1e-5);
    the 32,768 context of the 7B preset."""
    return ModelConfig(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648, vocab_size=152064,
                       max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-5, **family("qwen2").switches())


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B (30.5 B parameters, 3.3 B active): 48 layers, hidden 2048, 32 heads, 4 KV heads,
    head_dim 128, 128 experts of width 768, 8 routed per token, QK-norm, 151,936 vocabulary, untied
    lm_head (HF Qwen/Qwen3-30B-A3B config.json: intermediate_size 6144 for dense layers, none here;
    rms eps 1e-6, rope theta 1e6, norm_topk_prob true, router_aux_loss_coef 0.001)."""
    return ModelConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, vocab_size=151936,
                       max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, num_experts=128, experts_per_token=8,
                       moe_ffn_dim=768, **family("qwen3_moe").switches())


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "demo": demo,
    "125m": gpt_125m,
    "350m": gpt_350m,
    "1b": llama_1b,
    "llama2-7b": llama2_7b,
    "llama3-8b": llama3_8b,
    "qwen2.5-7b": qwen25_7b,
    "qwen3-8b": qwen3_8b,
    "qwen3-14b": qwen3_14b,
    "qwen2.5-32b": qwen25_32b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset; unknown names are a UserError listing the choices."""
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}", f"choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, equal to transformers' `num_parameters()` of the family's HF class for the
    same config: q/k/v biases, QK-norm weights and an untied lm_head counted, a tied one once."""
    return sum(math.prod(shape) for _, shape in param_shapes(cfg))


def param_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every trainable parameter, in the order `Decoder.trainable_params()` gives
    them: the planner lays out owners and buckets from this exactly as the train step does. The
    rows of model/params.py, expanded for the config."""
    m = resolve_model(cfg)
    if m.vocab_size <= 0:
        raise UserError("model.vocab_size is 0 (taken from the tokenizer at train time), so the parameter shapes are unknown",
                        "pass model.vocab_size=N (e.g. the tokenizer's vocabulary size)")
    return params.shapes(m)


def is_half_eligible(name: str) -> bool:
    """May be stored in the compute dtype (model/params.py's `half` column; `model.decoder.half_eligible`
    reads the same)."""
    return params.half_eligible(name)
