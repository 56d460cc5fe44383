"""The decoder block (attention and SwiGLU MLP, pre-norm residuals) and, under ZeRO-3, the
prefetch of its weights (step/zero3.py has the whole design).

ZeRO-3 prefetch. A sharded block gathers all its weights at the start of its construct as one
chain, each gather after the previous one (`Block.pull`), the first after the `token` it is given,
and hands on `relay(last gathered weight, x)`, x its own input: the next block's chain starts once
this block's gathers are done and this block has started, so it runs while this block computes
(the overlap), while the block after that waits for the next block's input, i.e. the end of this
block (at most two blocks' gathered weights at once). The gathers stay inside the block's cell so
that layer recompute gathers again in the backward.
"""
from __future__ import annotations

import math
from typing import Any

import mindspore as ms
from mindspore import Tensor, nn, ops

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.model.attention import Attention
from mspretrain.model.layers import Linear, RMSNorm, WeightSource, one, relay
from mspretrain.model.moe import MoE


class MLP(nn.Cell):
    """SwiGLU: w2(silu(x w1^T) * (x w3^T)), with w1 and w3 fused into w13. `ws`: (w13, w2) whole
    (ZeRO-3), else its own Parameters."""

    def __init__(self, cfg: ModelConfig, rng: WeightSource, dtype: ms.Type) -> None:
        super().__init__()
        self.ffn = cfg.ffn_dim
        # tensor parallel: w13's gate | up rows cut per block (column), w2's input columns (row)
        self.w13 = Linear(cfg.dim, 2 * cfg.ffn_dim, cfg.init_std, rng, dtype, role="column", blocks=(cfg.ffn_dim, cfg.ffn_dim))
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, cfg.init_std / math.sqrt(2 * cfg.n_layers), rng, dtype, role="row")

    def construct(self, x: Tensor, ws: tuple = (None, None)) -> Tensor:
        gate, up = self.w13.parts(x, (self.ffn, self.ffn), ws[0])  # (B, T, F) each
        return self.w2(ops.silu(gate) * up, ws[1])

    def apply_tp(self, group: Any) -> dict[str, Any]:
        """Tensor parallel: this rank's ffn units (model/parallel.py)."""
        self.ffn //= group.size
        return {**self.w13.apply_tp(group), **self.w2.apply_tp(group)}

    def pull(self, token: Tensor) -> tuple[tuple, Tensor]:
        w13, _, token = self.w13.pull(token)
        w2, _, token = self.w2.pull(token)
        return (w13, w2), token


class Block(nn.Cell):
    """construct(x, cos, sin, bias, discard) -> x: the block on its own Parameters. ZeRO-3
    (step/zero3.py `shard_model` sets `sharded`): construct(x, ..., token) -> (x, token) (an MoE
    block: (x, token, routing stats)), the
    block's weights gathered first (module docstring); `prefetch` False anchors the chain on x
    instead of the token (no overlap: the CPU with layer recompute, see step/zero3.py)."""

    def __init__(self, cfg: ModelConfig, rng: WeightSource, dtype: ms.Type, use_flash: bool, sparse: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.attn = Attention(cfg, rng, dtype, use_flash)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        # sparse: a mixture of experts (model/moe.py); construct then returns (x, routing stats)
        self.sparse = sparse
        self.mlp = MoE(cfg, rng, dtype) if sparse else MLP(cfg, rng, dtype)
        self.prefetch = True

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, discard: Tensor | None,
                  token: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if token is None:  # whole Parameters (no ZeRO-3): the graph it always was
            x = x + self.attn(self.attn_norm(x), cos, sin, bias, discard)
            if self.sparse:
                y, stats = self.mlp(self.mlp_norm(x))
                return x + y, stats
            return x + self.mlp(self.mlp_norm(x))
        (n1, attn, n2, mlp), last = self.pull(token if self.prefetch else one(x))
        h = x + self.attn(self.attn_norm(x, n1), cos, sin, bias, discard, attn)
        if self.sparse:  # MoE (model/moe.py `MoE.pull`): (x, token, routing stats)
            y, stats = self.mlp(self.mlp_norm(h, n2), mlp)
            return h + y, relay(last, x), stats
        return h + self.mlp(self.mlp_norm(h, n2), mlp), relay(last, x)

    def apply_tp(self, group: Any) -> dict[str, Any]:
        """Tensor parallel (model/parallel.py): every cell cut by its declared role, the attention
        to this rank's heads (its flash kernels' head count too), the MLP to its ffn units; returns
        {parameter name: (whole shape, where)} of the cut parameters."""
        if self.sparse:
            raise UserError("tensor parallel does not cut a mixture-of-experts layer yet",
                            "train an MoE model with parallel.tp=1 (whole replicas)")
        from mspretrain.model.parallel import flash_with_heads

        attn = self.attn
        attn.n_heads, attn.n_kv = attn.n_heads // group.size, attn.n_kv // group.size
        if attn.use_flash:  # the kernels' head_num: the local heads (Ascend only, not run here)
            for prim in ("flash_causal", "flash_masked", "flash_band", "flash_band_masked"):
                if hasattr(attn, prim):  # the ones its window and masks made (model/attention.py)
                    setattr(attn, prim, flash_with_heads(getattr(attn, prim), attn.n_heads))
        out: dict[str, Any] = {}
        for cell in (self.attn_norm, attn.wqkv, attn.wo, self.mlp_norm):
            out.update(cell.apply_tp(group))
        if attn.qk_norm:
            attn.q_norm.apply_tp(group)
            attn.k_norm.apply_tp(group)
        out.update(self.mlp.apply_tp(group))
        return out

    def pull(self, token: Tensor) -> tuple[tuple, Tensor]:
        """ZeRO-3: every weight of the block whole, gathered in the order the forward uses them
        (attn_norm, wqkv (+ bias), q_norm, k_norm, wo, mlp_norm, w13, w2), each after the previous
        one, the first after `token`; and the last gathered one."""
        n1, token = self.attn_norm.pull(token)
        attn, token = self.attn.pull(token)
        n2, token = self.mlp_norm.pull(token)
        mlp, token = self.mlp.pull(token)
        return (n1, attn, n2, mlp), token

    def cached(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, kc: Tensor, vc: Tensor,
               slot: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Decoding with a static-shape cache kc/vc (B, KV, S, hd). slot None: prefill from position 0
        (the T new keys fill slots 0..T-1); else slot (1, 1, S, 1) is 1 at the one position written.
        Whole Parameters only (decoding never runs on ZeRO-3 slices)."""
        q, k, v = self.attn.project(self.attn_norm(x), cos, sin)  # k, v: (B, KV, T, hd)
        if slot is None:
            pad = ops.zeros((k.shape[0], k.shape[1], kc.shape[2] - k.shape[2], k.shape[3]), kc.dtype)
            kc, vc = ops.concat((k.astype(kc.dtype), pad), 2), ops.concat((v.astype(vc.dtype), pad), 2)
        else:  # a blend, not a scatter: static shapes and exact (x*1 + y*0 == x)
            kc = kc * (1 - slot) + k.astype(kc.dtype) * slot
            vc = vc * (1 - slot) + v.astype(vc.dtype) * slot
        x = x + self.attn.output(self.attn.attend(q, kc, vc, bias))
        if self.sparse:
            return x + self.mlp(self.mlp_norm(x))[0], kc, vc
        return x + self.mlp(self.mlp_norm(x)), kc, vc
