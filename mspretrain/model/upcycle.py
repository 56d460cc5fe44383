"""Upcycling (issue 52 item 5): a mixture of experts built from a dense checkpoint.

Every tensor of the dense model is kept; each MoE layer's E experts start as copies of that layer's
dense SwiGLU (w13, w2), and its router is the MoE model's own seeded initialisation (the run seed,
model/decoder.py InitStreams). With normalised top-k weights (`norm_topk_prob`, required here) the
routing weights of a token sum to 1, so a mixture of identical experts is the dense MLP: at step 0
the upcycled model's logits are the dense model's (up to the rounding of sum_k w_k * y, ~1e-7
relative in fp32; tests/model/test_moe_upcycle.py). Training then lets the experts drift apart (the
routers give each token's experts different gradients). Komatsuzaki et al., "Sparse Upcycling"
(arXiv 2212.05055); Nemotron-4 15B upcycled (arXiv 2410.07524).

The dense family must be the MoE family's dense sibling (the attention is kept as it is): Qwen3 ->
Qwen3-MoE, the only MoE family so far.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.model import params

DENSE_OF = {"qwen3_moe": "qwen3"}  # MoE family -> the dense family whose checkpoints it upcycles


MOE_KEYS = ("num_experts", "experts_per_token", "moe_ffn_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
            "router_aux_loss_coef", "shared_expert_ffn_dim")  # the model keys an MoE config adds to its dense sibling's


def as_dense(moe: ModelConfig) -> ModelConfig:
    """The dense sibling of an MoE config (what `train --init-from DENSE --upcycle` checks the dense
    checkpoint against): the same keys, the dense family, no experts."""
    if moe.family not in DENSE_OF:
        raise UserError(f"--upcycle needs a mixture-of-experts model config; model.family = {moe.family} is dense",
                        "set model.family=qwen3_moe and model.num_experts (e.g. 8) for the run to upcycle into")
    return replace(moe, family=DENSE_OF[moe.family], **{k: ModelConfig.__dataclass_fields__[k].default for k in MOE_KEYS})


def with_experts(dense: ModelConfig, moe: ModelConfig) -> ModelConfig:
    """The dense checkpoint's resolved config with `moe`'s family and MoE keys (expert width: the
    dense ffn_dim unless moe_ffn_dim is given)."""
    keys = {k: getattr(moe, k) for k in MOE_KEYS}
    keys["moe_ffn_dim"] = moe.moe_ffn_dim or dense.ffn_dim
    return replace(dense, family=moe.family, **keys)


def check_upcycle(dense: ModelConfig, moe: ModelConfig) -> None:
    """The MoE config upcycles the dense one: the same model but for the MLPs, expert width = dense width."""
    if DENSE_OF.get(moe.family) != dense.family:
        raise UserError(f"cannot upcycle a {dense.family} checkpoint into model.family = {moe.family}",
                        f"upcycle {', '.join(f'{d} into {m}' for m, d in DENSE_OF.items())} (the attention stays as it is)")
    if not moe.norm_topk_prob:
        raise UserError("upcycling needs model.norm_topk_prob = true (the top-k weights summing to 1 keep the dense model's output)",
                        "set model.norm_topk_prob=true")
    if moe.expert_ffn != dense.ffn_dim:
        raise UserError(f"model.moe_ffn_dim = {moe.expert_ffn} is not the dense checkpoint's ffn_dim {dense.ffn_dim}",
                        f"set model.moe_ffn_dim={dense.ffn_dim} (each expert starts as a copy of the dense MLP)")
    same = replace(moe, family=dense.family, num_experts=0, experts_per_token=dense.experts_per_token, moe_ffn_dim=dense.moe_ffn_dim,
                   norm_topk_prob=dense.norm_topk_prob, decoder_sparse_step=dense.decoder_sparse_step,
                   mlp_only_layers=dense.mlp_only_layers, router_aux_loss_coef=dense.router_aux_loss_coef)
    if same != dense:
        diff = next(k for k in dense.__dataclass_fields__ if getattr(same, k) != getattr(dense, k))
        raise UserError(f"model.{diff} = {getattr(moe, diff)!r} differs from the dense checkpoint's {getattr(dense, diff)!r}",
                        "upcycling changes only the MLPs: keep every other model key of the dense checkpoint")


def fresh_names(moe: ModelConfig) -> list[str]:
    """The MoE layers' parameters a dense checkpoint has no counterpart for (the router, a shared
    expert): the MoE model's own seeded ones are kept. Every other MoE-layer row of the parameter
    table (model/params.py) is an expert stack, copied from the dense tensor of the same name."""
    return [name for name, r, _ in params.expand(moe) if r.where == "moe" and not r.experts]


def upcycle(dense: dict[str, np.ndarray], dense_cfg: ModelConfig, moe_cfg: ModelConfig,
            routers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The MoE model's tensors (our names): the dense ones, each MoE layer's expert stacks (w13, w2)
    the dense layer's matrix repeated over its experts, the `fresh_names` (routers) from `routers`
    (the seeded MoE model's)."""
    check_upcycle(dense_cfg, moe_cfg)
    out = dict(dense)
    E = moe_cfg.num_experts
    for name, r, _ in params.expand(moe_cfg):
        if r.where != "moe":
            continue
        if r.experts:
            w = np.asarray(dense[name], np.float32)
            out[name] = np.ascontiguousarray(np.broadcast_to(w, (E,) + w.shape))
        else:
            out[name] = np.asarray(routers[name], np.float32)
    return out
