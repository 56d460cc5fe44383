"""The mixture-of-experts part of the HF bridge (model/hf.py calls it for a family with `moe`):
config.json's MoE keys, both directions. The expert tensors' names and their stacking are rows of
the parameter table (model/params.py).

Facts from transformers 5.x (models/qwen3_moe/configuration_qwen3_moe.py and modeling_qwen3_moe.py,
conversion_mapping.py "qwen2_moe"): the config class calls `num_experts` `num_local_experts`
(attribute_map; save_pretrained writes the latter) and defaults num_experts 128,
num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob false, decoder_sparse_step 1,
mlp_only_layers [], router_aux_loss_coef 0.001. In memory transformers 5 fuses each layer's experts
into `mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F); on disk
(save_pretrained, and the released checkpoints) they are per expert:
`mlp.experts.{e}.gate_proj.weight` (F, D), `up_proj` (F, D), `down_proj` (D, F), the router
`mlp.gate.weight` (E, D). Ours: `mlp.router.weight` (E, D), `mlp.w13.weight` (E, 2F, D: gate rows
then up rows, transformers' in-memory layout), `mlp.w2.weight` (E, D, F). Only the on-disk names are
read (a folder of fused tensors is refused as unexpected tensors).
"""
from __future__ import annotations

from typing import Any, Callable

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.families import family as family_of

_FIX = "pass the config.json written by transformers for this model"


def config_from_hf(hf: dict[str, Any], source: str, int_field: Callable[..., int]) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Qwen3-MoE config.json (transformers' defaults when absent)."""
    key = "num_local_experts" if hf.get("num_local_experts") is not None else "num_experts"
    experts = int_field(hf, key, source, 128)
    k = int_field(hf, "num_experts_per_tok", source, 8)
    if k > experts:
        raise UserError(f"{source}: num_experts_per_tok {k} exceeds {key} {experts}", _FIX)
    step = int_field(hf, "decoder_sparse_step", source, 1)
    norm = hf.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise UserError(f"{source}: norm_topk_prob = {norm!r} is not true or false", _FIX)
    dense = hf.get("mlp_only_layers") or []
    layers = hf.get("num_hidden_layers")
    if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in dense):
        raise UserError(f"{source}: mlp_only_layers = {dense!r} is not a list of layer indices", _FIX)
    coef = hf.get("router_aux_loss_coef", 0.001)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not 0 <= coef < 1e3:
        raise UserError(f"{source}: router_aux_loss_coef = {coef!r} is not a non-negative number", _FIX)
    shared = {}
    if family_of(hf.get("model_type")).shared_expert:  # Qwen2-MoE
        shared["shared_expert_ffn_dim"] = int_field(hf, "shared_expert_intermediate_size", source, 5632)
        if hf.get("qkv_bias", True) is not True:  # Qwen2MoeConfig's switch of the q/k/v bias
            raise UserError(f"{source}: qkv_bias = {hf['qkv_bias']!r}: Qwen2-MoE without the q/k/v bias is not supported", _FIX)
    return {**shared, "num_experts": experts, "experts_per_token": k, "moe_ffn_dim": int_field(hf, "moe_intermediate_size", source, 768),
            "norm_topk_prob": norm, "decoder_sparse_step": step, "mlp_only_layers": tuple(sorted(set(dense))),
            "router_aux_loss_coef": float(coef)}


def config_to_hf(m: ModelConfig) -> dict[str, Any]:
    """config.json's MoE keys (both spellings of the expert count, for transformers 4.x and 5.x)."""
    shared = {"shared_expert_intermediate_size": m.shared_expert_ffn_dim} if m.shared_expert_ffn_dim else {}
    return {**shared, "num_experts": m.num_experts, "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
            "moe_intermediate_size": m.expert_ffn, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": m.decoder_sparse_step, "mlp_only_layers": list(m.mlp_only_layers),
            "router_aux_loss_coef": m.router_aux_loss_coef, "output_router_logits": False}
